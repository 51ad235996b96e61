"""Waiting for a condition instead of for a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(ok: Callable[[], object], timeout_s: float = 5.0, what: str = "") -> None:
    """Return as soon as ``ok()`` is true; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not ok():
        assert loop.time() < deadline, f"not reached in {timeout_s} s: {what or ok}"
        await asyncio.sleep(0.01)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    """:func:`eventually` for code that is not a coroutine: block until ``check()``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.05)
