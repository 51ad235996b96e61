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

from seedance.observability.audit.merkle import Frontier, leaf_hash

if TYPE_CHECKING:
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

GENESIS: Final = "0" * 64
_encode = msgspec.json.Encoder(order="sorted").encode


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes a record's hash covers: its JSON with sorted keys, without ``hash``."""
    return _encode({k: v for k, v in record.items() if k != "hash"})


def entry(record: Mapping[str, Any]) -> bytes:
    """A record as the Merkle tree's leaf holds it: its whole JSON, ``hash`` included, keys
    sorted, no spaces (the line the writer wrote, without its newline)."""
    return _encode(record)


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


# ---------------------------------------------------------------------- the Merkle tree


def base_of(record: Mapping[str, Any]) -> Frontier | None:
    """Where the Merkle tree stands before a file's first record: empty before the first
    record ever, the ``frontier`` of a rotated-to file's ``continue``; None when the record
    does not say (a log begun before trees)."""
    if record.get("seq") == 0:
        return Frontier()
    hashes = record.get("frontier")
    if not isinstance(hashes, list):
        return None
    base = Frontier(int(record["seq"]), [bytes.fromhex(h) for h in hashes])
    if len(base.hashes) != base.size.bit_count():
        raise ValueError(f"seq {base.size}: a frontier of {len(base.hashes)} hashes")
    return base


def tree_of(path: Path, offset: int = 0, base: Frontier | None = None) -> Frontier | None:
    """The Merkle tree after the whole records of the file at ``path``: from its first
    record's :func:`base_of`, or ``base`` with the records from byte ``offset`` on."""
    with path.open("rb") as fh:
        fh.seek(offset)
        data = fh.read()
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    if base is None:
        if not lines:
            return None if offset else Frontier()
        try:
            base = base_of(msgspec.json.decode(lines[0]))
        except (msgspec.DecodeError, ValueError, KeyError):
            return None
        if base is None:
            return None
    tree = base.copy()
    try:
        for line in lines:
            tree.append(leaf_hash(entry(msgspec.json.decode(line))))
    except msgspec.DecodeError:  # an edited log: verify says where
        return None
    return tree
