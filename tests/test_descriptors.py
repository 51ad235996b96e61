"""File descriptors never lock clients out: ``seedance serve`` raises its soft limit toward the
hard one, sizes the caps on connections still sending headers from the limit, and closes the
oldest such connection when a new one's descriptor comes near the limit. A real server process
at a low limit, real sockets, a real flood."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
from collections.abc import Callable, Iterator

import pytest
from websockets.asyncio.client import connect as ws_connect

from seedance.client import connect
from tests.support.servers import ServerProcess, one_process_only

LIMIT = 256


def low_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """This test process opens hundreds of sockets of its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_raises_its_soft_limit_toward_the_hard_one(
    server_process: Callable[..., ServerProcess],
) -> None:
    def soft_only() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))

    proc = server_process(preexec=soft_only)
    assert "file descriptors: soft limit raised from 200 to" in proc.output


@pytest.mark.slow
@one_process_only("each worker has descriptors of its own, the flood is spread over them")
async def test_a_flood_of_silent_sockets_at_a_low_limit_locks_no_client_out(
    server_process: Callable[..., ServerProcess], many_descriptors: None
) -> None:
    proc = server_process("--synthetic-tokens-per-s", "0", preexec=low_limit)
    assert (
        f"file descriptors: {LIMIT} at most; connections still sending headers capped at "
        f"{LIMIT // 2} in all and {LIMIT // 8} per address" in proc.output
    )
    url = f"{proc.url}/v2/infer"
    established = [await ws_connect(url) for _ in range(120)]  # clients that are served
    for ws in established:
        assert '"session"' in await ws.recv()
    silent: list[socket.socket] = []
    try:
        for _ in range(300):  # more sockets than the server has descriptors left
            silent.append(socket.create_connection(("127.0.0.1", proc.port)))
        await asyncio.sleep(0.5)  # the server accepts what it can
        async with asyncio.timeout(5):  # well inside the 10 s handshake timeout
            async with connect(proc.url) as session:
                done = await session.complete("still served?", max_tokens=4)
        assert done.finish_reason == "length"
        # Descriptors ran short before the cap in all: the oldest silent ones made room.
        await proc.logged("descriptors in use")
        for ws in established[:5]:  # and the established ones are untouched
            await ws.send('{"type": "ping", "id": "x"}')
            assert '"pong"' in await asyncio.wait_for(ws.recv(), 5)
    finally:
        for sock in silent:
            with contextlib.suppress(OSError):
                sock.close()
        for ws in established:
            await ws.close()
