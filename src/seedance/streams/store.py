"""The stream logs of every session: which generation each session can resume, for how long.

A session has at most one log: its running generation's, or its last resumable one's for
``--resume-window`` after it ended. Finished logs count against their tenant's byte cap
(``--resume-max-bytes``); past it the oldest are dropped. A resume of a log that is gone says
why (``history_lost``), and a cursor from another ``epoch`` (the store of a server that
restarted, in memory) is refused, so a client never takes a gap or a repeat for the reply.

How this maps onto Redis (the cluster issue): a log is a Redis Stream per generation whose
entry ids are token indexes (``seq``), appended in batches (``XADD`` pipelined, one fenced
script per batch), read from a cursor (``XRANGE`` after ``after_seq``) and followed live
(``XREAD BLOCK``) by readers on other nodes; ``epoch`` is a per-session key that changes when
Redis lost the session's data; retention is a TTL (the resume window) and ``MAXLEN`` plus the
per-tenant byte count. Readers on the node that runs the generation keep the direct path of
:class:`~seedance.streams.log.StreamLog` (tokens handed over as they are appended).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from seedance.protocol.errors import HistoryLost
from seedance.streams.log import StreamLog

#: (tenant, session id)
SessionKey = tuple[str, str]

#: How many dropped streams are remembered with the reason they went.
GONE_MEMORY = 10_000


class StreamStore(Protocol):
    """What the server needs of a store of stream logs (memory here; Redis in a cluster)."""

    #: Changes whenever the store lost logs it had (in memory: every start of the server).
    epoch: str

    def open(
        self,
        tenant: str,
        session_id: str,
        request_id: str,
        *,
        resumable: bool,
        stream: bool,
        shared: bool = True,
    ) -> StreamLog:
        """A new generation's log: the session's previous log is replaced. ``shared``: other
        nodes may be asked for it (a cluster's store keeps it where they reach it)."""

    def ended(self, tenant: str, session_id: str, log: StreamLog) -> None:
        """``log``'s generation ended: keep it for the resume window if it is resumable."""

    async def find(
        self, tenant: str, session_id: str, request_id: str, epoch: str | None
    ) -> StreamLog:
        """The log to resume; :class:`HistoryLost` with the reason when it cannot be."""

    async def active(self, tenant: str, session_id: str) -> StreamLog | None:
        """The session's log that can be resumed now: running, or done within the window."""

    async def epoch_of(self, tenant: str, session_id: str) -> str:
        """The epoch a client's cursor into this session's logs must name."""

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session was deleted: its log goes with it."""


class MemoryStreamStore:
    """Stream logs in this process's memory (the embedded default)."""

    def __init__(
        self,
        *,
        window_s: float,
        max_bytes_per_tenant: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.epoch = secrets.token_hex(8)
        self.window_s = window_s
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._clock = clock
        self._logs: dict[SessionKey, StreamLog] = {}
        self._finished: OrderedDict[SessionKey, StreamLog] = OrderedDict()  # oldest end first
        self._bytes: dict[str, int] = {}  # finished logs' bytes, per tenant
        self._gone: OrderedDict[tuple[str, str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._logs)

    def bytes_of(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def open(
        self,
        tenant: str,
        session_id: str,
        request_id: str,
        *,
        resumable: bool,
        stream: bool,
        shared: bool = True,
    ) -> StreamLog:
        self.sweep()
        key = (tenant, session_id)
        previous = self._logs.get(key)
        if previous is not None:
            self._drop(key, previous, "expired")
        if shared:
            log = self._new_log(tenant, session_id, request_id, resumable=resumable, stream=stream)
        else:
            log = StreamLog(request_id, self.epoch, resumable=resumable, stream=stream)
        self._logs[key] = log
        return log

    def _new_log(
        self, tenant: str, session_id: str, request_id: str, *, resumable: bool, stream: bool
    ) -> StreamLog:
        """A log that other nodes may be asked for (a cluster's store: kept in Redis too)."""
        return StreamLog(request_id, self.epoch, resumable=resumable, stream=stream)

    def ended(self, tenant: str, session_id: str, log: StreamLog) -> None:
        key = (tenant, session_id)
        if self._logs.get(key) is not log:
            return  # replaced or forgotten meanwhile
        if not log.resumable:
            self._drop(key, log, "expired")
            return
        self._finished[key] = log
        total = self._bytes.get(tenant, 0) + log.size
        self._bytes[tenant] = total
        if total > self.max_bytes_per_tenant:
            for old_key, old in list(self._finished.items()):
                if old_key[0] == tenant:
                    self._drop(old_key, old, "trimmed")
                    if self._bytes.get(tenant, 0) <= self.max_bytes_per_tenant:
                        break
        self.sweep()

    async def find(
        self, tenant: str, session_id: str, request_id: str, epoch: str | None
    ) -> StreamLog:
        return self.lookup(tenant, session_id, request_id, epoch)

    async def active(self, tenant: str, session_id: str) -> StreamLog | None:
        return self.current(tenant, session_id)

    async def epoch_of(self, tenant: str, session_id: str) -> str:
        return self.epoch

    def lookup(self, tenant: str, session_id: str, request_id: str, epoch: str | None) -> StreamLog:
        """:meth:`find`, in this process's memory."""
        if epoch is not None and epoch != self.epoch:
            raise HistoryLost(
                "epoch_changed",
                f"the server lost the stream log that epoch {epoch} refers to "
                f"(it now keeps epoch {self.epoch}); send the request again",
                request_id=request_id,
            )
        self.sweep()
        log = self._logs.get((tenant, session_id))
        if log is not None and log.request_id == request_id:
            return log
        reason = self._gone.get((tenant, session_id, request_id), "expired")
        if reason == "trimmed":
            message = (
                f"the log of {request_id} was dropped to keep this tenant's stream logs under "
                f"{self.max_bytes_per_tenant} bytes"
            )
        else:
            message = (
                f"no stream {request_id} on this session to resume: it ended more than "
                f"{self.window_s:g} s ago, was not resumable, was replaced by a later request, "
                "or never ran here"
            )
        raise HistoryLost(reason, message, request_id=request_id)

    def current(self, tenant: str, session_id: str) -> StreamLog | None:
        """:meth:`active`, in this process's memory."""
        self.sweep()
        log = self._logs.get((tenant, session_id))
        if log is None or not (log.running or log.resumable):
            return None
        return log

    async def forget(self, tenant: str, session_id: str) -> None:
        key = (tenant, session_id)
        log = self._logs.get(key)
        if log is not None:
            self._drop(key, log, "expired")

    def sweep(self) -> None:
        """Drop the finished logs older than the window."""
        finished = self._finished
        if not finished:
            return
        limit = self._clock() - self.window_s
        while finished:
            key, log = next(iter(finished.items()))
            if log.ended_at is None or log.ended_at > limit:
                break
            self._drop(key, log, "expired")

    def _drop(self, key: SessionKey, log: StreamLog, reason: str = "expired") -> None:
        if self._logs.get(key) is log:
            del self._logs[key]
        if self._finished.get(key) is log:
            del self._finished[key]
            tenant = key[0]
            left = self._bytes.get(tenant, 0) - log.size
            if left > 0:
                self._bytes[tenant] = left
            else:
                self._bytes.pop(tenant, None)
        if reason != "expired":  # expired is what a resume of an unknown stream is told
            gone = self._gone
            gone[(key[0], key[1], log.request_id)] = reason
            while len(gone) > GONE_MEMORY:
                gone.popitem(last=False)
