"""The audit log's format: JSON Lines, one record per line, each chained to the one before.

Every record has ``seq`` (0, 1, 2, ... across rotated files), ``time`` (UTC, ISO 8601),
``kind``, its own fields, ``prev`` (the previous record's ``hash``; 64 zeros for the first
record ever) and ``hash``: the SHA-256 of the record's canonical JSON without ``hash`` (keys
sorted, no spaces). Editing a record changes its hash; removing or reordering records breaks
``seq`` and ``prev``; rewriting the whole chain from some point on is caught by the signed
``checkpoint`` records, whose ``signature`` is an Ed25519 signature of their ``prev`` (the head
of the chain up to them) made with a key the writer holds and a rewriter does not.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

import msgspec

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

GENESIS: Final = "0" * 64
_encode = msgspec.json.Encoder(order="sorted").encode


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes a record's hash covers: its JSON with sorted keys, without ``hash``."""
    return _encode({k: v for k, v in record.items() if k != "hash"})


def digest(record: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(record)).hexdigest()


def seal(record: dict[str, Any], seq: int, prev: str) -> bytes:
    """Number and chain ``record``; its line, newline included."""
    record["seq"] = seq
    record["prev"] = prev
    record["hash"] = digest(record)
    return _encode(record) + b"\n"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def json_text(value: Any) -> str:
    """Canonical JSON text (what a prompt's hash covers: its messages, keys sorted)."""
    return _encode(value).decode()


# ---------------------------------------------------------------------- signatures


def sign(key: Ed25519PrivateKey, head: str) -> str:
    return base64.b64encode(key.sign(bytes.fromhex(head))).decode()


def signature_ok(key: Ed25519PublicKey, head: str, signature: str) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(base64.b64decode(signature), bytes.fromhex(head))
    except (InvalidSignature, ValueError):
        return False
    return True
