"""``seedance cluster``: a cluster on this machine for people trying it: ``redis-server``, N
nodes and HAProxy (``deploy/haproxy/haproxy.cfg``), one URL to connect to; Ctrl-C stops them
all. Each program is a child process; when one of them exits, the others are stopped too."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from seedance.netutil import free_port

#: HAProxy's configuration names three servers.
MAX_NODES: Final = 3
HAPROXY_CFG: Final = Path(__file__).resolve().parents[3] / "deploy" / "haproxy" / "haproxy.cfg"
START_TIMEOUT_S: Final = 120.0


class ClusterError(Exception):
    pass


def program(name: str, package: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise ClusterError(f"{name} is not installed (the Debian package {package})")
    return path


def wait_until(check: str, what: str, procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Wait until ``check`` (a URL, or host:port for a bare TCP port) answers."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise ClusterError(f"{what} exited while starting")
        with contextlib.suppress(OSError):
            if check.startswith("http"):
                with urllib.request.urlopen(check, timeout=1) as reply:
                    if reply.status == 200:
                        return
            else:
                host, port = check.rsplit(":", 1)
                socket.create_connection((host, int(port)), 0.5).close()
                return
        time.sleep(0.1)
    raise ClusterError(f"{what} did not start within {START_TIMEOUT_S:.0f} s")


def redis_command(port: int, directory: str, appendfsync: str | None = None) -> list[str]:
    """``redis-server`` on 127.0.0.1:``port`` without snapshots; with ``appendfsync``
    (``always``, ``everysec``) an append-only file fsynced so, else no persistence at all."""
    args = [program("redis-server", "redis-server"), "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--dir", directory, "--save", ""]
    if appendfsync is None:
        return [*args, "--appendonly", "no"]
    return [*args, "--appendonly", "yes", "--appendfsync", appendfsync]


def haproxy_env(listen: int, nodes: Sequence[int]) -> dict[str, str]:
    """The environment deploy/haproxy/haproxy.cfg reads: its listening port, and its three
    servers taking ``nodes`` in turn (two nodes: the second twice, so that no server is down;
    none: unused ports, for a check of the file)."""
    ports = [nodes[i % len(nodes)] for i in range(MAX_NODES)] if nodes else [free_port()] * 3
    env = {f"SEEDANCE_NODE{i}": f"127.0.0.1:{p}" for i, p in enumerate(ports, 1)}
    return {**os.environ, "SEEDANCE_LISTEN": f"127.0.0.1:{listen}", **env}


def run(nodes: int, port: int, serve_args: Sequence[str]) -> int:
    """Start Redis, ``nodes`` nodes and HAProxy; serve until Ctrl-C or a child exits."""
    if not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"--nodes must be between 1 and {MAX_NODES}")
    if not HAPROXY_CFG.is_file():
        raise ClusterError(f"{HAPROXY_CFG} not found: run seedance cluster from a checkout")
    program("redis-server", "redis-server")
    haproxy = program("haproxy", "haproxy")
    seedance = [str(Path(sys.executable).with_name("seedance"))]
    children: list[subprocess.Popen[bytes]] = []
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    with tempfile.TemporaryDirectory(prefix="seedance-cluster-") as data:
        try:
            redis_port = free_port()
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            redis = redis_command(redis_port, data, "everysec")
            children.append(subprocess.Popen(redis, stdout=subprocess.DEVNULL))
            wait_until(f"127.0.0.1:{redis_port}", "redis-server", children)
            ports = [free_port() for _ in range(nodes)]
            for i, node_port in enumerate(ports, 1):
                node = [*seedance, "serve", "--port", str(node_port), "--redis", redis_url]
                children.append(subprocess.Popen([*node, "--node-id", f"n{i}", *serve_args]))
            for node_port in ports:
                wait_until(f"http://127.0.0.1:{node_port}/healthz", "a node", children)
            env = haproxy_env(port, ports)
            children.append(subprocess.Popen([haproxy, "-db", "-f", str(HAPROXY_CFG)], env=env))
            wait_until(f"127.0.0.1:{port}", "haproxy", children)
            print(
                f"seedance cluster: {nodes} node(s) on Redis at {redis_url} behind HAProxy; "
                f"connect to ws://127.0.0.1:{port}/v2/infer (OpenAI API: "
                f"http://127.0.0.1:{port}/v1); Ctrl-C stops them all",
                flush=True,
            )
            while not stop and all(p.poll() is None for p in children):
                time.sleep(0.2)
            exited = [p for p in children if p.poll() is not None]
            if exited and not stop:
                what = Path(str(exited[0].args[0])).name  # type: ignore[index]
                print(f"seedance cluster: {what} exited; stopping them all", file=sys.stderr)
                return 1
            return 0
        finally:
            # HAProxy and the nodes at once (the nodes drain), then Redis.
            for group in (children[1:], children[:1]):
                for child in group:
                    if child.poll() is None:
                        child.send_signal(signal.SIGTERM)
                for child in group:
                    try:
                        child.wait(60)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait()
