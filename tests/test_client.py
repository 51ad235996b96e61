"""The Python client SDK: streaming, typed errors, heartbeats, the synchronous wrapper."""

from __future__ import annotations

import asyncio

import pytest

from seedance.client import (
    ConnectionClosed,
    InvalidRequest,
    ModelNotFound,
    SessionBusy,
    connect,
    connect_sync,
    infer_url,
)
from tests.support.servers import RunningServer, slow_engine


def test_infer_url() -> None:
    assert infer_url("ws://h:1") == "ws://h:1/v2/infer"
    assert infer_url("wss://h/", session_id="a b", model=None) == "wss://h/v2/infer?session_id=a+b"
    assert infer_url("ws://h/custom?x=1", model="m") == "ws://h/custom?x=1&model=m"
    with pytest.raises(InvalidRequest):
        infer_url("http://h")


async def test_stream_and_session_properties(server: RunningServer) -> None:
    async with connect(server.url, session_id="sdk", model="synthetic") as session:
        assert (session.session_id, session.model, session.created) == ("sdk", "synthetic", True)
        stream = session.generate("hi", max_tokens=7, temperature=0, seed=1, stop=["zzz"])
        chunks = [chunk async for chunk in stream]
        # Frames may merge tokens: seq and n still cover 0..6 with no gap.
        assert [c.seq for c in chunks] == [sum(c.n for c in chunks[:i]) for i in range(len(chunks))]
        assert sum(c.n for c in chunks) == 7
        assert stream.start is not None and stream.done is not None
        assert stream.done.usage.completion_tokens == 7
        assert stream.text == "".join(c.text for c in chunks)
        whole = await session.complete("hi", max_tokens=7, seed=1, reset=True)
        assert whole.text == stream.text
        messages = await session.generate(
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            max_tokens=2,
        ).collect()
        assert messages.finish_reason == "length"
        # priority reaches the server's admission queue (and its rules)
        assert (await session.complete("hi", max_tokens=2, priority=5)).finish_reason == "length"
        with pytest.raises(InvalidRequest, match="priority must be between -10 and 10"):
            await session.complete("hi", priority=11)


async def test_typed_errors(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(100)])
    with pytest.raises(ModelNotFound) as info:
        await connect(server.url, model="missing")
    assert info.value.code == "model_not_found" and "missing" in info.value.message
    async with connect(server.url) as session:
        first = session.generate("long", max_tokens=50)
        await first.__anext__()
        second = session.generate("second")
        with pytest.raises(SessionBusy) as busy:
            await second.collect()
        assert busy.value.retryable and busy.value.code == "session_busy"
        with pytest.raises(SessionBusy):  # a failed stream keeps failing, it never hangs
            await second.collect()
        with pytest.raises(InvalidRequest, match="max_tokens must be between"):
            await session.generate("x", max_tokens=10**6).collect()
        await first.cancel()
        done = await first.collect()
        assert done.finish_reason == "cancelled"


async def test_ping_round_trips(server: RunningServer) -> None:
    async with connect(server.url) as session:
        rtt = await session.ping()
        assert 0 < rtt < 1
        assert 0 < await session.ping_json() < 1
        rtts = await asyncio.gather(*(session.ping() for _ in range(5)))
        assert len(rtts) == 5


@pytest.mark.slow
async def test_client_answers_server_heartbeats(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(heartbeat_interval_s=0.1, idle_timeout_s=0.3)
    async with connect(server.url) as session:
        await asyncio.sleep(1.0)  # more than three idle timeouts
        assert not session.closed
        assert (await session.complete("still here", max_tokens=2)).finish_reason == "length"


async def test_end_session_and_closed_errors(server: RunningServer) -> None:
    session = await connect(server.url, session_id="to-end")
    await session.complete("remember", max_tokens=2)
    await session.end()
    assert session.closed and session.close_code == 1000
    with pytest.raises(ConnectionClosed):
        await session.complete("anyone?")
    async with connect(server.url, session_id="to-end") as again:
        assert again.created


@pytest.mark.slow
async def test_server_shutdown_fails_the_stream_with_connection_closed(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(50)], drain_timeout_s=0.2)
    async with connect(server.url, reconnect=None) as session:
        stream = session.generate("x", max_tokens=500)
        await stream.__anext__()
        await asyncio.to_thread(server.stop)
        done = await stream.collect()  # the drain cancels it, then closes 1001
        assert done.finish_reason == "cancelled"
        await asyncio.sleep(0.1)
        assert session.closed and session.close_code == 1001


def test_sync_client(server: RunningServer) -> None:
    with connect_sync(server.url, session_id="sync") as session:
        assert session.session_id == "sync"
        stream = session.generate("hello", max_tokens=6)
        chunks = list(stream)
        assert sum(c.n for c in chunks) == 6 and stream.done is not None
        assert session.complete("again", max_tokens=3).usage.completion_tokens == 3
        assert 0 < session.ping() < 1
    with pytest.raises(ModelNotFound):
        connect_sync(server.url, model="nope")
