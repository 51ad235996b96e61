"""Who is asking: credentials checked against the configured tenants.

A credential is an API key (``sd_<id>_<secret>``, see :mod:`seedance.tenants.keys`) or, when
``[auth.jwt]`` is configured, a JSON Web Token whose ``tenant`` claim names a tenant. It comes
from ``Authorization: Bearer``, the ``api_key`` query parameter (browsers), or a
``bearer.<token>`` WebSocket subprotocol entry (``openai-insecure-api-key.<token>`` too, as
OpenAI's browser clients send it to the Realtime API).

A request that brings no credential may come with a client certificate instead (``serve
--tls-client-ca``, verified by the TLS handshake): one whose subject a tenant lists in
``tls_subjects`` is that tenant with role ``user``, its credential ``cert:`` and the first 16
hex digits of the certificate's SHA-256. A credential, when there is one, is what counts.

Checking is cheap and comes first: an address whose credentials failed too often is refused
before anything is checked; a key costs one SHA-256 and a constant-time comparison (also when
its id is unknown); a JWT one signature check. Nothing else (sessions, models, bodies) is
touched before the credential passes.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs

import msgspec

from seedance.observability.audit import kinds as audit
from seedance.protocol.errors import QuotaExceeded, SeedanceError, Unauthorized
from seedance.tenants.config import (
    OPEN_TENANT,
    AccessConfig,
    ApiKey,
    Role,
    Tenant,
    jwt_algorithms,
)
from seedance.tenants.keys import key_digest, key_id_of

#: Failed credentials an address may present in a burst, and how fast it earns them back.
FAILURE_BURST: Final = 10
FAILURE_WINDOW_S: Final = 60.0
_DUMMY_DIGEST: Final = "0" * 64


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its tenant, the credential's id and role."""

    tenant: Tenant
    credential: str  # a key id, jwt:<sub>, cert:<sha256 prefix> ("-" in open mode)
    role: Role
    #: A client certificate's subject, or a token's ``sub`` ("" for a key).
    subject: str = ""
    #: A token's claims whose values are strings, for access policies (docs/policy.md).
    claims: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.tenant.name


@dataclass(frozen=True, slots=True)
class ClientCertificate:
    """A client's certificate, verified by the TLS handshake."""

    subject: str  # RFC 4514, as x509.Name.rfc4514_string writes it
    sha256: str  # of its DER, in hex

    @property
    def credential(self) -> str:
        """How logs and audit records name it."""
        return f"cert:{self.sha256[:16]}"


#: The caller of a server without tenants: no limit, any priority.
OPEN_PRINCIPAL: Final = Principal(Tenant(name=OPEN_TENANT, max_priority=10), "-", "admin")


