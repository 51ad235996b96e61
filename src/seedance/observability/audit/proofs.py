"""Inclusion and consistency proofs of an audit log, and their check with nothing but the
log's public key (``seedance audit prove | consistency | verify PROOF``).

A proof is one JSON document that carries what its check needs: the signed checkpoint(s) (C2SP
notes, :mod:`~seedance.observability.audit.note`) and the RFC 9162 hashes in base64, and for an
inclusion proof the record itself, whose leaf the check recomputes::

    {"proof": "inclusion", "index": 41, "tree_size": 97, "record": {...},
     "path": ["3q2+7w...", ...], "checkpoint": "seedance/audit/1f2e...\\n97\\n...\\n\\n— ..."}
    {"proof": "consistency", "old_size": 40, "old": "<note of 40>", "new": "<note of 97>",
     "path": [...]}
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from seedance.observability.audit import merkle, note
from seedance.observability.audit.records import base_of, entry
from seedance.observability.audit.verify import CHECKPOINTS, log_files

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


class ProofError(ValueError):
    """A proof that cannot be made (no such record or checkpoint) or that does not hold."""


@dataclass
class LogTree:
    """An audit log read as a Merkle tree: its leaves from the first file given on, and its
    signed checkpoints by tree size."""

    tree: merkle.Tree
    notes: dict[int, str] = field(default_factory=dict)
    records: dict[int, dict[str, Any]] = field(default_factory=dict)  # the ones asked for


def read(path: Path, wanted: frozenset[int] = frozenset()) -> LogTree:
    """The log at ``path`` and its rotated siblings, keeping the records ``wanted``."""
    leaves: list[bytes] = []
    base: merkle.Frontier | None = None
    notes: dict[int, str] = {}
    records: dict[int, dict[str, Any]] = {}
    files = log_files(path)
    if not files:
        raise ProofError(f"no audit log at {path}")
    for file in files:
        for number, line in enumerate(file.read_bytes().splitlines(), 1):
            try:
                record = msgspec.json.decode(line)
                seq = record["seq"]
            except (msgspec.DecodeError, TypeError, KeyError):
                raise ProofError(
                    f"{file.name}:{number}: not an audit record (seedance audit verify says more)"
                ) from None
            if base is None:
                base = base_of(record)
                if base is None:
                    raise ProofError(
                        f"{file.name}: the log began before Merkle trees: nothing to prove"
                    )
            leaves.append(merkle.leaf_hash(entry(record)))
            if seq in wanted:
                records[seq] = record
            if (text := _note(record)) is not None:
                notes[seq] = text
    return LogTree(merkle.Tree(leaves, base), notes, records)


def signed_notes(path: Path) -> dict[int, str]:
    """The log's signed checkpoints by tree size, without building its tree (only the
    checkpoint lines are parsed)."""
    notes: dict[int, str] = {}
    for file in log_files(path):
        for line in file.read_bytes().splitlines():
            if b'"note":' not in line:
                continue
            record = msgspec.json.decode(line)
            if (text := _note(record)) is not None:
                notes[record["seq"]] = text
    return notes


def _note(record: dict[str, Any]) -> str | None:
    """A checkpoint record's signed note (None: another record, or no key signed it)."""
    text = record.get("note")
    return text if record.get("kind") in CHECKPOINTS and isinstance(text, str) else None


def _checkpoint(log: LogTree, size: int | None, after: int) -> tuple[int, str]:
    """The signed checkpoint of ``size`` records, or the latest one covering record
    ``after``."""
    if size is not None:
        if size not in log.notes:
            sizes = ", ".join(str(s) for s in sorted(log.notes)[-5:]) or "none"
            raise ProofError(f"no signed checkpoint of {size} records (the latest: {sizes})")
        return size, log.notes[size]
    covering = [s for s in log.notes if s > after]
    if not covering:
        raise ProofError(
            f"no signed checkpoint covers record {after} yet (a log without --audit-signing-key "
            "has none; one is signed after every group commit)"
        )
    return max(covering), log.notes[max(covering)]


def prove(path: Path, seq: int, size: int | None = None) -> dict[str, Any]:
    """An inclusion proof of record ``seq`` under the checkpoint of ``size`` records (the
    latest by default)."""
    return prove_in(read(path, frozenset({seq})), seq, size)


def prove_in(log: LogTree, seq: int, size: int | None = None) -> dict[str, Any]:
    """:func:`prove` in a log already :func:`read` (keeping record ``seq``)."""
    if seq not in log.records:
        raise ProofError(f"no record {seq} in the files given (from {log.tree.base.size} on)")
    n, text = _checkpoint(log, size, seq)
    return {
        "proof": "inclusion",
        "index": seq,
        "tree_size": n,
        "record": log.records[seq],
        "path": _path(lambda: log.tree.inclusion(seq, n)),
        "checkpoint": text,
    }


