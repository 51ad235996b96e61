"""A real ``redis-server`` for the cluster tests: started on a free port in the test's own
directory, stopped (or killed, or restarted with its data) by the test; and a primary, a
replica and three ``redis-sentinel`` processes watching them (:class:`Sentinels`)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from seedance.cluster.local import (
    SERVICE,
    acquainted,
    redis_command,
    sentinel_command,
    sentinel_url,
)
from seedance.netutil import free_port
from tests.support.tools import tool


class RedisServer:
    """``redis-server`` on 127.0.0.1; ``aof``: append-only file with ``appendfsync always``
    (what survives a restart), else no persistence at all."""

    def __init__(
        self,
        directory: Path,
        *,
        aof: bool = False,
        replica_of: int | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> None:
        """``host``: the address it listens on (and is checked at) other than the loopback's,
        on every interface; ``prefix``: before the command (``ip netns exec NS``)."""
        tool("redis-server", "redis-server")  # skips the test when it is missing
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.aof = aof
        self.replica_of = replica_of
        self.host = host
        self.prefix = list(prefix)
        self.port = free_port()
        self.url = f"redis://{host}:{self.port}/0"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> RedisServer:
        appendfsync = "always" if self.aof else None
        bind = "127.0.0.1" if self.host == "127.0.0.1" else "0.0.0.0"
        args = redis_command(self.port, str(self.directory), appendfsync, self.replica_of, bind)
        self.proc = subprocess.Popen(
            [*self.prefix, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), 0.2) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.proc.communicate()[0] if self.proc.poll() is not None else ""
                raise RuntimeError(f"redis-server did not start: {output}")
            time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(10)

    def restart(self) -> None:
        """Stop (as Redis shuts down on SIGTERM) and start again on the same port."""
        self.stop()
        self.start()


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.05)


class Sentinels:
    """A primary and a replica watched by three sentinels (quorum 2, a primary called down
    after a second without an answer): the ``--redis`` URL a node is given, and the failover
    a test brings about by killing, freezing or stopping the primary."""

    def __init__(self, directory: Path) -> None:
        tool("redis-sentinel", "redis-sentinel")
        self.directory = directory
        self.servers: list[RedisServer] = []
        self.sentinels: list[subprocess.Popen[str]] = []
        self.ports = [free_port() for _ in range(3)]
        self.url = sentinel_url(self.ports)

    def start(self) -> Sentinels:
        primary = RedisServer(self.directory / "primary").start()
        self.servers = [primary, RedisServer(self.directory / "replica", replica_of=primary.port)]
        self.servers[1].start()
        wait_for(lambda: self.replicas(primary) == 1, "the replica's link to the primary")
        for i, port in enumerate(self.ports):
            args = sentinel_command(port, self.directory / f"sentinel{i}", primary.port)
            self.sentinels.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            )
        wait_for(lambda: acquainted(self.ports), "three sentinels that know each other")
        return self

    @staticmethod
    def _ask(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, decode_responses=True)

    @staticmethod
    def replicas(server: RedisServer) -> int:
        with contextlib.suppress(redis.RedisError):
            info = redis.Redis(port=server.port, socket_timeout=1).info("replication")
            return sum(
                1
                for key, value in info.items()
                if key.startswith("slave") and isinstance(value, dict)
                if value.get("state") == "online"
            )
        return 0

    def primary(self) -> RedisServer:
        """The server the sentinels name as the primary now."""
        for port in self.ports:
            with contextlib.suppress(redis.RedisError):
                _, primary_port = self._ask(port).sentinel_get_master_addr_by_name(SERVICE)
                return next(s for s in self.servers if s.port == int(primary_port))
        raise RuntimeError("no sentinel answers")

    def wait_failover(self, old: RedisServer, timeout_s: float = 30) -> RedisServer:
        """The new primary, once the sentinels promoted it (and it says so itself)."""

        def promoted() -> bool:
            with contextlib.suppress(RuntimeError, redis.RedisError):
                new = self.primary()
                role = redis.Redis(port=new.port, socket_timeout=1).info("replication")["role"]
                return new is not old and role == "master"
            return False

        wait_for(promoted, "the sentinels' failover", timeout_s)
        return self.primary()

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.kill()
            proc.wait(10)
        for server in self.servers:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)  # a frozen one too
            server.stop(kill=True)