class Authenticator:
    """Checks credentials against the tenants of an :class:`AccessConfig` (reloadable)."""

    def __init__(self, access: AccessConfig, clock: Callable[[], float] = time.monotonic):
        self.failures = FailureLimiter(clock=clock)
        self._jwt: _JwtVerifier | None = None
        self.load(access)

    def load(self, access: AccessConfig) -> None:
        self.access = access
        self.open = access.open
        self._keys: dict[str, tuple[ApiKey, Tenant]] = {
            key.id: (key, tenant) for tenant in access.tenants.values() for key in tenant.keys
        }
        self._subjects: dict[str, Tenant] = {
            subject: tenant for tenant in access.tenants.values() for subject in tenant.tls_subjects
        }
        jwt = access.auth.jwt
        self._jwt = None if jwt is None else _JwtVerifier(access)

    def revoke(self, key_id: str) -> bool:
        """Refuse key ``key_id`` from now on (in memory); false if there is no such key."""
        found = self._keys.get(key_id)
        if found is None:
            return False
        key, tenant = found
        self._keys[key_id] = (msgspec.structs.replace(key, revoked=True), tenant)
        return True

    @property
    def jwt_algorithms(self) -> list[str]:
        return list(self._jwt.algorithms) if self._jwt is not None else []

    def subjects(self) -> dict[str, str]:
        """The client certificate subjects that stand for a tenant: subject to tenant name."""
        return {subject: tenant.name for subject, tenant in self._subjects.items()}

    def key_ids(self) -> set[str]:
        """The ids of the keys that pass (not revoked)."""
        return {key_id for key_id, (key, _) in self._keys.items() if not key.revoked}

    def authenticate(
        self, credential: str | None, address: str, certificate: ClientCertificate | None = None
    ) -> Principal:
        """The caller behind ``credential``, else behind ``certificate``; :class:`Unauthorized`
        when there is none or it is bad, :class:`QuotaExceeded` when ``address`` failed too
        often."""
        if self.open:
            return OPEN_PRINCIPAL
        self.failures.check(address)
        try:
            if not credential and certificate is not None:
                return self._certificate(certificate)
            return self._verify(credential)
        except Unauthorized:
            self.failures.record(address)
            raise

    def _certificate(self, certificate: ClientCertificate) -> Principal:
        tenant = self._subjects.get(certificate.subject)
        if tenant is None:
            raise Unauthorized(
                f"the client certificate {certificate.subject[:200]} is no tenant's "
                "(tls_subjects): a credential is required: Authorization: Bearer <key>, the "
                "api_key query parameter, or a bearer.<key> subprotocol"
            )
        return Principal(tenant, certificate.credential, "user", subject=certificate.subject)

    def _verify(self, credential: str | None) -> Principal:
        if not credential:
            raise Unauthorized(
                "a credential is required: Authorization: Bearer <key>, the api_key query "
                "parameter, or a bearer.<key> subprotocol"
            )
        key_id = key_id_of(credential)
        if key_id is not None:
            found = self._keys.get(key_id)
            expected = found[0].sha256 if found is not None else _DUMMY_DIGEST
            ok = hmac.compare_digest(key_digest(credential), expected)
            if not ok or found is None:
                raise Unauthorized("invalid API key")
            key, tenant = found
            if key.revoked:
                raise Unauthorized(f"API key {key.id} has been revoked")
            return Principal(tenant, key.id, key.role)
        if self._jwt is not None and credential.count(".") == 2:
            return self._jwt.verify(credential)
        raise Unauthorized("invalid credential: not an API key (sd_...) or an accepted token")


