"""Every error code this server can produce, with the connection state PROTOCOL.md gives."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from seedance.engines.base import GenerationRequest, TokenDelta
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.messages import ChatMessage
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.waits import eventually
from tests.support.ws import (
    assert_seq_contiguous,
    collect,
    generate,
    open_session,
    raw_connect,
    recv_json,
    wait_closed,
)


async def still_open(ws: Any) -> None:
    """The connection still serves: a ping gets its pong."""
    await ws.send(json.dumps({"type": "ping", "id": "alive"}))
    assert await recv_json(ws) == {"type": "pong", "id": "alive"}


def error_of(frame: dict[str, Any], code: str) -> dict[str, Any]:
    assert frame["type"] == "error", frame
    assert frame["error"]["code"] == code, frame
    return frame["error"]


async def test_invalid_json_keeps_the_connection(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        for bad in ("not json", "[1, 2]", '{"prompt": '):
            await ws.send(bad)
            body = error_of(await recv_json(ws), "invalid_json")
            assert body["retryable"] is False
        await still_open(ws)
        frames = await generate(ws, prompt="after errors", max_tokens=3)
        assert frames[-1]["type"] == "done"


async def test_invalid_request_names_the_field(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "x", "colour": "red", "request_id": "r1"}))
        frame = await recv_json(ws)
        assert error_of(frame, "invalid_request")["message"] == "unknown field 'colour'"
        assert frame["request_id"] == "r1"
        await ws.send(json.dumps({"type": "dance"}))
        assert "unknown message type" in error_of(await recv_json(ws), "invalid_request")["message"]
        await ws.send(json.dumps({"prompt": "x", "max_tokens": 999999}))
        message = error_of(await recv_json(ws), "invalid_request")["message"]
        assert message == "max_tokens must be between 1 and 16384"
        await still_open(ws)


async def test_unsupported_binary_frame(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(b"\x10\x00tensor")  # a tensor frame, malformed
        assert "16-byte header" in error_of(await recv_json(ws), "invalid_request")["message"]
        await ws.send(b"\x07")
        assert "or a tensor frame" in error_of(await recv_json(ws), "unsupported_frame")["message"]
        await still_open(ws)


@pytest.mark.slow
async def test_session_busy_does_not_disturb_the_running_request(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(200)])
    ws, _ = await open_session(server.url, "session_id=busy")
    other, _ = await open_session(server.url, "session_id=busy")
    async with ws, other:
        await ws.send(json.dumps({"prompt": "long", "max_tokens": 40, "request_id": "first"}))
        start = await recv_json(ws)
        assert start["type"] == "start"
        await ws.send(json.dumps({"prompt": "again", "request_id": "second"}))
        await other.send(json.dumps({"prompt": "from elsewhere", "request_id": "third"}))
        frames = await collect(ws)
        busy = [f for f in frames if f["type"] == "error"]
        assert len(busy) == 1 and busy[0]["request_id"] == "second"
        assert error_of(busy[0], "session_busy")["retryable"] is True
        frames += await collect(ws)  # the first request goes on to its done frame
        first = [f for f in frames if f.get("request_id") == "first"]
        assert first[-1]["type"] == "done" and first[-1]["finish_reason"] == "length"
        assert assert_seq_contiguous(first, "first") == 40
        third = await recv_json(other)
        assert third["request_id"] == "third"
        error_of(third, "session_busy")


async def test_context_overflow(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SyntheticEngine(context_length=64, max_output_tokens=32)])
    ws, _ = await open_session(server.url)
    async with ws:
        frame = (await generate(ws, prompt="word " * 100, request_id="big"))[-1]
        body = error_of(frame, "context_overflow")
        assert frame["request_id"] == "big"
        assert "context holds 64" in body["message"]
        await still_open(ws)
        # A history that grows past the window is trimmed, not an error.
        for _ in range(6):
            frames = await generate(ws, prompt="word " * 10, max_tokens=10)
            assert frames[-1]["type"] == "done"
            assert frames[0]["prompt_tokens"] <= 64 - 10


async def test_model_not_found_closes_4404(server: RunningServer) -> None:
    async with raw_connect(server.url, "model=nope") as ws:
        code, frames = await wait_closed(ws)
    assert code == 4404
    body = error_of(frames[0], "model_not_found")
    assert "nope" in body["message"] and "synthetic" in body["message"]


async def test_invalid_session_id_is_refused(server: RunningServer) -> None:
    async with raw_connect(server.url, "session_id=bad%20id") as ws:
        code, frames = await wait_closed(ws)
    assert code == 1008
    assert "session_id" in error_of(frames[0], "invalid_request")["message"]


@one_process_only("reads the server's admission in its process")
async def test_overloaded_when_the_queue_is_full(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(100)], max_running=1, max_waiting=1)
    admission = server.state.models[server.state.models.default].admission
    sockets = [(await open_session(server.url))[0] for _ in range(3)]
    try:
        for i, ws in enumerate(sockets):
            await ws.send(json.dumps({"prompt": "x", "max_tokens": 10, "request_id": f"r{i}"}))
            if i == 0:
                assert (await recv_json(ws))["type"] == "start"
            if i == 1:  # the second waits in the queue; the third finds it full
                await eventually(lambda: admission.waiting == 1)
        third = await recv_json(sockets[2])
        body = error_of(third, "overloaded")
        assert body["retryable"] is True and third["request_id"] == "r2"
        await still_open(sockets[2])
        waited = await collect(sockets[1])
        assert waited[-1]["type"] == "done" and waited[-1]["timing"]["queue_ms"] > 20
    finally:
        for ws in sockets:
            await ws.close()


@one_process_only("--max-connections is each worker's")
async def test_overloaded_at_connect_closes_1013(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(max_connections=1)
    ws, _ = await open_session(server.url)
    async with ws:
        async with raw_connect(server.url) as second:
            code, frames = await wait_closed(second)
        assert code == 1013
        error_of(frames[0], "overloaded")
        await still_open(ws)


async def test_frame_over_the_limit_closes_1009(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        ok = json.dumps({"prompt": "x" * (1024 * 1024 - 100), "max_tokens": 1})
        await ws.send(ok)
        assert (await collect(ws))[-1]["type"] == "done"
        await ws.send(json.dumps({"prompt": "x" * (1024 * 1024)}))
        code, frames = await wait_closed(ws)
    assert code == 1009
    assert "limit of 1048576 bytes" in error_of(frames[0], "payload_too_large")["message"]


class FaultyEngine(SyntheticEngine):
    """Fails on request: in the middle of a reply, or while counting tokens."""

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        if "explode" in request.messages[-1].content:
            yield TokenDelta("a")
            yield TokenDelta("b")
            raise RuntimeError("CUDA error: secret internal detail")
        async for delta in super().generate(request):
            yield delta

    def count_message_tokens(self, message: ChatMessage) -> int:
        if "crash" in message.content:
            raise ValueError("secret tokenizer detail")
        return super().count_message_tokens(message)


@one_process_only("reads the server's engine in its process")
async def test_engine_error_fails_only_that_request(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[FaultyEngine()])
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="please explode", request_id="boom")
        assert [f["type"] for f in frames] == ["start", "token", "token", "error"]
        body = error_of(frames[-1], "engine_error")
        assert body["retryable"] is True and "boom" in body["message"]
        assert "secret" not in json.dumps(frames)
        frames = await generate(ws, prompt="fine now", max_tokens=4)
        assert frames[-1]["type"] == "done"
        # The failed request kept nothing in the context.
        assert frames[0]["prompt_tokens"] == server.engine.count_prompt_tokens(
            [ChatMessage("user", "fine now")]
        )


async def test_internal_error_names_the_request_only(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[FaultyEngine()])
    ws, _ = await open_session(server.url)
    async with ws:
        frame = (await generate(ws, prompt="crash please", request_id="r-crash"))[-1]
        body = error_of(frame, "internal_error")
        assert frame["request_id"] == "r-crash"
        assert body["message"] == "internal error on request r-crash"
        await still_open(ws)
        assert (await generate(ws, prompt="ok", max_tokens=2))[-1]["type"] == "done"
