"""Seedance behind the load balancers of ``deploy/``: HAProxy run for real in front of two
nodes, and both configurations checked by their own tools (``haproxy -c``, ``nginx -t``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from seedance.cluster.local import haproxy_env
from seedance.netutil import free_port
from tests.support.dns import Dns
from tests.support.servers import ServerProcess
from tests.support.tools import tool, wait_listening
from tests.support.waits import eventually
from tests.support.ws import (
    assert_seq_contiguous,
    collect,
    generate,
    open_session,
    recv_json,
)

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"

pytestmark = pytest.mark.subprocess


@contextlib.contextmanager
def haproxy(
    nodes: list[int], runtime: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[str]:
    """HAProxy with the deploy configuration in front of ``nodes`` (``runtime``: its runtime
    API's socket; ``env``: more of the configuration's variables); yields its ws:// URL."""
    binary = tool("haproxy", "haproxy")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-db", "-f", str(HAPROXY_CFG)],
        env={**haproxy_env(port, nodes, None if runtime is None else str(runtime)), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(proc, port, "haproxy")
        yield f"ws://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def frames_until_token(ws: ClientConnection, count: int) -> list[dict[str, Any]]:
    """Frames up to the ``count``-th token."""
    frames: list[dict[str, Any]] = []
    while sum(1 for f in frames if f["type"] == "token") < count:
        frames.append(await recv_json(ws))
        assert frames[-1]["type"] not in ("done", "error"), frames
    return frames


def node_of(session_id: str, nodes: dict[str, ServerProcess]) -> str:
    """The node whose log shows a connection to ``session_id``."""
    served = [name for name, node in nodes.items() if f"session={session_id} " in node.output]
    assert len(served) == 1, (session_id, served)
    return served[0]


def test_haproxy_accepts_the_config() -> None:
    binary = tool("haproxy", "haproxy")
    result = subprocess.run(
        [binary, "-c", "-f", str(HAPROXY_CFG)],
        env=haproxy_env(free_port(), []),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout + result.stderr


def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    binary = tool("nginx", "nginx")
    result = subprocess.run(
        [binary, "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(NGINX_CONF)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "test is successful" in result.stderr


async def test_haproxy_keeps_each_session_on_one_node_and_drains_a_stopping_one() -> None:
    nodes = {"a": ServerProcess("--synthetic-tokens-per-s", "50"), "b": ServerProcess()}
    try:
        with haproxy([nodes["a"].port, nodes["b"].port]) as url:
            # Every turn of a session reaches the node that holds it (hash on session_id).
            sessions = [f"sticky-{i}" for i in range(8)]
            for session in sessions:
                for turn in range(3):
                    ws, hello = await open_session(url, f"session_id={session}")
                    assert hello["created"] is (turn == 0), (session, turn, hello)
                    assert hello["context_turns"] == 2 * turn
                    frames = await generate(ws, prompt=f"turn {turn}", max_tokens=2)
                    assert frames[-1]["type"] == "done"
                    await ws.close()
            homes = {s: node_of(s, nodes) for s in sessions}
            assert set(homes.values()) == {"a", "b"}  # consistent hashing spread them

            # A node told to stop finishes the stream it runs through the balancer, and the
            # balancer sends the session's next connection to the other node.
            session = next(s for s, home in homes.items() if home == "a")
            ws, _ = await open_session(url, f"session_id={session}")
            await ws.send('{"prompt": "a long one", "max_tokens": 100}')
            first = await frames_until_token(ws, 5)
            nodes["a"].signal(signal.SIGTERM)
            rest = await collect(ws, timeout=30)
            frames = first + rest
            assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length"
            assert assert_seq_contiguous(frames) == 100

            async def moved() -> bool:
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    other, hello = await open_session(url, f"session_id={session}")
                    await other.close()
                    return bool(hello["created"])  # memory mode: a new session on node b
                return False

            deadline = time.monotonic() + 10
            while not await moved():
                assert time.monotonic() < deadline, "the balancer kept sending to node a"
                await asyncio.sleep(0.2)
            await eventually(lambda: nodes["a"].proc.poll() is not None, 30, "node a exits")
            assert nodes["a"].proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
            assert "Traceback" not in nodes["a"].output
    finally:
        for node in nodes.values():
            node.stop()


async def connection_to(url: str, name: str, nodes: dict[str, ServerProcess]) -> ClientConnection:
    """A new session's connection through the balancer that reached node ``name``."""
    for i in range(100):
        session = f"to-{name}-{i}"
        ws, _ = await open_session(url, f"session_id={session}")
        logged = f"session={session} "
        await eventually(lambda: any(logged in n.output for n in nodes.values()), 5, "its log")  # noqa: B023
        if node_of(session, nodes) == name:
            return ws
        await ws.close()
    raise AssertionError(f"no connection reached node {name}")


def tell(runtime: Path, command: str) -> str:
    """One command to HAProxy's runtime API; its answer."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(runtime))
        sock.sendall(command.encode() + b"\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.decode()


def servers(runtime: Path) -> list[dict[str, str]]:
    """The backend's servers as HAProxy's stats show them: ``svname``, ``addr`` (HOST:PORT),
    ``status`` (UP, DOWN, DRAIN, MAINT, ...)."""
    lines = tell(runtime, "show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
    return [
        row for row in rows
        if row.get("pxname") == "seedance_nodes" and row["svname"] not in ("BACKEND", "FRONTEND")
    ]  # fmt: skip


def server_state(runtime: Path, server: str) -> str:
    """A server's status (UP, DOWN, DRAIN, MAINT, ...)."""
    found = [row["status"] for row in servers(runtime) if row["svname"] == server]
    assert found, f"no server {server}"
    return found[0]


def up_at(runtime: Path) -> set[str]:
    """The addresses of the servers that are up."""
    return {row["addr"] for row in servers(runtime) if row["status"] == "UP"}


@contextlib.asynccontextmanager
async def under_load(url: str) -> AsyncIterator[None]:
    """New sessions through ``url``, one short reply each, one after another while the block
    runs; every one of those replies must end ``done``."""
    ended: list[str] = []
    stop = asyncio.Event()

    async def load() -> None:
        i = 0
        while not stop.is_set():
            ws, _ = await open_session(url, f"session_id=load-{i}")
            async with ws:
                ended.append((await generate(ws, prompt="hi", max_tokens=2))[-1]["type"])
            i += 1
            await asyncio.sleep(0.02)

    loading = asyncio.ensure_future(load())
    try:
        yield
    finally:
        stop.set()
        await loading
    assert ended and set(ended) == {"done"}, ended


@pytest.fixture
def nodes() -> Iterator[dict[str, ServerProcess]]:
    """The test's nodes by name, stopped at its end."""
    started: dict[str, ServerProcess] = {}
    yield started
    for node in started.values():
        node.stop()


async def homes(
    url: str, prefix: str, nodes: dict[str, ServerProcess], count: int = 24
) -> set[str]:
    """The nodes that ``count`` new sessions through the balancer reached."""
    for i in range(count):
        ws, _ = await open_session(url, f"session_id={prefix}-{i}")
        await ws.close()
    await asyncio.sleep(0.2)  # their logs
    return {node_of(f"{prefix}-{i}", nodes) for i in range(count)}


async def leaves_while_replying(
    url: str, nodes: dict[str, ServerProcess], take_out: Callable[[], Awaitable[None]], prefix: str
) -> None:
    """Node a taken out of the balancer (``take_out``) while it runs a 100-token reply: new
    sessions (``prefix``-N) reach only the other nodes, and the reply ends whole through the
    balancer."""
    ws = await connection_to(url, "a", nodes)
    await ws.send('{"prompt": "a long one", "max_tokens": 100}')
    first = await frames_until_token(ws, 5)
    await take_out()
    assert "a" not in await homes(url, prefix, nodes)
    frames = first + await collect(ws, timeout=30)
    assert frames[-1]["type"] == "done" and assert_seq_contiguous(frames) == 100


async def test_haproxy_adds_and_drains_a_node_at_runtime(
    tmp_path: Path, nodes: dict[str, ServerProcess]
) -> None:
    """Nodes join and leave through HAProxy's runtime API, without a reload, while requests
    keep coming: a node put in a spare slot takes new sessions; a node drained takes none,
    while the reply it runs goes on through the balancer to its done; no request fails."""
    nodes |= {"a": ServerProcess("--synthetic-tokens-per-s", "50"), "b": ServerProcess()}
    runtime = tmp_path / "haproxy.sock"
    # Node a in the first server slot only (b in the second and third).
    with haproxy([nodes["a"].port, nodes["b"].port, nodes["b"].port], runtime) as url:
        async with under_load(url):
            nodes["c"] = ServerProcess()
            assert server_state(runtime, "spare1") == "MAINT"
            tell(runtime, f"set server seedance_nodes/spare1 addr 127.0.0.1 port {nodes['c'].port}")
            tell(runtime, "set server seedance_nodes/spare1 state ready")
            await eventually(lambda: server_state(runtime, "spare1") == "UP", 10, "spare1 up")
            assert "c" in await homes(url, "after", nodes)  # the new node takes its share

            # Drain node a: the reply it runs goes on; new sessions go elsewhere. (A session's
            # next connection may land elsewhere under load, hash-balance-factor: the reply's
            # own connection is the one that reached node a.)
            async def drain() -> None:
                tell(runtime, "set server seedance_nodes/node1 state drain")
                assert server_state(runtime, "node1") == "DRAIN"

            await leaves_while_replying(url, nodes, drain, "drained")
            tell(runtime, "set server seedance_nodes/node1 state maint")


async def test_haproxy_finds_nodes_by_dns_as_they_come_and_go(
    tmp_path: Path, nodes: dict[str, ServerProcess]
) -> None:
    """The nodes as a Kubernetes headless Service gives them: one name, an address per node,
    served by a real DNS server (dnsmasq). HAProxy, given the name (SEEDANCE_NODES_DNS), sends
    sessions to every address it has; a node whose address is added takes new sessions, without
    a reload; a node whose address is gone takes none, while the reply it runs goes on to its
    done; no request fails meanwhile."""
    dns = Dns(tmp_path)
    name = "seedance-nodes.seedance.test"
    addresses = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}
    port = free_port()
    at = {n: f"{addresses[n]}:{port}" for n in addresses}
    runtime = tmp_path / "haproxy.sock"

    def start(node: str, *args: str) -> None:
        nodes[node] = ServerProcess("--host", addresses[node], "--port", str(port), *args)

    def serve(*names: str) -> None:
        dns.serve(name, [addresses[n] for n in names])

    try:
        start("a", "--synthetic-tokens-per-s", "50")
        start("b")
        serve("a", "b")
        found = {"SEEDANCE_NODES_DNS": f"{name}:{port}", "SEEDANCE_RESOLVER": dns.address}
        with haproxy([], runtime, found) as url:
            await eventually(lambda: up_at(runtime) == {at["a"], at["b"]}, 15, "a and b found")
            async with under_load(url):
                assert await homes(url, "first", nodes) == {"a", "b"}

                start("c")
                serve("a", "b", "c")
                await eventually(lambda: at["c"] in up_at(runtime), 15, "c found")
                assert "c" in await homes(url, "added", nodes)

                async def unlist() -> None:
                    serve("b", "c")
                    await eventually(lambda: at["a"] not in up_at(runtime), 15, "a gone")

                await leaves_while_replying(url, nodes, unlist, "removed")
    finally:
        dns.stop()
