"""Graceful shutdown of a real ``seedance serve`` process on SIGTERM and SIGINT."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from tests.conftest import ServerProcess
from tests.wsutil import assert_seq_contiguous, open_session, raw_connect, recv_json, wait_closed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_shutdown_drains_running_generations_then_closes_1001(server_process, sig) -> None:  # type: ignore[no-untyped-def]
    server: ServerProcess = server_process("--synthetic-tokens-per-s", "50")
    ws, _ = await open_session(server.url)
    idle, _ = await open_session(server.url)
    async with ws, idle:
        await ws.send(json.dumps({"prompt": "finish me", "max_tokens": 40, "request_id": "r1"}))
        frames = [await recv_json(ws) for _ in range(3)]
        server.signal(sig)
        await asyncio.sleep(0.3)
        # New connections are refused while draining ...
        with pytest.raises(OSError):
            async with raw_connect(server.url, open_timeout=2):
                pass
        # ... and so are new generations on open connections.
        await idle.send(json.dumps({"prompt": "too late", "request_id": "late"}))
        late = await recv_json(idle)
        assert late["error"]["code"] == "overloaded" and late["error"]["retryable"] is True
        code, rest = await wait_closed(ws, timeout=20)
        idle_code, _ = await wait_closed(idle, timeout=20)
    frames += rest
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert assert_seq_contiguous(frames, "r1") == 40
    assert code == 1001 and idle_code == 1001
    assert server.wait() in (0, -sig, 128 + sig, 130)
    assert "draining" in server.output


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
