"""Witnesses of the audit log: processes of their own, each with its own key, that cosign a
checkpoint only once it extends the last one they cosigned, so that a server cannot show two
histories without one of them refusing.

**The witness** (``seedance audit witness URL``, :class:`Witness`) fetches the server's latest
signed checkpoint (``GET /v1/audit/checkpoint``), checks the log's signature, and fetches the
consistency proof from the tree it cosigned last (``GET /v1/audit/consistency``). Only when the
proof holds does it cosign (a C2SP signed note's extra signature line, under its own name) and
give the cosignature back (``POST /v1/audit/cosignatures``). What it cosigned last is its state,
a file written atomically before the cosignature leaves. A checkpoint of another log, of a
smaller tree, of the same size with another root, or without a consistency proof that holds is
a fork: refused, logged with both checkpoints, and written as a report beside the state; the
witness stays on what it cosigned.

**The server** keeps the cosignatures of its checkpoints by the witnesses it trusts
(``--audit-witness-key``) in a file beside the log (:class:`Cosignatures`), and answers
``GET /v1/audit/checkpoint?cosigned=K`` with the latest checkpoint that K of them cosigned.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from seedance.observability.audit import merkle, note

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

logger = logging.getLogger(__name__)


class Fork(Exception):
    """The log showed this witness a history that does not extend what it cosigned."""


# --------------------------------------------------------------------------- the server's side


class Cosignatures:
    """The witnesses' cosignatures of a log's checkpoints: JSON lines in a file beside it
    (``.NAME.cosigned``), each ``{"size", "root", "line"}``: appended by whichever process
    takes the witness's POST, read by any."""

    def __init__(self, log_path: Path, witnesses: list[Ed25519PublicKey]) -> None:
        self.path = log_path.with_name(f".{log_path.name}.cosigned")
        self.witnesses = witnesses

    def add(self, cosigned: str, log_key: Ed25519PublicKey, notes: dict[int, str]) -> str:
        """Keep the witness signatures of ``cosigned`` (a note the log signed, of one of its
        checkpoints ``notes``, by size); the witness names kept. ``ValueError`` otherwise."""
        checkpoint = note.verify(cosigned, log_key)
        if notes.get(checkpoint.size) is None:
            raise ValueError(f"the log has no checkpoint of {checkpoint.size} records")
        if note.verify(notes[checkpoint.size], log_key).root != checkpoint.root:
            raise ValueError(f"not the log's checkpoint of {checkpoint.size} records: a fork")
        kept = []
        for line in cosigned.partition("\n\n")[2].splitlines():
            name = line.partition(" ")[2].rpartition(" ")[0]
            if name == checkpoint.origin:
                continue
            if not any(self._signed_by(cosigned, name, key) for key in self.witnesses):
                raise ValueError(f"a cosignature by {name!r}, not a witness this server trusts")
            kept.append((name, line))
        if not kept:
            raise ValueError("no cosignature in the note")
        root = base64.b64encode(checkpoint.root).decode()
        with self.path.open("a") as out:
            for _, line in kept:
                out.write(json.dumps({"size": checkpoint.size, "root": root, "line": line}) + "\n")
        return ", ".join(name for name, _ in kept)

    def of(self, size: int, root: bytes) -> dict[str, str]:
        """The cosignature lines of the checkpoint of ``size`` records with ``root``, by
        witness name."""
        found: dict[str, str] = {}
        wanted = base64.b64encode(root).decode()
        if not self.path.exists():
            return found
        for raw in self.path.read_text().splitlines():
            entry = json.loads(raw)
            if entry["size"] == size and entry["root"] == wanted:
                found[entry["line"].partition(" ")[2].rpartition(" ")[0]] = entry["line"]
        return found

    def latest(self, notes: dict[int, str], log_key: Ed25519PublicKey, k: int) -> str | None:
        """The latest of ``notes`` that ``k`` witnesses cosigned, with their signatures."""
        for size in sorted(notes, reverse=True):
            text = notes[size]
            lines = self.of(size, note.verify(text, log_key).root)
            if len(lines) >= k:
                return text + "".join(f"{line}\n" for line in lines.values())
        return None

    @staticmethod
    def _signed_by(cosigned: str, name: str, key: Ed25519PublicKey) -> bool:
        try:
            note.verify(cosigned, key, name)
        except note.NoteError:
            return False
        return True


# --------------------------------------------------------------------------- the witness


@dataclass
class Seen:
    """What a witness cosigned last."""

    origin: str
    size: int
    root: bytes
    note: str


