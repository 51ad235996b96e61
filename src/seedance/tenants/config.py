"""Tenants and their credentials, as the TOML config file declares them.

```toml
[tenants.acme]
tier = 2                              # weight in fair admission (default 1)
models = ["smollm2-*"]                # models it may use (shell patterns; default: all)
max_priority = 5                      # highest `priority` its requests may ask (default 0)
labels = { region = "eu", environment = ["prod", "staging"] }
                                      # servers it may use: where the server's `labels` has
                                      # the key, its value must be one of these
tls_subjects = ["CN=desk-1,O=Acme Bank"]
                                      # client certificates that stand for this tenant, by
                                      # subject in RFC 4514 (most specific first, no spaces
                                      # after commas); verified against --tls-client-ca,
                                      # role user; one subject names one tenant only

[tenants.acme.quotas]                 # each optional; absent: no limit
connections = 100                     # concurrent WebSocket connections
generations = 8                       # concurrent generations
requests_per_minute = 600
tokens_per_minute = 200000            # prompt + completion
max_tokens = 1024                     # per request
sessions = 1000                       # live sessions

[[tenants.acme.keys]]                 # written by `seedance keys add`
id = "3f9a1c2e"
sha256 = "…"                          # of the whole key; the key itself is never stored
role = "user"                         # or "admin"
created = 2026-11-30T13:00:00Z

[auth.jwt]                            # optional: JSON Web Tokens as credentials too
secret = "…"                          # HS256; or public_key = "/path/key.pem" (EdDSA, RS256, ES256)
leeway_s = 30                         # clock skew allowed on exp/nbf/iat
admin_tenants = ["ops"]               # tenants whose tokens may carry role admin (default none)
```

The tables are read with msgspec into typed structs; a wrong type, an unknown key or a value out
of range stops the server with one line naming the key (``tenants.acme.quotas.connections``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from seedance.settings import ConfigError

Role = Literal["user", "admin"]
ROLES: Final = ("user", "admin")
TENANT_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_ID: Final = re.compile(r"[0-9a-f]{8,32}")
#: Every client is this tenant when no tenant is configured (open mode).
OPEN_TENANT: Final = "default"

Positive = Annotated[int, msgspec.Meta(ge=1)]


class ApiKey(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    id: Annotated[str, msgspec.Meta(pattern=KEY_ID.pattern)]
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    role: Role = "user"
    created: datetime | None = None
    revoked: bool = False
    revoked_at: datetime | None = None


class Quotas(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    connections: Positive | None = None
    generations: Positive | None = None
    requests_per_minute: Positive | None = None
    tokens_per_minute: Positive | None = None
    max_tokens: Positive | None = None
    sessions: Positive | None = None
    session_bytes: Positive | None = None


class Tenant(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    name: str = ""  # filled from the table's key
    tier: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    models: tuple[str, ...] | None = None
    max_priority: Annotated[int, msgspec.Meta(ge=-10, le=10)] = 0
    labels: dict[str, str | list[str]] = msgspec.field(default_factory=dict)
    quotas: Quotas = Quotas()
    keys: tuple[ApiKey, ...] = ()
    tls_subjects: tuple[str, ...] = ()
    #: WebAssembly modules every request of the tenant runs through (docs/modules.md).
    modules: tuple[str, ...] = ()
    #: Import modules beyond Seedance's own its modules may be given (``wasi_snapshot_preview1``).
    wasm_imports: tuple[str, ...] = ()


class JwtSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    secret: str | None = None
    public_key: str | None = None  # a PEM file's path (EdDSA, RS256, ES256)
    algorithms: tuple[str, ...] | None = None
    admin_tenants: tuple[str, ...] = ()  # tenants whose tokens may carry role admin
    leeway_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0
    audience: str | None = None
    issuer: str | None = None


class AuthSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    jwt: JwtSettings | None = None


class AccessConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The ``[tenants.*]`` and ``[auth]`` tables: who may connect, with what."""

    tenants: dict[str, Tenant] = msgspec.field(default_factory=dict)
    auth: AuthSettings = AuthSettings()
    #: The PEM text of ``auth.jwt.public_key``, read when the file is loaded.
    jwt_public_key: str | None = None

    @property
    def open(self) -> bool:
        """No tenant configured: anyone who can reach the server may use it."""
        return not self.tenants