class _JwtVerifier:
    """JSON Web Tokens (PyJWT): HS256 with the shared secret, or EdDSA / RS256 / ES256 with the
    public key; ``exp`` and ``tenant`` are required, ``role`` is ``user`` unless it says
    ``admin``, which only the tenants of ``admin_tenants`` may say."""

    def __init__(self, access: AccessConfig) -> None:
        import jwt

        settings = access.auth.jwt
        assert settings is not None
        self._jwt = jwt
        self.tenants = access.tenants
        self.settings = settings
        self.key, self.algorithms = jwt_algorithms(settings, access.jwt_public_key, "auth.jwt")

    def verify(self, token: str) -> Principal:
        jwt, settings = self._jwt, self.settings
        try:
            claims = jwt.decode(
                token,
                self.key,
                algorithms=self.algorithms,
                leeway=settings.leeway_s,
                audience=settings.audience,
                issuer=settings.issuer,
                options={"require": ["exp", "tenant"], "verify_aud": settings.audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("token expired") from None
        except (jwt.PyJWTError, ValueError, TypeError) as exc:  # whatever a token can make
            raise Unauthorized(f"invalid token: {exc}") from None
        tenant = self.tenants.get(str(claims["tenant"]))
        if tenant is None:
            raise Unauthorized("invalid token: unknown tenant")
        role = claims.get("role", "user")
        if role not in ("user", "admin"):
            raise Unauthorized(f"invalid token: role {role!r} is not user or admin")
        if role == "admin" and tenant.name not in settings.admin_tenants:
            raise Unauthorized(
                f"invalid token: tenant {tenant.name} may not grant role admin by token "
                "(auth.jwt.admin_tenants)"
            )
        subject = claims.get("jti") or claims.get("sub") or "-"
        strings = tuple(sorted((k, v) for k, v in claims.items() if isinstance(v, str)))
        return Principal(
            tenant, f"jwt:{subject}", role, subject=str(claims.get("sub", "")), claims=strings
        )


class FailureLimiter:
    """Per address, a bucket of ``burst`` failures refilled over ``window_s``; an address with
    none left is refused without its credential being looked at. Holds at most ``max_addresses``
    (the fullest buckets are the ones forgotten: they are as good as new)."""

    def __init__(
        self,
        burst: int = FAILURE_BURST,
        window_s: float = FAILURE_WINDOW_S,
        max_addresses: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.rate = burst / window_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def _tokens(self, address: str, now: float) -> float:
        entry = self._buckets.get(address)
        if entry is None:
            return float(self.burst)
        tokens, at = entry
        return min(float(self.burst), tokens + (now - at) * self.rate)

    def check(self, address: str) -> None:
        now = self.clock()
        tokens = self._tokens(address, now)
        if tokens < 1.0:
            wait = math.ceil((1.0 - tokens) / self.rate)
            raise QuotaExceeded(
                f"too many failed credentials from this address; retry in {wait} s",
                retry_after_s=float(wait),
            )

    def record(self, address: str) -> None:
        now = self.clock()
        tokens = self._tokens(address, now) - 1.0
        self._buckets[address] = (tokens, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)


# ---------------------------------------------------------------------- where credentials are


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if any."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def credential_of(scope: Mapping[str, Any]) -> str | None:
    """The credential of an ASGI request: its bearer header, else the ``api_key`` query
    parameter, else a ``bearer.<token>`` subprotocol entry (WebSocket)."""
    return (
        bearer(scope.get("headers", ()))
        or _query_key(scope.get("query_string", b""))
        or subprotocol_key(scope.get("subprotocols", ()))
    )


def certificate_of(scope: Mapping[str, Any]) -> ClientCertificate | None:
    """The client certificate of an ASGI request, from the TLS extension
    (``scope["extensions"]["tls"]``), if the client presented one."""
    tls = (scope.get("extensions") or {}).get("tls")
    if not tls or not tls.get("client_cert_name") or not tls.get("client_cert_chain"):
        return None
    der = ssl.PEM_cert_to_DER_cert(tls["client_cert_chain"][0])
    return ClientCertificate(tls["client_cert_name"], hashlib.sha256(der).hexdigest())


def _query_key(query: bytes) -> str | None:
    if b"api_key=" not in query:
        return None
    values = parse_qs(query.decode("latin-1")).get("api_key")
    return values[0] if values else None


#: Subprotocol entries that carry a credential: Seedance's, and the one OpenAI's browser
#: clients send to the Realtime API.
CREDENTIAL_SUBPROTOCOLS: Final = ("bearer.", "openai-insecure-api-key.")


def subprotocol_key(subprotocols: Iterable[str]) -> str | None:
    """The token of a ``bearer.<token>`` (or ``openai-insecure-api-key.<token>``) subprotocol
    entry, if any."""
    for entry in subprotocols:
        for prefix in CREDENTIAL_SUBPROTOCOLS:
            if entry.startswith(prefix) and len(entry) > len(prefix):
                return entry[len(prefix) :]
    return None


def refusal_record(
    api: str, scope: Mapping[str, Any], principal: Principal | None, error: SeedanceError
) -> audit.Refused:
    """The audit record of a connection or HTTP request refused before it started."""
    return audit.Refused(
        api=api,
        peer=peer_of(scope),
        path=scope.get("path", ""),
        tenant=principal.name if principal is not None else None,
        credential=principal.credential if principal is not None else None,
        outcome=error.code,
        message=error.message,
    )


def peer_of(scope: Mapping[str, Any]) -> str:
    """``host:port`` of the client, as logs and audit records name it."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def client_address(scope: Mapping[str, Any]) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "-"
