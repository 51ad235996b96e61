"""``seedance cluster``: a cluster on this machine for people trying it: ``redis-server`` (or,
with ``--sentinels``, a primary, a replica and three ``redis-sentinel`` processes), N nodes and
HAProxy (``deploy/haproxy/haproxy.cfg``), one URL to connect to; Ctrl-C stops them all. Each
program is a child process; when a node, HAProxy or a lone Redis exits, the others are stopped
too (a Redis watched by sentinels fails over instead)."""

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
from typing import Any, Final

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


def redis_command(
    port: int,
    directory: str,
    appendfsync: str | None = None,
    replica_of: int | None = None,
    bind: str = "127.0.0.1",
    primary_host: str = "127.0.0.1",
) -> list[str]:
    """``redis-server`` on ``bind``:``port`` without snapshots; with ``appendfsync``
    (``always``, ``everysec``) an append-only file fsynced so, else no persistence at all;
    ``replica_of``: a replica of the server on that port of ``primary_host``."""
    args = [program("redis-server", "redis-server"), "--port", str(port), "--bind", bind]
    if bind != "127.0.0.1":  # reached from other hosts (a test's namespaces), no password
        args += ["--protected-mode", "no"]
    args += ["--dir", directory, "--save", ""]
    if replica_of is not None:
        args += ["--replicaof", primary_host, str(replica_of)]
    if appendfsync is None:
        return [*args, "--appendonly", "no"]
    return [*args, "--appendonly", "yes", "--appendfsync", appendfsync]


#: The service name the sentinels of ``seedance cluster`` and the tests watch.
SERVICE: Final = "seedance"
#: Sentinels call a primary down after this long without an answer, then fail over.
DOWN_AFTER_MS: Final = 1000


