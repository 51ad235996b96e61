"""The relay's Ed25519 key files (:mod:`seedance.keyfiles`): an edge's private key
(``--relay-key``) and the public keys a far gateway trusts (``--relay-trust``), each refused with
one line naming the flag when it does not load."""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from seedance.config import ConfigError
from seedance.keyfiles import load_private, load_public


def private_key(path: str, flag: str = "--relay-key") -> Ed25519PrivateKey:
    try:
        return load_private(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{flag}: {path}: {getattr(exc, 'strerror', None) or exc}") from None


def trusted(pairs: Sequence[tuple[str, str]]) -> dict[str, Ed25519PublicKey]:
    """Each edge's node id and its public key (``--relay-trust EDGE=FILE,...``)."""
    keys: dict[str, Ed25519PublicKey] = {}
    for issuer, path in pairs:
        try:
            keys[issuer] = load_public(path)
        except (OSError, ValueError, TypeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ConfigError(f"--relay-trust: {issuer}={path}: {reason}") from None
    return keys
