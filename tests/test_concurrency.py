"""Many sessions streaming at once, through the Python client."""

from __future__ import annotations

import asyncio
import resource

import pytest

from seedance.client import connect
from tests.support.servers import RunningServer, one_process_only

STREAMS = 500
TOKENS = 20


@pytest.fixture(autouse=True)
def _enough_file_descriptors() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * STREAMS + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def one_stream(url: str, i: int, start: asyncio.Event) -> tuple[str, int, str]:
    async with connect(url, session_id=f"user-{i}", open_timeout_s=60) as session:
        await start.wait()
        stream = session.generate(f"prompt number {i}", seed=i, max_tokens=TOKENS)
        expected_seq = 0
        async for chunk in stream:
            assert chunk.seq == expected_seq
            expected_seq += chunk.n
        done = stream.done
        assert done is not None and done.finish_reason == "length"
        assert done.usage.completion_tokens == expected_seq == TOKENS
        return session.session_id, expected_seq, stream.text


@pytest.mark.slow
@one_process_only("reads the server's sessions in its process")
async def test_500_concurrent_sessions(server: RunningServer) -> None:
    start = asyncio.Event()
    tasks = [asyncio.create_task(one_stream(server.url, i, start)) for i in range(STREAMS)]
    while len(server.connections) < STREAMS:  # all connected before any generates
        await asyncio.sleep(0.05)
        assert not any(t.done() and t.exception() for t in tasks)
    start.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert sorted(r[0] for r in results) == sorted(f"user-{i}" for i in range(STREAMS))
    assert all(r[1] == TOKENS for r in results)
    assert server.engine.stats.requests_finished == STREAMS
    # Each reply is the one the same request gets alone.
    for i in (0, 137, 499):
        async with connect(server.url) as session:
            alone = session.generate(f"prompt number {i}", seed=i, max_tokens=TOKENS)
            await alone.collect()
            assert alone.text == results[i][2]
