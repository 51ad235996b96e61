"""The generations running on this server: where each one's stream log is opened, and where it
is closed and kept for resumes (or dropped) once the generation ends.

They are found by where their log is kept, ``(tenant, log key)``: a session's id, or the
request's own id for a request without a session. A session runs one generation at a time, so
that names one; request ids alone do not (a client chooses its own, and two sessions may
choose the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from seedance.streams.log import StreamLog
from seedance.streams.store import StreamStore

if TYPE_CHECKING:
    from seedance.protocol.messages import Generate, RequestId
    from seedance.server.lifecycle.generation import Generation
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.request import Requester
    from seedance.sessions.session import Session


class Generations:
    """The registry of running generations, over the store of their stream logs."""

    def __init__(self, streams: StreamStore) -> None:
        self.streams = streams
        self._running: dict[tuple[str, str], Generation] = {}
        #: Asks the node that runs a generation to cancel it (cluster mode: set by the server
        #: to publish the cancel; None: every generation runs here).
        self.elsewhere: Callable[[str, str, str], None] | None = None

    def open_log(
        self, requester: Requester, request_id: RequestId, message: Generate, *, shared: bool
    ) -> StreamLog:
        """A new generation's log (the session's previous one is replaced); ``shared``: other
        nodes may be asked for it."""
        log = self.streams.open(
            requester.tenant,
            requester.log_key(request_id),
            request_id,
            resumable=message.resumable,
            stream=message.stream,
            shared=shared,
        )
        log.keeps(message.logprobs is not None, message.tensors or ())
        return log

    def add(self, generation: Generation) -> None:
        """``generation`` runs from now on (its task starts)."""
        self._running[_key(generation)] = generation
        generation.start()

    def ended(self, generation: Generation) -> None:
        """``generation`` is over: its log gets its last frame (none after a silent abort) and
        is kept for resumes or dropped."""
        key = _key(generation)
        if self._running.get(key) is generation:
            del self._running[key]
        log = generation.log
        log.close(generation.end, time.monotonic())
        requester = generation.requester
        self.streams.ended(requester.tenant, requester.log_key(generation.request_id), log)

    def get(self, tenant: str, log_key: str) -> Generation | None:
        """The generation of ``tenant`` running on the session ``log_key`` (or, without a
        session, the request of that id)."""
        return self._running.get((tenant, log_key))

    def cancel(self, tenant: str, log_key: str, request_id: str) -> None:
        """Cancel ``request_id`` of ``tenant`` on the session ``log_key`` wherever it runs: here,
        or on the node (or worker) that runs it."""
        if not self.cancel_here(tenant, log_key, request_id) and self.elsewhere is not None:
            self.elsewhere(tenant, log_key, request_id)

    def cancel_here(self, tenant: str, log_key: str, request_id: str) -> bool:
        """Cancel ``request_id`` if it runs here; whether it did."""
        generation = self.get(tenant, log_key)
        if generation is None or generation.request_id != request_id:
            return False
        generation.cancel(silent=False)
        return True

    def running_on(self, session: Session) -> Generation | None:
        """The generation running on ``session`` (started on any connection)."""
        return self._running.get((session.tenant, session.session_id))

    def uses(self, model: ServedModel) -> bool:
        """Whether a generation (running, or waiting for admission) uses ``model``."""
        return any(g.requester.model is model for g in self._running.values())

    def __iter__(self) -> Iterator[Generation]:
        return iter(list(self._running.values()))

    def __len__(self) -> int:
        return len(self._running)


def _key(generation: Generation) -> tuple[str, str]:
    requester = generation.requester
    return requester.tenant, requester.log_key(generation.request_id)
