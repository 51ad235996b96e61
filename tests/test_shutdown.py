"""Graceful shutdown of a real ``seedance serve`` process on SIGTERM and SIGINT."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
import pytest

from tests.support.servers import ServerProcess
from tests.support.ws import (
    assert_seq_contiguous,
    open_session,
    raw_connect,
    recv_json,
    wait_closed,
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.subprocess
async def test_shutdown_drains_running_generations_then_closes_1001(server_process, sig) -> None:  # type: ignore[no-untyped-def]
    server: ServerProcess = server_process("--synthetic-tokens-per-s", "50")
    ws, _ = await open_session(server.url)
    idle, _ = await open_session(server.url)
    async with ws, idle:
        await ws.send(json.dumps({"prompt": "finish me", "max_tokens": 40, "request_id": "r1"}))
        frames = [await recv_json(ws) for _ in range(3)]
        server.signal(sig)
        await server.logged("shutting down")
        # New connections are refused while draining ...
        with pytest.raises(OSError):
            async with raw_connect(server.url, open_timeout=2):
                pass
        # ... and so are new generations on open connections (draining is checked first).
        await ws.send(json.dumps({"prompt": "too late", "request_id": "late"}))
        # A connection that reads no stream is closed at once (spread out among many).
        idle_code, _ = await wait_closed(idle, timeout=5)
        code, rest = await wait_closed(ws, timeout=20)
    late = next(f for f in rest if f.get("request_id") == "late")
    assert late["error"]["code"] == "overloaded" and late["error"]["retryable"] is True
    frames += [f for f in rest if f is not late]
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert assert_seq_contiguous(frames, "r1") == 40
    assert code == 1001 and idle_code == 1001
    assert server.wait() in (0, -sig, 128 + sig, 130)
    assert "draining" in server.output


@pytest.mark.subprocess
async def test_drain_timeout_cancels_what_still_runs(server_process) -> None:  # type: ignore[no-untyped-def]
    server: ServerProcess = server_process(
        "--synthetic-tokens-per-s", "50", "--drain-timeout", "0.5"
    )
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "too long", "max_tokens": 1000}))
        await recv_json(ws)
        server.signal(signal.SIGTERM)
        code, frames = await wait_closed(ws, timeout=20)
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert 0 < done["usage"]["completion_tokens"] < 1000
    assert code == 1001
    server.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.subprocess
async def test_a_second_signal_skips_the_wait_and_streams_still_end_well(
    server_process: Any, sig: int
) -> None:
    server: ServerProcess = server_process("--synthetic-tokens-per-s", "50")  # drain: 30 s
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "too long", "max_tokens": 1000}))
        await recv_json(ws)
        server.signal(sig)
        await server.logged("shutting down")
        server.signal(sig)
        code, frames = await wait_closed(ws, timeout=5)  # not the 30 s of the drain
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert code == 1001
    assert server.wait(timeout=10) in (0, -sig, 128 + sig, 130)
    assert "a second signal: cancelling 1 generation(s)" in server.output
    assert "stopped" in server.output


async def _sse_lines(response: httpx.Response, into: list[str], started: asyncio.Event) -> None:
    async for line in response.aiter_lines():
        if line:
            into.append(line)
            if len(into) == 3:
                started.set()


@pytest.mark.parametrize("second_signal", [False, True])
@pytest.mark.subprocess
async def test_sse_streams_end_with_an_error_event_and_done_at_shutdown(
    server_process: Any, second_signal: bool
) -> None:
    drain = "30" if second_signal else "0.5"
    server: ServerProcess = server_process(
        "--synthetic-tokens-per-s", "50", "--drain-timeout", drain
    )
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "too long"}],
        "max_tokens": 1000,
        "stream": True,
    }
    lines: list[str] = []
    base = f"http://127.0.0.1:{server.port}"
    async with (
        httpx.AsyncClient(base_url=base, timeout=20) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        streaming = asyncio.Event()
        reading = asyncio.create_task(_sse_lines(response, lines, streaming))
        await asyncio.wait_for(streaming.wait(), 10)
        server.signal(signal.SIGTERM)
        if second_signal:
            await server.logged("shutting down")
            server.signal(signal.SIGTERM)
        await asyncio.wait_for(reading, 5)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "overloaded" and "shutting down" in error["message"]
    assert server.wait(timeout=10) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert "Traceback" not in server.output
    assert "stopped" in server.output


@pytest.mark.subprocess
async def test_a_whole_reply_still_running_at_shutdown_gets_503(server_process: Any) -> None:
    server: ServerProcess = server_process(
        "--synthetic-tokens-per-s", "50", "--drain-timeout", "0.5"
    )
    body = {"model": "synthetic", "prompt": "too long", "max_tokens": 1000}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=20) as http:
        reply = asyncio.create_task(http.post("/v1/completions", json=body))
        await _running(http, 1)
        server.signal(signal.SIGTERM)
        response = await reply
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "overloaded"
    server.wait(timeout=10)
    assert "Traceback" not in server.output


async def _running(http: httpx.AsyncClient, count: int) -> None:
    """Wait until the server's /metrics counts ``count`` generations running."""
    line = f'seedance_requests_running{{engine="synthetic",model="synthetic"}} {float(count)}'
    for _ in range(500):
        if line in (await http.get("/metrics")).text:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not running: {line}")