class Witness:
    """One witness of one log (see the module)."""

    def __init__(
        self,
        url: str,
        log_key: Ed25519PublicKey,
        key: Ed25519PrivateKey,
        name: str,
        state: Path,
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.log_key = log_key
        self.key = key
        self.name = name
        self.state = state
        self.client = client or httpx.Client(timeout=30)
        state.mkdir(parents=True, exist_ok=True)

    def seen(self) -> Seen | None:
        path = self.state / "state.json"
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        return Seen(saved["origin"], saved["size"], base64.b64decode(saved["root"]), saved["note"])

    def round(self) -> str:
        """Fetch, check and cosign the log's latest checkpoint; what happened, in words.
        :class:`Fork` when it does not extend what this witness cosigned (reported on disk)."""
        answer = self.client.get(f"{self.url}/v1/audit/checkpoint")
        answer.raise_for_status()
        text = _log_note(answer.text, self.log_key)
        checkpoint = note.verify(text, self.log_key)
        seen = self.seen()
        if seen is not None:
            self._check_extends(seen, checkpoint, text)
            if (seen.size, seen.root) == (checkpoint.size, checkpoint.root):
                self._post(note.cosign(text, self.key, self.name))
                return f"checkpoint of {checkpoint.size} records: cosigned before"
        cosigned = note.cosign(text, self.key, self.name)
        self._save(Seen(checkpoint.origin, checkpoint.size, checkpoint.root, text))
        self._post(cosigned)
        return f"cosigned the checkpoint of {checkpoint.size} records"

    def _check_extends(self, seen: Seen, checkpoint: note.Checkpoint, text: str) -> None:
        if checkpoint.origin != seen.origin:
            self._fork(seen, text, None, f"another log ({checkpoint.origin}, not {seen.origin})")
        if checkpoint.size < seen.size:
            self._fork(
                seen, text, None, f"a tree of {checkpoint.size} records after one of {seen.size}"
            )
        if checkpoint.size == seen.size:
            if checkpoint.root != seen.root:
                self._fork(seen, text, None, f"another tree of {seen.size} records")
            return
        answer = self.client.get(
            f"{self.url}/v1/audit/consistency",
            params={"old": seen.size, "new": checkpoint.size},
        )
        if answer.status_code == 429 or answer.status_code >= 500:
            answer.raise_for_status()  # the server cannot answer now: the next round asks again
        if answer.status_code != 200:  # it cannot prove that its tree extends the one cosigned
            self._fork(
                seen,
                text,
                None,
                f"no consistency proof ({answer.status_code}: {answer.text[:200]})",
            )
        proof = answer.json()
        path = [base64.b64decode(h) for h in proof["path"]]
        if not merkle.verify_consistency(
            seen.size, checkpoint.size, path, seen.root, checkpoint.root
        ):
            self._fork(
                seen,
                text,
                proof,
                f"the tree of {checkpoint.size} records does not "
                f"extend the tree of {seen.size} it cosigned",
            )

    def _fork(self, seen: Seen, shown: str, proof: dict[str, Any] | None, why: str) -> None:
        report = self.state / f"fork-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.json"
        report.write_text(
            json.dumps(
                {"why": why, "cosigned": seen.note, "shown": shown, "proof": proof}, indent=2
            )
        )
        logger.error(
            "witness %s: FORK of %s: %s; refused (report: %s)", self.name, seen.origin, why, report
        )
        raise Fork(f"{why}; refused, report in {report}")

    def _save(self, seen: Seen) -> None:
        path = self.state / "state.json"
        temporary = path.with_suffix(".tmp")
        body = {
            "origin": seen.origin,
            "size": seen.size,
            "note": seen.note,
            "root": base64.b64encode(seen.root).decode(),
        }
        with temporary.open("w") as out:
            out.write(json.dumps(body))
            out.flush()
            os.fsync(out.fileno())
        temporary.replace(path)

    def _post(self, cosigned: str) -> None:
        answer = self.client.post(
            f"{self.url}/v1/audit/cosignatures",
            content=cosigned.encode(),
            headers={"content-type": "text/plain; charset=utf-8"},
        )
        if answer.status_code != 200:
            logger.warning(
                "witness %s: the server refused the cosignature (%d: %s)",
                self.name,
                answer.status_code,
                answer.text[:200],
            )


def _log_note(text: str, log_key: Ed25519PublicKey) -> str:
    """``text`` with the log's own signature line alone (the others' cosignatures left out:
    this witness signs the checkpoint, not what others said of it)."""
    checkpoint = note.verify(text, log_key)
    body, _, signatures = text.partition("\n\n")
    own = [s for s in signatures.splitlines() if s.startswith(f"{note.DASH} {checkpoint.origin} ")]
    return f"{body}\n\n{own[0]}\n"
