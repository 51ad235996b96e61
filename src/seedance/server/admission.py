"""Admission control: a cap on running generations and a bounded, prioritised wait queue."""

from __future__ import annotations

import asyncio
import heapq
import itertools

from seedance.protocol.errors import Overloaded


class Admission:
    """At most ``max_running`` holders at once; at most ``max_waiting`` callers wait.

    Waiters are served by priority (higher first), then in arrival order. A waiter that is
    cancelled leaves the queue; a slot handed to a waiter that was cancelled at the same moment
    is passed on, never lost.
    """

    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int = 0) -> None:
        if self.running < self.max_running and self.waiting == 0:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            raise Overloaded(
                f"the admission queue is full ({self.max_waiting} requests waiting); retry later"
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (-priority, next(self._order), future))
        self.waiting += 1
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the slot arrived as we were cancelled: pass it on
            else:
                future.cancel()
                self.waiting -= 1
            raise

    def release(self) -> None:
        while self._queue:
            _, _, future = heapq.heappop(self._queue)
            if future.done():
                continue  # cancelled while waiting; already uncounted
            self.waiting -= 1
            future.set_result(None)  # the slot passes straight to the waiter
            return
        self.running -= 1
