"""``seedance serve --workers N``: worker processes on one port that behave as one server, and
a worker crash that loses only that worker's connections."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from seedance.keyfiles import load_public
from seedance.observability.audit.verify import verify
from tests.support.servers import SEEDANCE, ServerProcess
from tests.support.tools import tool
from tests.support.waits import eventually
from tests.support.ws import collect, generate, open_session, wait_closed
from tests.test_audit import signing_key
from tests.test_resume import PROMPT, Reading, read, resume

pytestmark = pytest.mark.subprocess


@pytest.fixture
def workers(server_process: Callable[..., ServerProcess]) -> Callable[..., ServerProcess]:
    """``seedance serve --workers 2 ...`` on the synthetic engine, with a private Redis."""
    tool("redis-server", "redis-server")

    def start(*args: str, **kwargs: Any) -> ServerProcess:
        return server_process("--workers", "2", *args, **kwargs)

    return start


def worker_of(server: ServerProcess, ws: ClientConnection) -> int:
    """The worker that serves connection ``ws`` (its log line names the client's port)."""
    port = ws.local_address[1]
    line = next(
        line for line in server.lines if re.search(rf" open peer=127\.0\.0\.1:{port} ", line)
    )
    return int(line.split("worker=")[1])


def worker_pid(server: ServerProcess, index: int) -> int:
    """The pid of worker ``index`` (the last one started under that index)."""
    pids = re.findall(rf"worker {index} started \(pid (\d+)\)", server.output)
    return int(pids[-1])


async def on_each_worker(server: ServerProcess) -> dict[int, tuple[ClientConnection, str]]:
    """A connection to each of the two workers, each with a session of its own (the kernel
    spreads connections: connect until both have one)."""
    found: dict[int, tuple[ClientConnection, str]] = {}
    spare = []
    for attempt in range(64):
        ws, hello = await open_session(server.url, f"session_id=s{attempt}")
        await eventually(lambda ws=ws: _logged(server, ws), 5, "the connection's log line")
        index = worker_of(server, ws)
        if index in found:
            spare.append(ws)
        else:
            found[index] = (ws, hello["session_id"])
        if len(found) == 2:
            break
    for ws in spare:
        await ws.close()
    assert len(found) == 2, "the kernel sent 64 connections to one worker"
    return found


def _logged(server: ServerProcess, ws: ClientConnection) -> bool:
    return f" open peer=127.0.0.1:{ws.local_address[1]} " in server.output


async def test_two_workers_serve_one_port_as_one_server(
    workers: Callable[..., ServerProcess],
) -> None:
    """Connections land on both workers; a session goes on from one worker to the other; the
    HTTP API answers from either."""
    server = workers()
    assert "with 2 workers: connect to" in server.output
    (first, _), (second, _) = (await on_each_worker(server)).values()
    await first.close()
    await second.close()
    # One conversation, its turns on alternate workers: each continues the latest.
    conversation: dict[int, int] = {}
    turns = 0
    while len(conversation) < 2 or turns < 4:
        ws, hello = await open_session(server.url, "session_id=talk")
        async with ws:
            assert hello["context_turns"] == 2 * turns
            frames = await generate(ws, prompt=f"turn {turns}", max_tokens=3)
            assert frames[-1]["type"] == "done"
            await eventually(lambda ws=ws: _logged(server, ws), 5)
            conversation[worker_of(server, ws)] = turns
        turns += 1
    async with httpx.AsyncClient() as http:
        base = f"http://{server.host}:{server.port}"
        for _ in range(4):
            reply = await http.post(
                f"{base}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("engine", ["in each worker", "in one engine process"])
async def test_a_dead_worker_loses_only_its_own_connections(
    workers: Callable[..., ServerProcess], engine: str
) -> None:
    """kill -9 of one worker: the other worker's reply goes on untouched; the dead one's client
    resumes its reply through the other worker (taken over after the lease, every token
    once); the supervisor starts the dead worker again, and an engine process the workers
    share drops the dead worker's requests."""
    shared = ("--engine-process",) if engine == "in one engine process" else ()
    server = workers("--synthetic-tokens-per-s", "100", "--lease", "1", *shared)
    connections = await on_each_worker(server)
    replies = {}
    for index, (ws, _) in connections.items():
        request = {"prompt": PROMPT, "max_tokens": 300, "resumable": True, "seed": 7}
        await ws.send(json.dumps({**request, "request_id": f"r{index}"}))
        replies[index] = Reading(f"r{index}")
    doomed, survivor = 0, 1
    for index, (ws, _) in connections.items():
        await read(ws, replies[index], until_seq=20)
    dead_pid = worker_pid(server, doomed)
    os.kill(dead_pid, signal.SIGKILL)
    ws = connections[doomed][0]
    with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
        await read(ws, replies[doomed])  # what was on its way before the socket went
    assert replies[doomed].end is None
    # The survivor's client never noticed.
    await read(connections[survivor][0], replies[survivor])
    assert replies[survivor].end is not None and replies[survivor].end["type"] == "done"
    assert replies[survivor].last_seq == 299
    # The dead worker's client reconnects (to the survivor or the new worker) and resumes.
    session = connections[doomed][1]
    ws, _ = await resume(server, session, replies[doomed])  # type: ignore[arg-type]
    async with ws:
        await read(ws, replies[doomed])
    end = replies[doomed].end
    assert end is not None and end["type"] == "done", end
    assert replies[doomed].last_seq == 299
    await connections[survivor][0].close()
    await server.logged(f"worker {doomed} (pid {dead_pid}) was killed by SIGKILL")
    await eventually(lambda: worker_pid(server, doomed) != dead_pid, 10, "a new worker")
    if shared:
        await server.logged(f"worker-{doomed}-{dead_pid} is gone: 1 request(s) of it stopped")


async def test_sigterm_drains_every_worker(workers: Callable[..., ServerProcess]) -> None:
    server = workers("--synthetic-tokens-per-s", "50")
    connections = await on_each_worker(server)
    for index, (ws, _) in connections.items():
        await ws.send(json.dumps({"prompt": "finish", "max_tokens": 40, "request_id": f"r{index}"}))
    await asyncio.sleep(0.2)
    server.signal(signal.SIGTERM)
    for ws, _ in connections.values():
        code, frames = await wait_closed(ws, timeout=20)
        assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 40
        assert code == 1001
    assert server.wait(30) == 0
    assert server.output.count("stopped") >= 2 and "every worker stopped" in server.output


async def test_metrics_add_up_every_worker(workers: Callable[..., ServerProcess]) -> None:
    """``/metrics`` from either worker counts the requests both served."""
    server = workers()
    base = f"http://{server.host}:{server.port}"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    def served() -> set[str]:
        return {line.split("worker=")[1].strip() for line in server.lines if "http=chat" in line}

    sent = 0
    while sent < 8 or (served() != {"0", "1"} and sent < 64):
        async with httpx.AsyncClient() as http:  # a new connection each: the kernel spreads them
            assert (await http.post(f"{base}/v1/chat/completions", json=body)).status_code == 200
        sent += 1
        logged = functools.partial(lambda n: server.output.count("http=chat") == n, sent)
        await eventually(logged, 5, "the request logged")
    assert served() == {"0", "1"}, f"the kernel sent all {sent} connections to one worker"
    for _ in range(4):
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{base}/metrics")).text
        (line,) = [row for row in text.splitlines() if row.startswith("seedance_requests_total{")]
        assert line.endswith(f" {sent}.0"), line
        assert text.count("# TYPE seedance_requests_total counter") == 1


@pytest.mark.model
async def test_the_workers_share_one_engine_process(
    workers: Callable[..., ServerProcess],
) -> None:
    """The embedded model loads once, in an engine process both workers use; killed, it comes
    back and both workers' replies go on."""
    server = workers("--parallel", "2", "--repack", "off", env={"SEEDANCE_ENGINE": "llamacpp"})

    def engines_started() -> int:
        return server.output.count("engine process started")

    assert engines_started() == 1
    loaded = [line for line in server.lines if "llama.cpp decode thread" in line]
    assert len(loaded) == 1 and "process=engine" in loaded[0], loaded  # not in the workers
    connections = await on_each_worker(server)
    for ws, _ in connections.values():
        await ws.send(
            json.dumps({"prompt": "Tell a story.", "max_tokens": 160, "ignore_eos": True})
        )
    replies = [asyncio.create_task(collect(ws, timeout=60)) for ws, _ in connections.values()]
    await asyncio.sleep(1.0)
    engine = int(re.findall(r"engine process started \(pid (\d+)\)", server.output)[0])
    os.kill(engine, signal.SIGKILL)
    for frames in await asyncio.gather(*replies):
        assert frames[-1]["type"] == "done", frames[-1]
        assert frames[-1]["usage"]["completion_tokens"] == 160
    for ws, _ in connections.values():
        await ws.close()
    # Its replacement, in the log once it has started (a reply may end before that).
    await eventually(lambda: engines_started() == 2, 60, "the engine process started again")


@pytest.mark.model
async def test_an_engine_process_with_fewer_sequences_than_requests_runs_them_all(
    workers: Callable[..., ServerProcess],
) -> None:
    """Each worker admits as many requests as the engine has sequences, so the engine process
    they share gets more: the rest wait for a sequence and run when it is free."""
    server = workers("--parallel", "1", "--repack", "off", env={"SEEDANCE_ENGINE": "llamacpp"})
    connections = await on_each_worker(server)
    for ws, _ in connections.values():
        await ws.send(json.dumps({"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}))
    replies = [collect(ws, timeout=60) for ws, _ in connections.values()]
    for frames in await asyncio.gather(*replies):
        assert frames[-1]["type"] == "done", frames[-1]
        assert frames[-1]["usage"]["completion_tokens"] == 200
    for ws, _ in connections.values():
        await ws.close()


async def test_the_workers_write_one_audit_chain(
    workers: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Both workers append to one signed audit log, one chain in order; a worker killed in the
    middle leaves a chain the other worker and its replacement continue; the log verifies,
    sealed, with every request in it."""
    log, key = tmp_path / "audit.log", signing_key(tmp_path)
    server = workers("--audit-file", str(log), "--audit-signing-key", str(key))
    connections = await on_each_worker(server)

    async def requests(ws: ClientConnection, index: int, first: int) -> None:
        for i in range(first, first + 15):
            frames = await generate(ws, prompt="p", max_tokens=3, request_id=f"w{index}-{i}")
            assert frames[-1]["type"] == "done"

    await asyncio.gather(*(requests(ws, index, 0) for index, (ws, _) in connections.items()))
    dead_pid = worker_pid(server, 0)
    os.kill(dead_pid, signal.SIGKILL)
    await eventually(lambda: worker_pid(server, 0) != dead_pid, 10, "a new worker")
    await server.logged(f"worker 0 serving (pid {worker_pid(server, 0)})")
    await requests(connections[1][0], 1, 15)
    again = await on_each_worker(server)  # the new worker 0 writes too
    await requests(again[0][0], 0, 15)
    for ws, _ in [*connections.values(), *again.values()]:
        await ws.close()
    server.signal(signal.SIGTERM)
    assert server.wait() == 0

    verdict = verify(log, load_public(key))
    assert verdict.ok and verdict.message.endswith("sealed"), verdict.message
    assert "Merkle root(s) recomputed" in verdict.message  # one tree, whoever wrote
    written = [json.loads(line) for line in log.read_text().splitlines()]
    requests_written = {r["request_id"] for r in written if r["kind"] == "request"}
    assert {f"w{w}-{i}" for w in (0, 1) for i in range(30)} <= requests_written
    assert sum(r["kind"] == "start" for r in written) == 3  # two workers, one started again


@pytest.mark.parametrize(
    ("flag", "refused"),
    [
        (("--model-registry", "models"), "--model-registry"),
        (("--engine", "vllm"), "the vllm engine cannot be shared"),
    ],
)
def test_what_workers_cannot_do_yet_is_refused_at_startup(
    tmp_path: Any, flag: tuple[str, ...], refused: str
) -> None:
    import subprocess

    done = subprocess.run(
        [SEEDANCE, "serve", "--workers", "2", *flag],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "seedance serve: error: --workers 2: " in done.stderr and refused in done.stderr


def test_a_worker_that_cannot_start_stops_the_server_at_once(tmp_path: Any) -> None:
    """A setting only a worker checks (a certificate file that is not PEM): the server ends
    with status 2 and the worker's reason, instead of starting it again and again."""
    import subprocess

    tool("redis-server", "redis-server")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    done = subprocess.run(
        [
            *(SEEDANCE, "serve", "--engine", "synthetic", "--workers", "2", "--port", "0"),
            *("--tls-cert", str(bad), "--tls-key", str(bad)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"--tls-cert: no PEM certificate in {bad}" in done.stderr
    assert "while starting (its lines above say why): stopping" in done.stderr
    assert "killed by" not in done.stderr  # the other worker ended as asked


def test_without_redis_anywhere_workers_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from seedance.config import ConfigError, ServerConfig
    from seedance.server import workers as module

    monkeypatch.setattr(module, "_redis_server", lambda: None)
    with pytest.raises(ConfigError, match="pass --redis URL, or install redis-server"):
        module.check(ServerConfig.of(engine="synthetic", workers=2))
    module.check(ServerConfig.of(engine="synthetic", workers=2, redis_url="redis://h:6379/0"))
