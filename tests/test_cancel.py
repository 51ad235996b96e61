"""Cancel and disconnect stop the engine: no token is produced after the abort."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.servers import one_process_only, slow_engine
from tests.support.waits import eventually
from tests.support.ws import collect, generate, open_session, recv_json


async def settle(engine, seconds: float = 0.3) -> int:  # type: ignore[no-untyped-def]
    """The engine's token counter, checked to stay still for ``seconds``."""
    before = engine.stats.tokens_generated
    await asyncio.sleep(seconds)
    after = engine.stats.tokens_generated
    assert after == before, f"engine still producing: {before} -> {after}"
    return after


@pytest.mark.slow
@one_process_only("reads the engine the test made, which each worker copies")
async def test_cancel_stops_the_engine_and_keeps_nothing(make_server) -> None:  # type: ignore[no-untyped-def]
    engine = slow_engine(200)
    server = make_server(engines=[engine])
    ws, _ = await open_session(server.url, "session_id=c")
    async with ws:
        await ws.send(json.dumps({"prompt": "long story", "max_tokens": 2000, "request_id": "r1"}))
        frames = [await recv_json(ws) for _ in range(6)]  # start + 5 tokens
        await ws.send(json.dumps({"type": "cancel", "request_id": "r1"}))
        frames += await collect(ws)
        done = frames[-1]
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        produced = await settle(engine)
        assert produced < 2000
        assert engine.stats.active == 0 and engine.stats.requests_aborted == 1
        sent = sum(f.get("n", 1) for f in frames if f["type"] == "token")
        assert done["usage"]["completion_tokens"] == sent
        # Nothing of the cancelled request stays in the context.
        fresh = await generate(ws, prompt="long story", max_tokens=2)
        assert fresh[0]["prompt_tokens"] == frames[0]["prompt_tokens"]


async def test_cancel_without_a_running_request_is_not_an_error(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(100)])
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"type": "cancel"}))
        await ws.send(json.dumps({"type": "ping", "id": 1}))
        assert await recv_json(ws) == {"type": "pong", "id": 1}
        # A cancel naming another request leaves the running one alone.
        await ws.send(json.dumps({"prompt": "x", "max_tokens": 10, "request_id": "keep"}))
        await ws.send(json.dumps({"type": "cancel", "request_id": "other"}))
        frames = await collect(ws)
        assert frames[-1]["finish_reason"] == "length"


async def test_cancel_a_whole_reply_returns_the_partial_text(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(200)])
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "x", "max_tokens": 1000, "stream": False}))
        assert (await recv_json(ws))["type"] == "start"
        await asyncio.sleep(0.1)
        await ws.send(json.dumps({"type": "cancel"}))
        done = (await collect(ws))[-1]
    assert done["finish_reason"] == "cancelled"
    assert 0 < done["usage"]["completion_tokens"] < 1000 and done["text"]


@pytest.mark.slow
@one_process_only("reads the engine the test made, which each worker copies")
async def test_disconnect_stops_the_engine(make_server) -> None:  # type: ignore[no-untyped-def]
    engine = slow_engine(200)
    server = make_server(engines=[engine])
    ws, _ = await open_session(server.url, "session_id=gone")
    await ws.send(json.dumps({"prompt": "x", "max_tokens": 2000}))
    for _ in range(4):
        await recv_json(ws)
    ws.transport.abort()  # vanish without a close frame
    await eventually(lambda: engine.stats.active == 0, what="the engine freed")
    produced = await settle(engine)
    assert produced < 2000
    assert engine.stats.active == 0 and engine.stats.requests_aborted == 1
    session = server.state.sessions.get("default", "gone")
    assert session is not None and not session.busy and session.turns == []


@pytest.mark.slow
@one_process_only("reads the server's requests in its process")
async def test_cancel_while_queued(make_server) -> None:  # type: ignore[no-untyped-def]
    engine = slow_engine(100)
    server = make_server(engines=[engine], max_running=1)
    running, _ = await open_session(server.url)
    queued, _ = await open_session(server.url)
    async with running, queued:
        await running.send(json.dumps({"prompt": "x", "max_tokens": 30}))
        assert (await recv_json(running))["type"] == "start"
        await queued.send(json.dumps({"prompt": "y", "request_id": "q"}))
        await asyncio.sleep(0.05)
        admission = server.state.models["synthetic"].admission
        assert admission.waiting == 1
        await queued.send(json.dumps({"type": "cancel"}))
        frames = await collect(queued)
        assert [f["type"] for f in frames] == ["done"]
        assert frames[0]["finish_reason"] == "cancelled"
        assert frames[0]["usage"]["completion_tokens"] == 0
        assert admission.waiting == 0
        assert (await collect(running))[-1]["finish_reason"] == "length"
        assert engine.stats.requests_started == 1


async def test_a_cancel_stops_its_own_sessions_request_not_anothers_of_the_same_id(
    make_server,  # type: ignore[no-untyped-def]
) -> None:
    """Request ids are the client's to choose: two sessions may run "r1" at once, and a cancel
    on one must not reach the other (the server finds a session's request by the session)."""
    server = make_server(engines=[slow_engine(200)])
    first, _ = await open_session(server.url, "session_id=one")
    second, _ = await open_session(server.url, "session_id=two")
    async with first, second:
        for ws in (first, second):
            await ws.send(
                json.dumps({"prompt": "long story", "max_tokens": 400, "request_id": "r1"})
            )
            assert (await recv_json(ws))["type"] == "start"
        await first.send(json.dumps({"type": "cancel", "request_id": "r1"}))
        assert (await collect(first))[-1]["finish_reason"] == "cancelled"
        done = (await collect(second))[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length", done
