"""The event loop Seedance runs on: uvloop when it is installed, asyncio's own otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket


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
