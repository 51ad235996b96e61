"""``seedance audit verify FILE``: check an audit log's chain, across its rotated files.

Reports the first record that is broken (edited: its hash; removed or reordered: ``seq`` and
``prev``; a cut-off line), a checkpoint whose signature fails (with ``--public-key``), or a log
that ends without its seal (records removed from the end, or a server that was killed or is
still running: ``--allow-unsealed`` accepts that), or a broken chain of stream keys (a rotation
record whose epoch or old key does not follow the connection's key before it). Otherwise
``ok`` with the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from seedance.observability.audit import note
from seedance.observability.audit.merkle import Frontier, leaf_hash
from seedance.observability.audit.records import GENESIS, base_of, digest, entry, signature_ok

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

CHECKPOINTS = ("checkpoint", "rotate", "seal")


@dataclass
class Verdict:
    ok: bool
    message: str
    records: int = 0


class _Broken(Exception):
    pass


class _KeyChains:
    """The keys of each end-to-end encrypted connection and direction, as ``stream_key``
    records give them: agreed at epoch 0, then each rotation the next epoch, from the key
    before it."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str, str], tuple[int, str]] = {}
        self.agreed = 0
        self.rotations = 0

    def check(self, record: dict[str, Any], where: str) -> None:
        chain = (
            str(record.get("connection")),
            str(record.get("session")),
            str(record.get("direction")),
        )
        epoch, old, new = (
            record.get("epoch_id"),
            record.get("old_key_hash"),
            record.get("new_key_hash"),
        )
        name = f"{where}: stream key of connection {chain[0]} ({chain[2]}), epoch {epoch}"
        if not isinstance(new, str) or not isinstance(epoch, int):
            raise _Broken(f"{name}: not a stream key record")
        if record.get("action") == "agreed":
            if epoch != 0 or old is not None:
                raise _Broken(f"{name}: an agreed key must be epoch 0 without an old key")
            self.agreed += 1
        else:
            last = self._last.get(chain)
            if last is None:
                raise _Broken(f"{name}: rotated from a key that was never agreed")
            if epoch != last[0] + 1:
                raise _Broken(f"{name}: follows epoch {last[0]}: a rotation is missing")
            if old != last[1]:
                raise _Broken(f"{name}: its old key is not the key of epoch {last[0]}")
            self.rotations += 1
        self._last[chain] = (epoch, new)


def log_files(path: Path) -> list[Path]:
    """The live file and its rotated siblings (``FILE.<time>``), oldest first."""
    rotated = sorted(p for p in path.parent.glob(path.name + ".*") if p.is_file())
    return [*rotated, path] if path.exists() else rotated


