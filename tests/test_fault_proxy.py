"""The fault proxy (``seedance.testing.faults``) between the Python SDK and a real server: each
fault does what it says, seen from the client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from seedance.client import ConnectionClosed, connect
from seedance.testing.faults import FaultProxy
from tests.support.servers import RunningServer, slow_engine


def target(server: RunningServer) -> str:
    return server.url.removeprefix("ws://")


async def test_delay_adds_to_every_round_trip(server: RunningServer) -> None:
    async with FaultProxy(target(server)) as proxy, connect(proxy.url) as session:
        direct = await session.ping()
        proxy.delay_s = 0.1
        delayed = await session.ping()
        proxy.delay_s = 0.0
        await asyncio.sleep(0.15)  # what was in flight went through
        assert delayed >= 0.2 > direct
        assert (await session.complete("x", max_tokens=3)).finish_reason == "length"


async def test_drop_and_reset_end_connections_and_the_sdk_resumes(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([slow_engine(tokens_per_s=200)])
    async with FaultProxy(target(server)) as proxy:
        for fault in (proxy.drop, proxy.reset):
            async with connect(proxy.url, session_id=fault.__name__) as session:
                stream = session.generate("x", max_tokens=60, resumable=True)
                seqs: list[int] = []
                async for chunk in stream:
                    seqs.extend(range(chunk.seq, chunk.seq + chunk.n))
                    if len(seqs) >= 10 and session.reconnects == 0 and proxy.links:
                        fault()
                assert seqs == list(range(60)) and session.reconnects == 1
        # Without reconnects, a reset is a dropped connection (1006).
        async with connect(proxy.url, reconnect=None) as session:
            stream = session.generate("x", max_tokens=60)
            with pytest.raises(ConnectionClosed) as closed:
                async for _ in stream:
                    proxy.reset()
            assert closed.value.received_code == 1006


async def test_a_blackhole_holds_the_connection_open_and_silent(server: RunningServer) -> None:
    async with FaultProxy(target(server)) as proxy, connect(proxy.url) as session:
        proxy.blackhole = True
        with pytest.raises(asyncio.TimeoutError):
            await session.ping(timeout_s=0.5)
        assert not session.closed
        proxy.blackhole = False
        async with connect(proxy.url) as again:  # a new connection goes through
            assert await again.ping() < 0.5


async def test_a_reset_rate_refuses_that_share_of_new_connections(server: RunningServer) -> None:
    async with FaultProxy(target(server), seed=3) as proxy:
        proxy.reset_rate = 0.5
        failed = 0
        for _ in range(40):
            try:
                async with connect(proxy.url, reconnect=None):
                    pass
            except (OSError, ConnectionClosed):
                failed += 1
        assert failed == proxy.refused and 10 <= failed <= 30 and proxy.accepted == 40


def test_the_command_line_proxy_takes_commands(server: RunningServer) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "seedance.testing.faults", "--target", target(server)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        assert first.startswith("fault proxy on 127.0.0.1:") and first.rstrip().endswith(
            target(server)
        )
        port = int(first.split()[3].rsplit(":", 1)[1])
        proc.stdout.readline()  # the list of commands
        proc.stdin.write("delay 150\nblackhole on\nnonsense\n")
        proc.stdin.flush()
        assert proc.stdout.readline().startswith("delay 150 ms, blackhole off")
        assert proc.stdout.readline().startswith("delay 150 ms, blackhole on")
        assert proc.stdout.readline().strip() == "unknown command: nonsense"

        async def ping() -> float:
            async with connect(f"ws://127.0.0.1:{port}") as session:
                return await session.ping()

        proc.stdin.write("blackhole off\n")
        proc.stdin.flush()
        proc.stdout.readline()
        started = time.monotonic()
        assert asyncio.run(ping()) >= 0.3 and time.monotonic() - started >= 0.3
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
    finally:
        proc.kill()
