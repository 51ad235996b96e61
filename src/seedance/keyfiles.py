"""Ed25519 key files (PEM), as model signing, the audit log and end-to-end encryption use
them: a private key, a public key (or the public half of a private key's file), and a key's
id, the first 16 hex digits of the SHA-256 of its raw public bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_private(path: Path | str) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file (``seedance models keygen``, or ``openssl genpkey
    -algorithm ed25519``)."""
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def load_public(path: Path | str) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file, or the public half of a private key's file."""
    return public_key(Path(path).read_bytes(), str(path))


def public_key(pem: bytes, source: str) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM (a public key, or a private key's public half); ``source``
    names it in the error."""
    if b"PRIVATE KEY" in pem:
        private = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError(f"{source}: not an Ed25519 key")
        return private.public_key()
    public = serialization.load_pem_public_key(pem)
    if not isinstance(public, Ed25519PublicKey):
        raise ValueError(f"{source}: not an Ed25519 public key")
    return public