def verify(
    path: Path, public_key: Ed25519PublicKey | None = None, *, allow_unsealed: bool = False
) -> Verdict:
    files = log_files(path)
    if not files:
        return Verdict(False, f"no audit log at {path}")
    expected_seq, prev = 0, GENESIS
    last: dict[str, Any] | None = None
    checkpoints = signed = roots = 0
    tree: Frontier | None = None
    vouched = 0  # records covered by the last signature checked
    keys = _KeyChains()
    try:
        for file in files:
            data = file.read_bytes()
            if data and not data.endswith(b"\n"):
                lines = data.split(b"\n")
                raise _Broken(
                    f"{file.name}:{len(lines)}: the last record is cut off (the file was "
                    "truncated inside it)"
                )
            lines = data.splitlines()
            for number, line in enumerate(lines, 1):
                where = f"{file.name}:{number}"
                record = _record(line, where)
                seq = record.get("seq")
                if seq != expected_seq:
                    if _seq_later(lines[number:], expected_seq):
                        raise _Broken(
                            f"{where}: seq {seq} comes before seq {expected_seq}: records are "
                            "out of order"
                        )
                    if isinstance(seq, int) and seq > expected_seq:
                        raise _Broken(f"{where}: records {_span(expected_seq, seq)} are missing")
                    raise _Broken(
                        f"{where}: seq {seq} comes after seq {expected_seq - 1}: records are "
                        "out of order or repeated"
                    )
                if number == 1 and file is files[0]:
                    tree = _base(record, where)
                if record.get("prev") != prev:
                    raise _Broken(f"{where}: seq {seq} does not follow the record before it")
                if digest(record) != record.get("hash"):
                    raise _Broken(f"{where}: seq {seq} was altered (its hash does not match)")
                if record.get("kind") == "stream_key":
                    keys.check(record, where)
                if record.get("kind") in CHECKPOINTS:
                    checkpoints += 1
                    signature = record.get("signature")
                    if public_key is not None:
                        if not signature or not signature_ok(public_key, prev, signature):
                            raise _Broken(f"{where}: checkpoint seq {seq}: bad signature")
                        signed += 1
                        vouched = expected_seq + 1
                    roots += _check_root(record, tree, public_key, where)
                prev, expected_seq, last = str(record["hash"]), expected_seq + 1, record
                if tree is not None:
                    tree.append(leaf_hash(entry(record)))
    except _Broken as exc:
        return Verdict(False, str(exc), expected_seq)
    count = expected_seq
    if count == 0:
        return Verdict(False, f"{files[-1].name}: the log holds no record (an empty file)")
    sealed = last is not None and last.get("kind") == "seal"
    signatures = (
        f"{signed} signature(s) verified" if public_key is not None else "signatures not checked"
    )
    summary = f"{count} records in {len(files)} file(s), {checkpoints} checkpoint(s), {signatures}"
    if roots:
        summary += f", {roots} Merkle root(s) recomputed"
    if keys.agreed:
        summary += f", {keys.agreed} stream key(s) agreed and {keys.rotations} rotation(s) chained"
    if not sealed:
        message = (
            f"the log ends at seq {count - 1} without a seal: the server is running or was "
            "stopped without closing it, or records were removed from its end"
        )
        if not allow_unsealed:
            return Verdict(False, message, count)
        if public_key is not None and vouched < count:
            # A server signs every group commit before it acknowledges it: records after the
            # last signature were being written when it died, and were never acknowledged.
            message += (
                f"; {_span(vouched, count)} come after the last signature: written as the "
                "server died and never acknowledged to a client, or added since; no signature "
                "vouches for them"
            )
        return Verdict(True, f"ok: {summary} (unsealed: {message})", count)
    return Verdict(True, f"ok: {summary}, sealed", count)


def _base(record: dict[str, Any], where: str) -> Frontier | None:
    try:
        return base_of(record)
    except (ValueError, KeyError, TypeError):
        raise _Broken(f"{where}: its Merkle frontier is not one") from None


def _check_root(
    record: dict[str, Any], tree: Frontier | None, key: Ed25519PublicKey | None, where: str
) -> int:
    """1 when a checkpoint's Merkle root (and with ``key``, its signed note) states the tree
    of the records before it; 0 when it has none (or the log began before trees)."""
    root = record.get("root")
    if root is None or tree is None:
        return 0
    seq = record["seq"]
    if root != tree.root().hex():
        raise _Broken(f"{where}: checkpoint seq {seq}: its Merkle root is not the records'")
    text = record.get("note")
    if key is not None and text is not None:
        try:
            stated = note.verify(str(text), key)
        except note.NoteError as exc:
            raise _Broken(f"{where}: checkpoint seq {seq}: {exc}") from None
        if (stated.size, stated.root.hex()) != (seq, root):
            raise _Broken(f"{where}: checkpoint seq {seq}: its note states another tree")
    return 1


def _record(line: bytes, where: str) -> dict[str, Any]:
    try:
        record = msgspec.json.decode(line)
    except msgspec.DecodeError:
        raise _Broken(f"{where}: not a JSON record (edited or cut)") from None
    if not isinstance(record, dict) or "hash" not in record or "seq" not in record:
        raise _Broken(f"{where}: not an audit record")
    return record


def _seq_later(lines: list[bytes], seq: int) -> bool:
    """Whether a later line holds record ``seq`` (then the records were reordered)."""
    for line in lines:
        try:
            if msgspec.json.decode(line).get("seq") == seq:
                return True
        except (msgspec.DecodeError, AttributeError):
            continue
    return False


def _span(first: int, after: int) -> str:
    return f"seq {first}" if after == first + 1 else f"seq {first} to {after - 1}"