def consistency(path: Path, old: int, new: int | None = None) -> dict[str, Any]:
    """A consistency proof from the tree of ``old`` records to the signed checkpoint of
    ``new`` (the latest by default). ``old`` need not be a checkpoint of this log (an
    auditor's, of the log it was shown); the proof carries this log's own when there is one,
    and the auditor checks it against the one it saw."""
    log = read(path)
    m, old_note = old, log.notes.get(old)
    n, new_note = _checkpoint(log, new, old - 1)
    if n < m:
        raise ProofError(f"the new checkpoint ({n} records) is older than the old ({m})")
    return {
        "proof": "consistency",
        "old_size": m,
        "old": old_note,
        "new": new_note,
        "path": _path(lambda: log.tree.consistency(m, n)),
    }


def _path(hashes: Callable[[], list[bytes]]) -> list[str]:
    """A proof's hashes in base64."""
    try:
        return [base64.b64encode(h).decode() for h in hashes()]
    except merkle.MissingRecords as exc:
        raise ProofError(f"{exc}: give the log's earlier files too") from None


def read_proof(path: Path) -> dict[str, Any] | None:
    """The proof in the file at ``path``; None when it holds something else (a log)."""
    data = path.read_bytes() if path.is_file() else b""
    if not data.lstrip().startswith(b"{"):
        return None
    try:
        found = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None  # several lines: a log
    return found if isinstance(found, dict) and "proof" in found else None


def check(proof: dict[str, Any], key: Ed25519PublicKey) -> str:
    """What ``proof`` proves, once its checkpoints' signatures and its hashes verify with
    ``key``; :class:`ProofError` otherwise."""
    try:
        path = [base64.b64decode(h, validate=True) for h in proof["path"]]
        if proof.get("proof") == "inclusion":
            stated = note.verify(proof["checkpoint"], key)
            record, index = proof["record"], int(proof["index"])
            if stated.size != proof["tree_size"] or record.get("seq") != index:
                raise ProofError("the proof's sizes do not match its checkpoint and record")
            leaf = merkle.leaf_hash(entry(record))
            if not merkle.verify_inclusion(leaf, index, stated.size, path, stated.root):
                raise ProofError(f"record {index} is not in the tree of {stated.size} records")
            return (
                f"ok: record {index} ({record.get('kind')}) is in the log {stated.origin} of "
                f"{stated.size} records, whose checkpoint is signed"
            )
        if proof.get("proof") == "consistency":
            if proof.get("old") is None:
                raise ProofError(
                    f"the log has no checkpoint of {proof.get('old_size')} records of its own: "
                    "put the one you were shown in the proof's 'old'"
                )
            old, new = note.verify(proof["old"], key), note.verify(proof["new"], key)
            if old.origin != new.origin:
                raise ProofError(f"checkpoints of two logs: {old.origin} and {new.origin}")
            if not merkle.verify_consistency(old.size, new.size, path, old.root, new.root):
                raise ProofError(
                    f"the tree of {new.size} records does not extend that of {old.size}: the "
                    "log was rewritten between them (a fork)"
                )
            return (
                f"ok: the log {new.origin} of {new.size} records extends its checkpoint of "
                f"{old.size} (both signed)"
            )
    except ProofError:
        raise
    except note.NoteError as exc:
        raise ProofError(str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProofError(f"not a proof: {exc!r}") from None
    raise ProofError("not a proof: 'proof' is neither inclusion nor consistency")


def check_lineage(
    lineage: dict[str, Any], key: Ed25519PublicKey, witnesses: list[Ed25519PublicKey]
) -> str:
    """What a lineage document (``GET /v1/lineage/{request_id}``) shows, once its proof
    verifies with the log's ``key``, its checkpoint carries a cosignature by each of
    ``witnesses``, and what it says of the request is what the proven record says;
    :class:`ProofError` otherwise."""
    try:
        proof, record = lineage["proof"], lineage["proof"]["record"]
        proven = check(proof, key)
        if record.get("kind") != "request" or record.get("request_id") != lineage["request_id"]:
            raise ProofError(f"the proven record is not request {lineage['request_id']}'s")
        model = lineage.get("model")
        if model is not None and (model["name"], model["version"]) != (
            record.get("model"),
            record.get("model_version"),
        ):
            raise ProofError("the lineage names another model version than the record")
        admission = lineage.get("admission") or {}
        for field, said in admission.items():
            if said != record.get(field):
                raise ProofError(f"the lineage's admission ({field}) is not the record's")
        _, signatures = note.parse(proof["checkpoint"])
        for witness in witnesses:
            if not any(
                blob[:4] == note.key_hash(name, witness) for name, blob in signatures.items()
            ):
                raise ProofError("the checkpoint carries no cosignature by a witness given")
            name = next(n for n, b in signatures.items() if b[:4] == note.key_hash(n, witness))
            note.verify(proof["checkpoint"], witness, name)
    except ProofError:
        raise
    except note.NoteError as exc:
        raise ProofError(str(exc)) from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProofError(f"not a lineage document: {exc!r}") from None
    cosigned = f", cosigned by {len(witnesses)} witness(es)" if witnesses else ""
    return f"{proven}{cosigned}; request {lineage['request_id']}: {record.get('outcome')}"
