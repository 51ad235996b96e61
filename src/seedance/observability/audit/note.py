"""Checkpoints as C2SP signed notes (c2sp.org/signed-note, c2sp.org/tlog-checkpoint), the
format of Go's checksum database, Sigstore's Rekor v2 and their witnesses.

A checkpoint's text is three lines: the log's origin (a name unique to the log), the tree's
size in records, and its root hash in base64. A signature follows a blank line as ``— NAME
BASE64``, where the base64 holds the key's 4-byte hash (SHA-256 of ``NAME``, a newline, the
Ed25519 algorithm byte 0x01 and the 32-byte public key) and the Ed25519 signature of the text.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from seedance.keyfiles import key_id

DASH: Final = "\u2014"  # the em dash that begins a signature line
_ED25519: Final = b"\x01"


class NoteError(ValueError):
    """A checkpoint that is not one, or whose signature does not verify."""


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes

    def text(self) -> str:
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


def origin_of(key: Ed25519PublicKey) -> str:
    """A log's default origin: named by its signing key (``seedance/audit/KEYID``)."""
    return f"seedance/audit/{key_id(key)}"


def key_hash(name: str, key: Ed25519PublicKey) -> bytes:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(name.encode() + b"\n" + _ED25519 + raw).digest()[:4]


def sign(checkpoint: Checkpoint, key: Ed25519PrivateKey, name: str | None = None) -> str:
    """The signed note of ``checkpoint``, signed by ``key`` under ``name`` (the origin)."""
    text = checkpoint.text()
    name = name or checkpoint.origin
    signature = key_hash(name, key.public_key()) + key.sign(text.encode())
    return f"{text}\n{DASH} {name} {base64.b64encode(signature).decode()}\n"


def cosign(note: str, key: Ed25519PrivateKey, name: str) -> str:
    """``note`` with one more signature: ``key``'s, under ``name`` (a witness's)."""
    text = note.split("\n\n", 1)[0] + "\n"
    signature = key_hash(name, key.public_key()) + key.sign(text.encode())
    return f"{note}{DASH} {name} {base64.b64encode(signature).decode()}\n"


def parse(note: str) -> tuple[Checkpoint, dict[str, bytes]]:
    """The checkpoint a note states and its signatures by key name (each its 4-byte key hash
    and signature); unverified."""
    text, sep, rest = note.partition("\n\n")
    lines = text.split("\n")
    if not sep or len(lines) < 3:
        raise NoteError("not a checkpoint: an origin, a size and a root hash, then signatures")
    try:
        size = int(lines[1])
        root = base64.b64decode(lines[2], validate=True)
    except ValueError:
        raise NoteError("not a checkpoint: its size or root hash does not parse") from None
    if size < 0 or len(root) != 32 or lines[1] != str(size):
        raise NoteError("not a checkpoint: a size of 0 or more and a SHA-256 root hash")
    signatures = {}
    for line in rest.splitlines():
        dash, _, fields = line.partition(" ")
        name, _, blob = fields.rpartition(" ")
        if dash != DASH or not name:
            raise NoteError(f"not a signature line: {line[:80]!r}")
        try:
            signatures[name] = base64.b64decode(blob, validate=True)
        except ValueError:
            raise NoteError(f"signature of {name}: not base64") from None
    return Checkpoint(lines[0], size, root), signatures


def verify(note: str, key: Ed25519PublicKey, name: str | None = None) -> Checkpoint:
    """The checkpoint ``note`` states, once ``key``'s signature under ``name`` (the origin by
    default) verifies; :class:`NoteError` otherwise."""
    checkpoint, signatures = parse(note)
    name = name or checkpoint.origin
    signature = signatures.get(name)
    if signature is None or signature[:4] != key_hash(name, key):
        raise NoteError(f"the checkpoint carries no signature by {name} with this key")
    body = note.partition("\n\n")[0] + "\n"  # what was signed, extension lines included
    try:
        key.verify(signature[4:], body.encode())
    except InvalidSignature:
        raise NoteError(f"the signature by {name} does not verify") from None
    return checkpoint
