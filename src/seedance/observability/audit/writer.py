"""The audit log's writer: a thread of its own, fed by a queue, so the event loop never waits
on the disk while tokens flow.

With ``fsync = "record"`` a request's record is on disk (written and fsynced) before its
``done`` frame or HTTP response ends: what a client was told is what the log holds, even if
the server is killed the next moment. Records that arrive together share one write and one
fsync (group commit). With ``fsync = "interval"`` the writer fsyncs at most that often and
nothing waits.

The writer also signs a checkpoint now and then (with a key), seals the log when the server
stops, rotates the file by size or age (the chain runs on across files), and picks the chain up
again from the file's last record when the server starts.

With ``shared`` (the workers of ``seedance serve --workers N``), several processes append to
the one file, and it stays one chain in order: each write takes the lock file ``.NAME.lock``
(``flock``), continues from the file's last record when another process wrote since (cutting
off a line a killed process left incomplete, never acknowledged), and follows a rotation
another process made. Each process writes its own start record and seals when it stops; the
last seal ends the log.

When a write fails (a full disk, a
file that cannot be opened), the log says so on ``/healthz`` and in the server log, and with
``audit_required`` the server refuses new requests until a retry succeeds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
from msgspec import UNSET

from seedance import __version__
from seedance.observability.audit import note
from seedance.observability.audit.kinds import (
    AuditRecord,
    Checkpoint,
    Continue,
    Start,
    WriterRecovered,
    as_dict,
)
from seedance.observability.audit.merkle import Frontier, leaf_hash
from seedance.observability.audit.records import GENESIS, seal, sign, tree_of

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

logger = logging.getLogger(__name__)

RETRY_S: Final = 2.0
_STOP: Final = object()


@dataclass(frozen=True)
class AuditSettings:
    path: Path
    fsync: str = "record"  # or "interval"
    fsync_interval_s: float = 1.0
    signing_key: Ed25519PrivateKey | None = None
    checkpoint_interval_s: float = 60.0
    checkpoint_records: int = 1000
    rotate_bytes: int | None = None
    rotate_interval_s: float | None = None
    required: bool = True
    shared: bool = False  # several processes write the file (each write locks .NAME.lock)


class DamagedLog(ValueError):
    """The log's last whole line is not an audit record: the chain cannot be continued."""


def last_record(path: Path) -> tuple[dict[str, Any] | None, int]:
    """The last whole record of the log at ``path`` (None: no file, or no record), and the
    bytes of an incomplete line after it (a write cut short: never acknowledged).

    Raises :class:`DamagedLog` when that last whole line is not a record."""
    if not path.is_file() or path.stat().st_size == 0:
        return None, 0
    size = path.stat().st_size
    with path.open("rb") as fh:
        chunk = min(size, 1 << 20)
        fh.seek(size - chunk)
        tail = fh.read()
    cut = tail.rfind(b"\n") + 1
    partial = len(tail) - cut
    lines = tail[:cut].rstrip(b"\n").rsplit(b"\n", 1)
    if not lines[-1]:
        return None, partial
    try:
        record = msgspec.json.decode(lines[-1])
        if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
            raise ValueError("no seq")
        str(record["hash"])
    except (msgspec.DecodeError, ValueError, KeyError):
        raise DamagedLog(
            f"audit log {path}: its last line is not an audit record (the file was edited or "
            f"damaged), so its chain cannot be continued. `seedance audit verify {path}` shows "
            "where it breaks; keep the file as evidence, move it aside (the server then starts "
            "a new chain) and start again"
        ) from None
    return record, partial