def sentinel_command(
    port: int, directory: Path, primary: int, host: str = "127.0.0.1"
) -> list[str]:
    """``redis-sentinel`` on ``port`` watching the primary on ``host``:``primary`` as
    :data:`SERVICE` (a quorum of two: three sentinels survive one's loss); its configuration
    file (which a sentinel rewrites as it learns) in ``directory``. It listens on the loopback,
    or on every interface (no password) for a ``host`` other than 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "sentinel.conf"
    listen = "bind 127.0.0.1" if host == "127.0.0.1" else "bind 0.0.0.0\nprotected-mode no"
    config.write_text(
        f"port {port}\n{listen}\ndir {directory}\n"
        f"sentinel monitor {SERVICE} {host} {primary} 2\n"
        f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {SERVICE} {DOWN_AFTER_MS * 5}\n"
        f"sentinel parallel-syncs {SERVICE} 1\n"
    )
    return [program("redis-sentinel", "redis-sentinel"), str(config)]


def sentinel_url(ports: Sequence[int], host: str = "127.0.0.1") -> str:
    """The ``--redis`` URL of :data:`SERVICE` behind the sentinels on ``host``:``ports``."""
    return f"sentinel://{','.join(f'{host}:{p}' for p in ports)}/{SERVICE}"


def haproxy_env(listen: int, nodes: Sequence[int], socket: str | None = None) -> dict[str, str]:
    """The environment deploy/haproxy/haproxy.cfg reads: its listening port, its three
    servers taking ``nodes`` in turn (two nodes: the first twice, so that no server is down;
    none: unused ports, for a check of the file), and the path of its runtime API's socket
    (default: the file's own default)."""
    ports = [nodes[i % len(nodes)] for i in range(MAX_NODES)] if nodes else [free_port()] * 3
    env = {f"SEEDANCE_NODE{i}": f"127.0.0.1:{p}" for i, p in enumerate(ports, 1)}
    if socket is not None:
        env["SEEDANCE_HAPROXY_SOCKET"] = socket
    return {**os.environ, "SEEDANCE_LISTEN": f"127.0.0.1:{listen}", **env}


def start_redis(
    data: Path, children: list[subprocess.Popen[bytes]], sentinels: bool
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """``redis-server`` with an append-only file in ``data``; with ``sentinels`` a replica
    and three sentinels too. The ``--redis`` URL, and the processes whose exit ends the
    cluster (none with sentinels: they fail over)."""
    port = free_port()
    redis = [
        subprocess.Popen(redis_command(port, str(data), "everysec"), stdout=subprocess.DEVNULL)
    ]
    children += redis
    wait_until(f"127.0.0.1:{port}", "redis-server", children)
    if not sentinels:
        return f"redis://127.0.0.1:{port}/0", redis
    program("redis-sentinel", "redis-sentinel")
    replica = data / "replica"
    replica.mkdir()
    args = redis_command(free_port(), str(replica), "everysec", replica_of=port)
    children.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
    replicating(port, children)  # else the first writes have no replica to wait for
    ports = [free_port() for _ in range(3)]
    for i, sentinel_port in enumerate(ports):
        args = sentinel_command(sentinel_port, data / f"sentinel{i}", port)
        children.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not acquainted(ports):  # a failover needs the sentinels to know each other
        if time.monotonic() > deadline or any(p.poll() is not None for p in children):
            raise ClusterError("the sentinels did not find each other and the replica")
        time.sleep(0.1)
    return sentinel_url(ports), []


def acquainted(ports: Sequence[int], host: str = "127.0.0.1", password: str | None = None) -> bool:
    """Whether each sentinel on ``host``:``ports`` (asking for ``password``, if any) knows the
    others and a replica of the primary (they find each other through the primary within a few
    seconds; a failover needs it)."""
    import redis

    for port in ports:
        sentinel = redis.Redis(
            host=host, port=port, password=password, socket_timeout=1, decode_responses=True
        )
        try:
            state: Any = sentinel.sentinel_master(SERVICE)
        except redis.RedisError:
            return False
        finally:
            sentinel.close()
        if state["num-other-sentinels"] < len(ports) - 1 or state["num-slaves"] < 1:
            return False
    return True


def replicating(port: int, procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Wait until the primary on ``port`` has a replica in sync (``online``)."""
    import redis

    primary = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise ClusterError("a redis-server exited while starting")
            with contextlib.suppress(redis.RedisError):
                replication = primary.info("replication")
                if replication.get("slave0", {}).get("state") == "online":
                    return
            time.sleep(0.1)
    finally:
        primary.close()
    raise ClusterError(f"the replica did not sync within {START_TIMEOUT_S:.0f} s")


def run(nodes: int, port: int, serve_args: Sequence[str], sentinels: bool = False) -> int:
    """Start Redis (``sentinels``: a primary, a replica and three sentinels), ``nodes``
    nodes and HAProxy; serve until Ctrl-C or a node, HAProxy or a lone Redis exits."""
    if not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"--nodes must be between 1 and {MAX_NODES}")
    if not HAPROXY_CFG.is_file():
        raise ClusterError(f"{HAPROXY_CFG} not found: run seedance cluster from a checkout")
    program("redis-server", "redis-server")
    haproxy = program("haproxy", "haproxy")
    seedance = [str(Path(sys.executable).with_name("seedance"))]
    children: list[subprocess.Popen[bytes]] = []
    stores = 0  # the first children: Redis (and its sentinels)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    with tempfile.TemporaryDirectory(prefix="seedance-cluster-") as data:
        try:
            redis_url, vital = start_redis(Path(data), children, sentinels)
            stores = len(children)
            ports = [free_port() for _ in range(nodes)]
            for i, node_port in enumerate(ports, 1):
                node = [*seedance, "serve", "--port", str(node_port), "--redis", redis_url]
                children.append(subprocess.Popen([*node, "--node-id", f"n{i}", *serve_args]))
            for node_port in ports:
                wait_until(f"http://127.0.0.1:{node_port}/healthz", "a node", children)
            runtime = str(Path(data) / "haproxy.sock")
            env = haproxy_env(port, ports, runtime)
            children.append(subprocess.Popen([haproxy, "-db", "-f", str(HAPROXY_CFG)], env=env))
            wait_until(f"127.0.0.1:{port}", "haproxy", children)
            vital += children[stores:]
            print(
                f"seedance cluster: {nodes} node(s) on Redis at {redis_url} behind HAProxy; "
                f"connect to ws://127.0.0.1:{port}/v2/infer (OpenAI API: "
                f"http://127.0.0.1:{port}/v1; HAProxy's runtime API: {runtime}); Ctrl-C stops "
                "them all",
                flush=True,
            )
            while not stop and all(p.poll() is None for p in vital):
                time.sleep(0.2)
            exited = [p for p in vital if p.poll() is not None]
            if exited and not stop:
                what = Path(str(exited[0].args[0])).name  # type: ignore[index]
                print(f"seedance cluster: {what} exited; stopping them all", file=sys.stderr)
                return 1
            return 0
        finally:
            # HAProxy and the nodes at once (the nodes drain), then Redis.
            for group in (children[stores:], children[:stores]):
                for child in group:
                    if child.poll() is None:
                        child.send_signal(signal.SIGTERM)
                for child in group:
                    try:
                        child.wait(60)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait()
