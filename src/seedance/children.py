"""The child processes of ``seedance serve``: the engine process and the worker processes.

A child is ``python -m MODULE`` with its setup pickled on its standard input (eight bytes of
length, then the pickle), which then stays open: when the parent closes it, or dies however it
dies, the child sees the end of its input and ends too. Its standard output and error are the
parent's, so its log lines, and what a crash of its native code writes, land in the same log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Child = subprocess.Popen[bytes]

#: The longest wait before a child that keeps dying is started again.
MAX_BACKOFF_S = 30.0
#: A child that lived this long starts its count of crashes afresh.
STABLE_S = 60.0


def spawn(module: str, setup: Any) -> Child:
    """Start ``python -m module`` and hand it ``setup``."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE)
    data = pickle.dumps(setup)
    assert proc.stdin is not None
    proc.stdin.write(len(data).to_bytes(8, "big") + data)
    proc.stdin.flush()
    return proc


def read_setup() -> Any:
    """In the child: what the parent handed it."""
    fd = sys.stdin.fileno()
    data = b""
    size = 8
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise SystemExit("the parent closed this process's input before its setup")
        data += chunk
        if size == 8 and len(data) == 8:
            size += int.from_bytes(data, "big")
    return pickle.loads(data[8:])


async def parent_gone() -> None:
    """In the child: return when the parent closes this process's input (or dies)."""
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    fd = sys.stdin.fileno()

    def readable() -> None:
        if not os.read(fd, 4096) and not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(fd)


def die_with_parent(parent: int) -> None:
    """In a child: be killed (SIGKILL) when the parent dies, where the system can (Linux's
    ``PR_SET_PDEATHSIG``), as one process's threads die with it; exit at once if the parent
    is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def restart_delay(crashes: int, lived_s: float) -> tuple[int, float]:
    """A child died after ``lived_s``, the ``crashes``-th of a row before it: its crashes in a
    row now, and how long to wait before starting it again (at once the first time, then 0.5 s
    doubling up to :data:`MAX_BACKOFF_S`; a child that lived :data:`STABLE_S` starts a new
    row)."""
    crashes = 1 if lived_s >= STABLE_S else crashes + 1
    return crashes, 0.0 if crashes == 1 else min(MAX_BACKOFF_S, 0.5 * 2 ** (crashes - 2))


def exit_cause(returncode: int) -> str:
    """How a process ended, in words: ``was killed by SIGKILL``, ``exited with status 2``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def watch(proc: Child, loop: asyncio.AbstractEventLoop, ended: Callable[[Child], None]) -> None:
    """Call ``ended(proc)`` on ``loop`` when ``proc`` ends."""

    def wait() -> None:
        proc.wait()
        with contextlib.suppress(RuntimeError):  # a closed loop: the parent is ending
            loop.call_soon_threadsafe(ended, proc)

    threading.Thread(target=wait, name=f"child-{proc.pid}", daemon=True).start()


def stop(proc: Child, wait_s: float) -> None:
    """Close ``proc``'s input (it ends what it does and exits); kill it if it lingers."""
    if proc.poll() is not None:
        return
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not end in %.0f s: killed", proc.pid, wait_s)
        proc.kill()
        proc.wait()