def parse_access(data: Mapping[str, Any], source: str, base: Path | None = None) -> AccessConfig:
    """The access tables of a TOML document (``data`` holds its top-level keys)."""
    tenants_raw = data.get("tenants", {})
    auth_raw = data.get("auth", {})
    if not isinstance(tenants_raw, dict):
        raise ConfigError(f"{source}: tenants: expected a table, got {type(tenants_raw).__name__}")
    tenants: dict[str, Tenant] = {}
    for name, table in tenants_raw.items():
        if not TENANT_NAME.fullmatch(name):
            raise ConfigError(
                f"{source}: tenants.{name}: a tenant name is 1-64 characters of A-Z a-z 0-9 _ . -"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: tenants.{name}: expected a table")
        tenant = _convert({**table, "name": name}, Tenant, f"{source}: tenants.{name}")
        subjects = _subjects(tenant.tls_subjects, f"{source}: tenants.{name}.tls_subjects")
        tenants[name] = msgspec.structs.replace(tenant, tls_subjects=subjects)
    seen: dict[str, str] = {}
    for tenant in tenants.values():
        for key in tenant.keys:
            if key.id in seen:
                raise ConfigError(
                    f"{source}: key id {key.id} appears twice (tenants {seen[key.id]} and "
                    f"{tenant.name})"
                )
            seen[key.id] = tenant.name
    owners: dict[str, str] = {}
    for tenant in tenants.values():
        for subject in tenant.tls_subjects:
            if subject in owners:
                raise ConfigError(
                    f"{source}: client certificate subject {subject} is listed by tenants "
                    f"{owners[subject]} and {tenant.name}"
                )
            owners[subject] = tenant.name
    auth = _convert(auth_raw, AuthSettings, f"{source}: auth")
    public_key = None
    jwt = auth.jwt
    if jwt is not None:
        if (jwt.secret is None) == (jwt.public_key is None):
            raise ConfigError(f"{source}: auth.jwt: set one of secret (HS256) and public_key")
        if jwt.public_key is not None:
            path = Path(jwt.public_key).expanduser()
            if base is not None and not path.is_absolute():
                path = base / path
            try:
                public_key = path.read_text()
            except OSError as exc:
                raise ConfigError(
                    f"{source}: auth.jwt.public_key: cannot read {path}: {exc.strerror}"
                ) from None
        jwt_algorithms(jwt, public_key, f"{source}: auth.jwt")
        for name in jwt.admin_tenants:
            if name not in tenants:
                raise ConfigError(f"{source}: auth.jwt.admin_tenants: no tenant {name!r}")
    return AccessConfig(tenants=tenants, auth=auth, jwt_public_key=public_key)


def _subjects(subjects: tuple[str, ...], where: str) -> tuple[str, ...]:
    """Certificate subjects written as ``x509.Name.rfc4514_string`` writes a certificate's
    (how the server compares them), each once."""
    from cryptography import x509

    written: dict[str, None] = {}
    for subject in subjects:
        try:
            written[x509.Name.from_rfc4514_string(subject).rfc4514_string()] = None
        except ValueError:
            raise ConfigError(
                f"{where}: {subject!r} is not a subject in RFC 4514 (like "
                "CN=desk-1,O=Acme Bank: most specific first, no space after a comma)"
            ) from None
    return tuple(written)


#: The algorithms each kind of key verifies. A set never mixes kinds: with a public key and
#: HS256 allowed, a token signed with the public key's bytes as an HMAC secret would pass.
_ALGORITHMS: Final = {
    "secret": ("HS256", "HS384", "HS512"),
    "Ed25519": ("EdDSA",),
    "RSA": ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
    "EC": ("ES256", "ES384", "ES512"),
}


def jwt_algorithms(
    settings: JwtSettings, public_key: str | None, where: str
) -> tuple[Any, list[str]]:
    """The key tokens are verified with, and the algorithms allowed: those of ``algorithms``
    (all of the key's kind) or the kind's first. :class:`ConfigError` when they do not fit."""
    if settings.secret is not None:
        key: Any = settings.secret
        kind = "secret"
    else:
        from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        assert public_key is not None
        try:
            key = load_pem_public_key(public_key.encode())
        except ValueError as exc:
            raise ConfigError(f"{where}.public_key: not a PEM public key ({exc})") from None
        kinds = {Ed25519PublicKey: "Ed25519", RSAPublicKey: "RSA", EllipticCurvePublicKey: "EC"}
        found = next((k for cls, k in kinds.items() if isinstance(key, cls)), None)
        if found is None:
            raise ConfigError(f"{where}.public_key: an Ed25519, RSA or EC key is needed")
        kind = found
    fitting = _ALGORITHMS[kind]
    chosen = list(settings.algorithms or fitting[:1])
    wrong = [a for a in chosen if a not in fitting]
    if wrong or not chosen:
        what = "a secret" if kind == "secret" else f"an {kind} public key"
        raise ConfigError(
            f"{where}.algorithms: {', '.join(wrong) or 'none'} cannot be used with {what}; "
            f"use {', '.join(fitting)}"
        )
    return key, chosen


def _convert(raw: Any, kind: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        message, _, path = text.rpartition(" - at `$")
        if not message:
            message, path = text, "`"
        path = path.rstrip("`").lstrip(".").replace("[", ".").replace("]", "")
        raise ConfigError(f"{where}{'.' + path if path else ''}: {message}") from None
