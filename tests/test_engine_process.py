"""The engine in a process of its own (``--engine-process``): the same replies, and a crash of
the engine process that no client connection notices."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.servers import (
    SEEDANCE,
    TEST_WORKERS,
    RunningServer,
    ServerProcess,
    one_process_only,
)
from tests.support.waits import eventually
from tests.support.ws import (
    assert_seq_contiguous,
    collect,
    generate,
    open_session,
    tokens_text,
)


def engine_pid(server: ServerProcess, after: int = 0) -> int:
    """The pid of the engine process the server started last (other than ``after``)."""
    pids = [int(p) for p in re.findall(r"engine process started \(pid (\d+)\)", server.output)]
    pid = pids[-1] if pids else 0
    assert pid and pid != after, server.output
    return pid


async def test_replies_are_the_in_process_engines(
    make_server: Callable[..., RunningServer],
) -> None:
    """Token for token the same reply, usage and finish as the engine in the server's process,
    with the engine's counts (the front's) and its errors."""
    inline = make_server()
    remote = make_server(engine_process=True)
    replies = []
    for server in (inline, remote):
        ws, hello = await open_session(server.url)
        async with ws:
            frames = await generate(ws, prompt="the same words", max_tokens=40, seed=7)
            await ws.send(json.dumps({"prompt": "x", "max_tokens": 10**9}))
            (error,) = await collect(ws)
        replies.append((hello["model"], tokens_text(frames), frames[-1]["usage"], error["error"]))
    assert replies[0] == replies[1]
    assert replies[1][3]["code"] == "invalid_request"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
async def test_a_crash_under_load_ends_no_connection_and_no_reply(
    server_process: Callable[..., ServerProcess], sig: signal.Signals
) -> None:
    server = server_process("--engine-process", "--synthetic-tokens-per-s", "40")
    first = engine_pid(server)
    health = f"http://{server.host}:{server.port}/healthz"
    sockets = [(await open_session(server.url))[0] for _ in range(8)]
    for i, ws in enumerate(sockets):
        await ws.send(json.dumps({"prompt": f"reply {i}", "max_tokens": 60, "request_id": f"r{i}"}))
    replies = [asyncio.create_task(collect(ws, timeout=30)) for ws in sockets]
    statuses: list[int] = []
    async with httpx.AsyncClient() as http:
        await asyncio.sleep(0.5)  # every reply under way
        os.kill(first, sig)
        while not server.output.count("the engine process is back"):
            statuses.append((await http.get(health)).status_code)
            await asyncio.sleep(0.01)
        frames = await asyncio.gather(*replies)
        assert (await http.get(health)).status_code == 200
    assert 503 in statuses  # while the engine process was away
    for i, reply in enumerate(frames):
        done = reply[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length", reply[-1]
        assert assert_seq_contiguous(reply, f"r{i}") == 60
        assert done["usage"]["completion_tokens"] == 60
    for ws in sockets:  # every connection still serves
        assert (await generate(ws, prompt="again", max_tokens=3))[-1]["type"] == "done"
        await ws.close()
    name = signal.Signals(sig).name
    assert f"the engine process (pid {first}) was killed by {name}" in server.output
    # With --workers (SEEDANCE_TEST_WORKERS), each worker counts its own.
    running = re.findall(r"(\d+) request\(s\) of this server were running", server.output)
    assert sum(int(n) for n in running) == 8
    if sig == signal.SIGSEGV:  # the engine process's own stacks, as it died
        assert "Fatal Python error: Segmentation fault" in server.output
    assert engine_pid(server, after=first)


async def test_without_a_wait_running_replies_end_retryable(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process(
        "--engine-process", "--engine-restart-wait", "0", "--synthetic-tokens-per-s", "40"
    )
    first = engine_pid(server)
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "cut", "max_tokens": 100, "request_id": "cut"}))
        reading = asyncio.create_task(collect(ws))
        await asyncio.sleep(0.3)
        os.kill(first, signal.SIGKILL)
        frames = await reading
        error = frames[-1]
        assert error["type"] == "error" and error["request_id"] == "cut"
        assert error["error"]["code"] == "engine_error" and error["error"]["retryable"] is True
        assert "was killed by SIGKILL" in error["error"]["message"]
        # Back for every server process attached to it (each worker of SEEDANCE_TEST_WORKERS).
        attached = int(TEST_WORKERS or 1)
        await eventually(
            lambda: server.output.count("the engine process is back") >= attached, 10, "back"
        )
        again = await generate(ws, prompt="again", max_tokens=5)  # the same connection
    assert again[-1]["type"] == "done"


@one_process_only("reads the engine process's report through the server's engine")
async def test_a_cancel_reaches_the_engine(make_server: Callable[..., RunningServer]) -> None:
    """The engine process stops what the server cancels: its own count of requests drops."""
    server = make_server(engine_process=True, tokens_per_s=20)
    engine = server.engine
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "long", "max_tokens": 1000, "request_id": "c"}))
        await eventually(lambda: engine.reported.unfinished == 1, 5, "running in the engine")
        await ws.send(json.dumps({"type": "cancel", "request_id": "c"}))
        frames = await collect(ws)
        assert frames[-1]["finish_reason"] == "cancelled"
        await eventually(lambda: engine.reported.unfinished == 0, 5, "gone from the engine")


def test_an_engine_that_cannot_load_is_a_startup_error(tmp_path: Any) -> None:
    missing = tmp_path / "missing.gguf"
    done = subprocess.run(
        [SEEDANCE, "serve", "--engine-process", "--model-path", missing],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"seedance serve: error: model file not found: {missing}" in done.stderr


async def test_the_engine_process_ends_with_the_server(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--engine-process")
    pid = engine_pid(server)
    server.signal(signal.SIGKILL)  # no chance to stop it
    server.wait()

    def gone() -> bool:  # or a zombie: ended, not yet reaped by its new parent
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    await eventually(gone, 10, "the engine process ends")


@pytest.mark.model
async def test_the_embedded_model_goes_on_after_a_crash(
    server_process: Callable[..., ServerProcess],
) -> None:
    """SmolLM2 on llama.cpp in the engine process: killed mid-reply, a free reply and one bound
    to a schema each go on from their last token (prefilled again) to a whole reply."""
    server = server_process(
        "--engine-process",
        "--parallel",
        "2",
        "--repack",
        "off",
        env={"SEEDANCE_ENGINE": "llamacpp"},
    )
    first = engine_pid(server)
    schema = {
        "type": "object",
        "properties": {
            "names": {
                "type": "array",
                "items": {"type": "string", "maxLength": 16},
                "minItems": 12,
                "maxItems": 12,
            }
        },
        "required": ["names"],
        "additionalProperties": False,
    }
    ws, _ = await open_session(server.url)
    bound, _ = await open_session(server.url)
    async with ws, bound:
        await ws.send(json.dumps({"prompt": "Tell a story.", "max_tokens": 64, "ignore_eos": True}))
        await bound.send(json.dumps({"prompt": "List names.", "max_tokens": 400, "schema": schema}))
        reading = [asyncio.create_task(collect(w, timeout=60)) for w in (ws, bound)]
        await asyncio.sleep(1.0)  # a few tokens of each
        os.kill(first, signal.SIGKILL)
        free, shaped = await asyncio.gather(*reading)
    assert free[-1]["type"] == "done" and free[-1]["finish_reason"] == "length", free[-1]
    assert free[-1]["usage"]["completion_tokens"] == 64
    assert shaped[-1]["type"] == "done" and shaped[-1]["finish_reason"] == "stop", tokens_text(
        shaped
    )
    document = json.loads(tokens_text(shaped))
    assert len(document["names"]) == 12
    assert server.output.count("goes on after") == 2  # each was under way when it died
