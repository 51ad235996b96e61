"""Encryption at rest of what the cluster keeps in Redis (``--encrypt-at-rest``).

Conversations (a session's turns), stream logs (the ``start`` frame, each token entry's text,
the end frame) and each generation's header (its request and prompt, for a takeover) are
sealed with AES-256-GCM before they leave the node, and opened when read back. The key is
derived from the server's identity (``--e2e-key``, HKDF-SHA256, info ``seedance at-rest/1``),
which every node of the cluster holds: Redis, its dumps, its replicas and its backups hold only
ciphertext, while any node can still resume or take over any stream. The trade-off: a node (or
whoever has the identity key) reads everything, and Redis can no longer be searched by content.

Each value is a random 96-bit nonce, the ciphertext and its tag; the additional data is the
Redis key it is stored under, so a value copied to another session's key does not open. Random
nonces keep one key safe for about 2^32 values: change the identity (and with it this key)
well before that, which makes what Redis holds unreadable (sessions start empty, streams are
``history_lost``).

Token counts, entry ids, TTLs and the keys' names stay in the clear: Redis needs them.
"""

from __future__ import annotations

import logging
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

logger = logging.getLogger(__name__)

NONCE_BYTES = 12


class Unreadable(ValueError):
    """A value that does not open: written in the clear, under another key, or altered."""


class AtRest:
    """Seals and opens values stored in Redis under one key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @classmethod
    def from_identity(cls, identity: Ed25519PrivateKey) -> AtRest:
        secret = identity.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        key = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"seedance at-rest/1"
        ).derive(secret)
        return cls(key)

    def seal(self, value: str | bytes, place: str) -> bytes:
        data = value.encode() if isinstance(value, str) else value
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, place.encode())

    def open(self, value: bytes, place: str) -> bytes:
        try:
            return self._aead.decrypt(value[:NONCE_BYTES], value[NONCE_BYTES:], place.encode())
        except (InvalidTag, ValueError):
            raise Unreadable(
                f"{place}: a value that does not open with this cluster's key (written in the "
                "clear, with another --e2e-key, or altered)"
            ) from None
