"""Admission control: a cap on running generations and a bounded wait queue shared fairly.

Each tenant waits in a queue of its own (by priority, then arrival). When a slot frees, the
tenants with waiters are served in turn, weighted by tier: stride scheduling, where each tenant
carries a pass that grows by 1/tier each time it is served and the lowest pass goes next. A
tenant that starts waiting joins at the current pass, so idle time earns no credit. A flood
from one tenant therefore delays another's request by one turn at most, not by the flood.

When the queue is full, a newcomer from a tenant with fewer waiters than the busiest pushes
out the busiest tenant's newest waiter (which gets ``overloaded``); otherwise the newcomer is
refused. One tenant cannot fill the queue against the others.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Final

from seedance.protocol.errors import Overloaded

DEFAULT_TENANT: Final = "default"

_Entry = tuple[int, int, asyncio.Future[None]]  # -priority, arrival, future


class _TenantQueue:
    __slots__ = ("heap", "live", "name", "pass_", "weight")

    def __init__(self, name: str, weight: int, pass_: float) -> None:
        self.name = name
        self.weight = weight
        self.pass_ = pass_
        self.heap: list[_Entry] = []
        self.live = 0  # waiters in the heap that are still waiting


class Admission:
    """At most ``max_running`` holders at once; at most ``max_waiting`` callers wait.

    A waiter that is cancelled leaves the queue; a slot handed to a waiter that was cancelled
    at the same moment is passed on, never lost.
    """

    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._queues: dict[str, _TenantQueue] = {}
        self._order = itertools.count()
        self._clock = 0.0  # the pass of the tenant served last

    def waiting_of(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return queue.live if queue is not None else 0

    async def acquire(
        self, priority: int = 0, tenant: str = DEFAULT_TENANT, weight: int = 1
    ) -> None:
        if self.running < self.max_running and self.waiting == 0:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            self._make_room(tenant)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = _TenantQueue(tenant, weight, self._clock)
        elif queue.live == 0:
            queue.pass_ = max(queue.pass_, self._clock)  # no credit for time spent idle
        queue.weight = weight
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(queue.heap, (-priority, next(self._order), future))
        queue.live += 1
        self.waiting += 1
        try:
            await future
        except asyncio.CancelledError:
            if not future.done() or future.cancelled():
                future.cancel()
                self._left(queue)  # still counted: it leaves the queue
            elif future.exception() is None:
                self.release()  # the slot arrived as we were cancelled: pass it on
            raise  # (pushed out at that moment: already uncounted)

    def release(self) -> None:
        while True:
            queue = self._next_queue()
            if queue is None:
                self.running -= 1
                return
            _, _, future = heapq.heappop(queue.heap)
            if future.done():
                continue  # cancelled or pushed out while waiting; already uncounted
            self._left(queue)
            self._clock = queue.pass_
            queue.pass_ += 1.0 / queue.weight
            future.set_result(None)  # the slot passes straight to the waiter
            return

    def _next_queue(self) -> _TenantQueue | None:
        best: _TenantQueue | None = None
        for queue in self._queues.values():
            if queue.live and (best is None or queue.pass_ < best.pass_):
                best = queue
        return best

    def _left(self, queue: _TenantQueue) -> None:
        queue.live -= 1
        self.waiting -= 1
        if queue.live == 0:  # what is left in the heap was cancelled
            del self._queues[queue.name]

    def _make_room(self, tenant: str) -> None:
        """The queue is full: push out the busiest tenant's newest waiter, unless the newcomer's
        tenant is (one of) the busiest, in which case the newcomer is refused."""
        full = Overloaded(
            f"the admission queue is full ({self.max_waiting} requests waiting); retry later"
        )
        busiest = max(self._queues.values(), key=lambda q: q.live, default=None)
        if busiest is None or busiest.live <= self.waiting_of(tenant) + 1:
            raise full
        newest = max((e for e in busiest.heap if not e[2].done()), key=lambda e: e[1])
        newest[2].set_exception(full)
        self._left(busiest)