class AuditLog:
    def __init__(self, settings: AuditSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.error: str | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._seq = 0
        self._prev = GENESIS
        self._since_checkpoint = 0
        self._checkpoint_at = clock()
        self._synced_at = clock()
        self._dirty = False
        self._opened_at = clock()
        self._chained = False  # the chain was picked up from the file
        self._lock_fd = -1  # shared: the lock file, and how deep this thread holds it
        self._held = 0
        self._end = 0  # shared: the file's size after this process's last write
        #: The Merkle tree of every record so far (None: a log begun before trees, whose
        #: current file does not say where its tree stands).
        self._tree: Frontier | None = Frontier()

    # ------------------------------------------------------------------ event loop side

    def start(self) -> None:
        """Open the file and write from a thread of its own. A file that cannot be opened
        leaves the log failed (and retried), not the server stopped."""
        try:
            if self.settings.shared:
                lock = self.settings.path.with_name(f".{self.settings.path.name}.lock")
                self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            with self._turn():
                self._open(recover=True)
        except OSError as exc:
            self._fail(exc)
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    def health(self) -> tuple[bool, str]:
        if self.error is None:
            return True, ""
        return False, f"audit log {self.settings.path}: {self.error}"

    def submit(self, record: AuditRecord) -> Future[int] | None:
        """Queue a record; with ``fsync = "record"`` the future completes once it is on
        disk, with its seq (its index in the Merkle tree)."""
        future: Future[int] | None = Future() if self.settings.fsync == "record" else None
        self._queue.put((record, future))
        return future

    def close(self) -> None:
        """Write what is queued, seal the log, and stop (blocking: call it from a thread)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread = None

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, stop = self._take()
            if self.error is not None and not self._recover():
                for _, future in batch:
                    if future is not None:
                        future.set_exception(OSError(self.error))
                continue
            try:
                with self._turn():
                    self._write_batch(batch)
                    self._maintain()
                    if stop:
                        self._append(self._checkpoint("seal"))
                        self._sync()
            except OSError as exc:
                self._fail(exc)
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(exc)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _take(self) -> tuple[list[tuple[AuditRecord, Future[int] | None]], bool]:
        """What is queued (waiting at most until an fsync, checkpoint or retry is due)."""
        wait = RETRY_S if self.error is not None else self._next_due()
        batch: list[tuple[AuditRecord, Future[int] | None]] = []
        try:
            item = self._queue.get(timeout=max(wait, 0.001))
        except queue.Empty:
            return batch, False
        while True:
            if item is _STOP:
                return batch, True
            batch.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False

    def _next_due(self) -> float:
        s, now = self.settings, self.clock()
        due = [60.0]
        if self._dirty:
            due.append(self._synced_at + s.fsync_interval_s - now)
        if s.signing_key is not None and self._since_checkpoint:
            due.append(self._checkpoint_at + s.checkpoint_interval_s - now)
        if s.rotate_interval_s is not None:
            due.append(self._opened_at + s.rotate_interval_s - now)
        return min(due)

    def _write_batch(self, batch: list[tuple[AuditRecord, Future[int] | None]]) -> None:
        if not batch:
            return
        records = [record for record, _ in batch]
        if self.settings.fsync == "record":
            # With a key, a signed checkpoint ends every group commit, in the same write: no
            # record a client is told about lies outside a signature, even after a kill -9.
            first = self._append_many(records, signed=self.settings.signing_key is not None)
            self._sync()
        else:
            first = self._append_many(records)
        for seq, (_, future) in enumerate(batch, first):
            if future is not None:
                future.set_result(seq)

    def _maintain(self) -> None:
        """Interval fsyncs, checkpoints and rotation, when due."""
        s, now = self.settings, self.clock()
        if self._dirty and now - self._synced_at >= s.fsync_interval_s:
            self._sync()
        if (
            s.signing_key is not None
            and self._since_checkpoint
            and (
                self._since_checkpoint >= s.checkpoint_records
                or now - self._checkpoint_at >= s.checkpoint_interval_s
            )
        ):
            self._append(self._checkpoint("checkpoint"))
            self._sync()
        if self._rotation_due(now):
            self._rotate()

    def _rotation_due(self, now: float) -> bool:
        s = self.settings
        if not self._regular():
            return False
        if s.rotate_interval_s is not None and now - self._opened_at >= s.rotate_interval_s:
            return True
        if s.rotate_bytes is not None:
            return os.fstat(self._fd).st_size >= s.rotate_bytes
        return False

    def _rotate(self) -> None:
        path = self.settings.path
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        rotated = path.with_name(f"{path.name}.{stamp}")
        self._append(self._checkpoint("rotate", next_file=path.name))
        self._sync()
        os.close(self._fd)
        self._fd = -1
        os.rename(path, rotated)
        self._open(recover=False)
        frontier = UNSET if self._tree is None else [h.hex() for h in self._tree.hashes]
        self._append(Continue(previous_file=rotated.name, frontier=frontier))
        self._sync()
        logger.info("audit log rotated: %s", rotated)

    def _checkpoint(
        self,
        kind: Literal["checkpoint", "rotate", "seal"],
        head: tuple[int, str, Frontier | None] | None = None,
        **extra: str,
    ) -> Checkpoint:
        """A checkpoint (``checkpoint``, ``rotate``, ``seal``): signs the chain's head and the
        Merkle tree's root, which are the last record's unless ``head`` (seq after it, its
        hash, the tree) says otherwise."""
        seq, head_hash, tree = head or (self._seq, self._prev, self._tree)
        key = self.settings.signing_key
        signature = sign(key, head_hash) if key is not None else None
        record = Checkpoint(kind=kind, records=seq, signature=signature, **extra)
        if tree is not None and tree.size == seq:
            root = tree.root()
            record.root = root.hex()
            if key is not None:
                origin = note.origin_of(key.public_key())
                record.note = note.sign(note.Checkpoint(origin, seq, root), key)
        self._since_checkpoint = 0
        self._checkpoint_at = self.clock()
        return record

    def _append(self, record: AuditRecord) -> None:
        self._append_many([record])

    def _append_many(self, records: list[AuditRecord], *, signed: bool = False) -> int:
        """Chain and write ``records`` in one write; ``signed``: then a checkpoint signing the
        head they make. The first one's seq."""
        lines = []
        seq, prev = self._seq, self._prev
        first = seq
        tree = None if self._tree is None else self._tree.copy()
        for record in records:
            fields = as_dict(record)
            lines.append(seal(fields, seq, prev))
            seq, prev = seq + 1, fields["hash"]
            if tree is not None:
                tree.append(leaf_hash(lines[-1][:-1]))
        if signed:
            checkpoint = as_dict(self._checkpoint("checkpoint", head=(seq, prev, tree)))
            lines.append(seal(checkpoint, seq, prev))
            seq, prev = seq + 1, checkpoint["hash"]
            if tree is not None:
                tree.append(leaf_hash(lines[-1][:-1]))
        data = b"".join(lines)
        regular = self._regular()
        size = os.fstat(self._fd).st_size if regular else 0
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError:
            if regular:  # no partial line may stay: the next record would follow it
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)
            raise
        self._seq, self._prev, self._tree = seq, prev, tree  # only once the bytes are written
        if self.settings.shared:
            self._end = os.fstat(self._fd).st_size
        self._since_checkpoint = 0 if signed else self._since_checkpoint + len(records)
        self._dirty = True
        return first

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """Shared: hold the lock file while writing, the chain caught up with the file."""
        if self._lock_fd < 0:
            yield
            return
        if not self._held:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._held += 1
        try:
            if self._held == 1 and self._fd >= 0:
                self._catch_up()
            yield
        finally:
            self._held -= 1
            if not self._held:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _catch_up(self) -> None:
        """Continue from what other processes wrote since this one's last write: their last
        record, in the file another may have rotated to."""
        path = self.settings.path
        if os.fstat(self._fd).st_ino != os.stat(path).st_ino:  # rotated by another process
            os.close(self._fd)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._opened_at = self.clock()
            self._end = -1  # a new file: its size says nothing of this process's writes
        if os.fstat(self._fd).st_size == self._end:
            return
        last, partial = last_record(path)
        if partial:
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - partial)
            logger.warning(
                "audit log %s: cut off an incomplete record another process left (%d bytes)",
                path,
                partial,
            )
        if last is not None:
            self._seq, self._prev = int(last["seq"]) + 1, str(last["hash"])
        if self._end < 0 or self._tree is None:
            self._tree = tree_of(path)
        else:  # the records the others appended
            self._tree = tree_of(path, offset=self._end, base=self._tree)
        self._end = os.fstat(self._fd).st_size

    def _regular(self) -> bool:
        return stat.S_ISREG(os.fstat(self._fd).st_mode)

    def _sync(self) -> None:
        os.fsync(self._fd)
        self._dirty = False
        self._synced_at = self.clock()

    # ------------------------------------------------------------------ files

    def _open(self, *, recover: bool) -> None:
        path = self.settings.path
        start = Start(server=__version__)
        if recover:
            start = self._recover_chain(path, start)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._opened_at = self.clock()
        self._end = os.fstat(self._fd).st_size
        if recover:
            self._chained = True
            self._append(start)
            self._sync()

    def _recover_chain(self, path: Path, start: Start) -> Start:
        """Continue the chain of an existing log: seq and hash of its last whole record (a
        partial last line, never acknowledged, is cut off and noted in the start record)."""
        last, partial = last_record(path)
        if partial:
            os.truncate(path, path.stat().st_size - partial)
            start.discarded_partial_bytes = partial
            logger.warning(
                "audit log %s: cut off an incomplete last record (%d bytes)", path, partial
            )
        if last is None:
            return start
        self._seq, self._prev = int(last["seq"]) + 1, str(last["hash"])
        self._tree = tree_of(path)
        if self._tree is None:
            logger.warning(
                "audit log %s: its first record does not say where the Merkle tree stands (a "
                "log begun before trees): its checkpoints carry no root (a log moved aside "
                "starts a new one that does)",
                path,
            )
        start.previous_end = "sealed" if last.get("kind") == "seal" else "unsealed"
        return start

    # ------------------------------------------------------------------ failures

    def _fail(self, exc: OSError) -> None:
        if self.error is None:
            logger.error("audit log %s cannot be written: %s", self.settings.path, exc)
        self.error = exc.strerror or str(exc)

    def _recover(self) -> bool:
        """After a failure: try again to write (a record of the failure itself)."""
        try:
            with self._turn():
                if self._fd < 0:
                    self._open(recover=not self._chained)
                self._append(WriterRecovered(error=self.error))
                self._sync()
        except OSError as exc:
            self._fail(exc)
            return False
        logger.warning("audit log %s writable again", self.settings.path)
        self.error = None
        return True
