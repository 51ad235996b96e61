"""The event loop Seedance runs on: uvloop when it is installed, asyncio's own otherwise; and
``timeout``, asyncio's from Python 3.11 (``asyncio.wait_for`` can swallow a cancellation),
async-timeout's before."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import sys
from collections import deque
from typing import Any

if sys.version_info >= (3, 11):
    from asyncio import timeout as timeout
else:  # pragma: no cover
    from async_timeout import timeout as timeout


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def install_uvloop() -> bool:
    """Make new event loops uvloop loops when uvloop is installed; true when it is."""
    if not uvloop_available():
        return False
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what :func:`install_uvloop` chose (for logs and reports)."""
    policy = asyncio.get_event_loop_policy()
    return "uvloop" if type(policy).__module__.startswith("uvloop") else "asyncio"


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Turn Nagle's algorithm off on a TCP transport: a token is sent when it is written."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LightQueue:
    """What one reader uses of :class:`asyncio.Queue` (unbounded, ``put_nowait`` and ``get``)
    at a fraction of its memory and cost: a deque and at most one waiting future."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items
