"""Seedance behind the load balancers of ``deploy/``: HAProxy run for real in front of two
nodes, and both configurations checked by their own tools (``haproxy -c``, ``nginx -t``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from seedance.cluster.local import haproxy_env
from seedance.netutil import free_port
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
def haproxy(nodes: list[int]) -> Iterator[str]:
    """HAProxy with the deploy configuration in front of ``nodes``; yields its ws:// URL."""
    binary = tool("haproxy", "haproxy")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-db", "-f", str(HAPROXY_CFG)],
        env=haproxy_env(port, nodes),
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
