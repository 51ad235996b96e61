"""Relay tokens: what an edge gateway shows a gateway in another region to have it serve one
request of one tenant's session (design 4.3).

A relay token is a JWT signed with the edge's Ed25519 key (EdDSA), with:

- ``iss``: the edge's node id (the far end knows its public key under that name);
- ``aud``: the far gateway's node id;
- ``iat``, ``exp``: at most :data:`MAX_LIFETIME_S` (90 s) apart, and ``exp`` not passed;
- ``jti``: unique: the far end refuses one it has seen (until it expires);
- ``tenant`` and ``session``: whose request it is, bound in.

:func:`mint` makes one; :class:`Verifier` checks one and says why it refuses (a
:class:`RelayRefused` with a short ``reason``: ``unsigned``, ``bad_signature``,
``unknown_issuer``, ``wrong_audience``, ``expired``, ``too_long``, ``replayed``,
``malformed``). Pure: no I/O but the clock.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

#: The longest a relay token may live, seconds (design 4.3).
MAX_LIFETIME_S = 90.0
#: How long a token the edge mints lives, seconds: a request's start, not its whole reply.
LIFETIME_S = 60.0
#: Clock skew allowed between regions, seconds.
LEEWAY_S = 5.0
_ALGORITHM = "EdDSA"


class RelayRefused(Exception):
    """A relay token the far end does not accept, and why (``reason``: one word)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"relay token refused ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class RelayClaims:
    """What a verified token says."""

    issuer: str
    audience: str
    tenant: str
    session: str | None
    jti: str
    expires: float


def mint(
    key: Ed25519PrivateKey,
    *,
    issuer: str,
    audience: str,
    tenant: str,
    session: str | None,
    lifetime_s: float = LIFETIME_S,
    now: float | None = None,
) -> str:
    """A token for one request of ``tenant``'s ``session`` at the gateway ``audience``."""
    issued = time.time() if now is None else now
    claims = {
        "iss": issuer,
        "aud": audience,
        "iat": int(issued),
        "exp": int(issued + min(lifetime_s, MAX_LIFETIME_S)),
        "jti": secrets.token_urlsafe(16),
        "tenant": tenant,
        "session": session,
    }
    return jwt.encode(claims, key, algorithm=_ALGORITHM)


@dataclass
class Verifier:
    """Checks tokens for the gateway ``node_id``, signed by the ``issuers`` it trusts (node id:
    public key): :meth:`verify`; and each token once, where this process alone takes them
    (:meth:`first_use`; nodes of a cluster and workers ask Redis instead)."""

    node_id: str
    issuers: Mapping[str, Ed25519PublicKey]
    clock: Callable[[], float] = time.time
    #: Tokens seen and when they expire: a token is refused again until then.
    _seen: dict[str, float] = field(default_factory=dict)

    def verify(self, token: str) -> RelayClaims:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as exc:
            raise RelayRefused("malformed", f"not a JWT: {exc}") from None
        if header.get("alg") != _ALGORITHM:
            raise RelayRefused("unsigned", f"alg must be {_ALGORITHM}, not {header.get('alg')!r}")
        issuer = unverified.get("iss")
        key = self.issuers.get(issuer) if isinstance(issuer, str) else None
        if key is None:
            raise RelayRefused("unknown_issuer", f"no relay key is trusted for {issuer!r}")
        now = self.clock()
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[_ALGORITHM],
                audience=self.node_id,
                leeway=LEEWAY_S,
                options={"require": ["iss", "aud", "iat", "exp", "jti", "tenant"]},
            )
        except jwt.InvalidAudienceError:
            audience = unverified.get("aud")
            raise RelayRefused(
                "wrong_audience", f"the token is for {audience!r}, not {self.node_id!r}"
            ) from None
        except jwt.ExpiredSignatureError:
            raise RelayRefused("expired", "the token has expired") from None
        except jwt.InvalidSignatureError:
            raise RelayRefused("bad_signature", f"not signed by {issuer}'s key") from None
        except jwt.PyJWTError as exc:
            raise RelayRefused("malformed", str(exc)) from None
        if claims["exp"] - claims["iat"] > MAX_LIFETIME_S:
            raise RelayRefused("too_long", f"a relay token lives at most {MAX_LIFETIME_S:g} s")
        if claims["exp"] + LEEWAY_S < now:  # jwt checks with its own clock; ours may be a test's
            raise RelayRefused("expired", "the token has expired")
        session = claims.get("session")
        return RelayClaims(
            str(issuer),
            str(claims["aud"]),
            str(claims["tenant"]),
            None if session is None else str(session),
            str(claims["jti"]),
            float(claims["exp"]),
        )

    def first_use(self, claims: RelayClaims) -> None:
        """Take a verified token, once: ``replayed`` when it was taken before (and is not
        expired yet, which :meth:`verify` refuses anyway)."""
        self._forget(self.clock())
        if claims.jti in self._seen:
            raise replayed(claims)
        self._seen[claims.jti] = claims.expires + LEEWAY_S

    def _forget(self, now: float) -> None:
        """Tokens past their expiry, oldest first (refused as expired now, no longer kept as
        seen): tokens arrive about in the order they expire, so this stops at the first one
        still alive (one that outlives a later one is only forgotten later)."""
        for jti, expires in list(itertools.islice(self._seen.items(), 64)):
            if expires >= now:
                return
            del self._seen[jti]


def replayed(claims: RelayClaims) -> RelayRefused:
    return RelayRefused("replayed", f"token {claims.jti} was used already")
