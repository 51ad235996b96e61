"""A real ``redis-server`` for the cluster tests: started on a free port in the test's own
directory, stopped (or killed, or restarted with its data) by the test; and a primary, a
replica and three ``redis-sentinel`` processes watching them (:class:`Sentinels`); and the
Kubernetes manifests' Redis pods, started by their own scripts (:class:`RedisPods`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from tests.support.waits import wait_for


def online_replicas(replication: dict[str, Any]) -> int:
    """The replicas in sync with a server, from its ``INFO replication``."""
    return sum(
        1
        for key, value in replication.items()
        if key.startswith("slave") and isinstance(value, dict)
        if value.get("state") == "online"
    )


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
        primary_host: str | None = None,
        options: Sequence[str] = (),
    ) -> None:
        """``host``: the address it listens on (and is checked at) other than the loopback's,
        on every interface; ``prefix``: before the command (``ip netns exec NS``);
        ``primary_host``: where the primary of a replica is (default: ``host``); ``options``:
        more of ``redis-server``'s."""
        tool("redis-server", "redis-server")  # skips the test when it is missing
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.aof = aof
        self.replica_of = replica_of
        self.host = host
        self.prefix = list(prefix)
        self.primary_host = primary_host or host
        self.options = list(options)
        self.port = free_port()
        self.url = f"redis://{host}:{self.port}/0"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> RedisServer:
        appendfsync = "always" if self.aof else None
        bind = "127.0.0.1" if self.host == "127.0.0.1" else "0.0.0.0"
        args = redis_command(
            self.port, str(self.directory), appendfsync, self.replica_of, bind, self.primary_host
        )
        self.proc = subprocess.Popen(
            [*self.prefix, *args, *self.options],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
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


class Sentinels:
    """A primary and its replicas watched by three sentinels (quorum 2, a primary called down
    after a second without an answer): the ``--redis`` URL a node is given, and the failover
    a test brings about by killing, freezing or stopping the primary. ``host`` and ``prefix``:
    all of them on that address, run with that prefix (in a test's network namespace), but
    the primary where ``primary_host`` and ``primary_prefix`` say, when given (the replicas
    then announce ``host``, not the address they reach it from)."""

    def __init__(
        self,
        directory: Path,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        *,
        replicas: int = 1,
        primary_host: str | None = None,
        primary_prefix: Sequence[str] | None = None,
    ) -> None:
        tool("redis-sentinel", "redis-sentinel")
        self.directory = directory
        self.host = host
        self.prefix = list(prefix)
        self.replica_count = replicas
        self.primary_host = primary_host or host
        self.primary_prefix = self.prefix if primary_prefix is None else list(primary_prefix)
        self.servers: list[RedisServer] = []
        self.sentinels: list[subprocess.Popen[str]] = []
        self.ports = [free_port() for _ in range(3)]
        self.url = sentinel_url(self.ports, host)

    def start(self) -> Sentinels:
        """Start them all (those started so far are stopped by :meth:`stop` if one fails)."""
        primary = RedisServer(
            self.directory / "primary", host=self.primary_host, prefix=self.primary_prefix
        )
        self.servers.append(primary.start())
        announce = ("--replica-announce-ip", self.host) if self.primary_host != self.host else ()
        for i in range(self.replica_count):
            replica = RedisServer(
                self.directory / f"replica{i}",
                host=self.host,
                prefix=self.prefix,
                replica_of=primary.port,
                primary_host=self.primary_host,
                options=announce,
            )
            self.servers.append(replica.start())
        wait_for(
            lambda: self.replicas(primary) == self.replica_count,
            "the replicas' links to the primary",
        )
        for i, port in enumerate(self.ports):
            directory = self.directory / f"sentinel{i}"
            args = sentinel_command(port, directory, primary.port, self.primary_host)
            self.sentinels.append(
                subprocess.Popen(
                    [*self.prefix, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
                )
            )
        wait_for(lambda: acquainted(self.ports, self.host), "three sentinels that know each other")
        return self

    def _ask(self, port: int) -> redis.Redis:
        return redis.Redis(host=self.host, port=port, socket_timeout=1, decode_responses=True)

    @staticmethod
    def replicas(server: RedisServer) -> int:
        with contextlib.suppress(redis.RedisError):
            info = redis.Redis(server.host, server.port, socket_timeout=1).info("replication")
            return online_replicas(info)
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
                ask = redis.Redis(new.host, new.port, socket_timeout=1)
                role = ask.info("replication")["role"]
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


class RedisPods:
    """The Kubernetes manifests' Redis pods (deploy/k8s/redis.yaml) as processes here: each pod
    a redis-server and a redis-sentinel started by the ConfigMap's scripts with the environment
    the StatefulSet gives them (``password``: the Secret's), but a port each on 127.0.0.1
    instead of an address each."""

    MANIFEST = Path(__file__).parents[2] / "deploy" / "k8s" / "redis.yaml"

    def __init__(self, directory: Path, password: str = "") -> None:
        import yaml

        tool("redis-sentinel", "redis-sentinel")
        documents = yaml.safe_load_all(self.MANIFEST.read_text())
        config_map = next(d for d in documents if d["kind"] == "ConfigMap")
        self.scripts = directory / "scripts"
        self.scripts.mkdir()
        for name, text in config_map["data"].items():
            (self.scripts / name).write_text(text)
        self.directory = directory
        self.password = password
        self.redis_ports = [free_port() for _ in range(3)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[int, list[subprocess.Popen[bytes]]] = {}

    def start(self, i: int) -> None:
        """Pod ``i``'s two containers (again, after :meth:`kill`: its data kept)."""
        data, sentinel = (
            self.directory / f"pod{i}" / "data",
            self.directory / f"pod{i}" / "sentinel",
        )
        data.mkdir(parents=True, exist_ok=True)
        sentinel.mkdir(exist_ok=True)
        env = {
            "PATH": os.environ["PATH"],
            "ME": "127.0.0.1",
            "SERVICE": SERVICE,
            "FIRST": f"127.0.0.1:{self.redis_ports[0]}",
            "SENTINELS": " ".join(f"127.0.0.1:{p}" for p in self.sentinel_ports),
            "REDIS_PORT": str(self.redis_ports[i]),
            "SENTINEL_PORT": str(self.sentinel_ports[i]),
            "REDIS_DIR": str(data),
            "SENTINEL_DIR": str(sentinel),
            "DOWN_AFTER_MS": "1000",
            "REDIS_PASSWORD": self.password,
        }
        log = open(self.directory / f"pod{i}.log", "ab")  # noqa: SIM115  # the children's
        self.procs[i] = [
            subprocess.Popen(["sh", str(self.scripts / script)], env=env, stdout=log, stderr=log)
            for script in ("redis.sh", "sentinel.sh")
        ]
        log.close()

    def kill(self, i: int) -> None:
        for proc in self.procs.pop(i, []):
            proc.kill()
            proc.wait(10)

    def _info(self, i: int) -> dict[str, Any]:
        client = redis.Redis(port=self.redis_ports[i], password=self.password, socket_timeout=1)
        return client.info("replication")

    def role(self, i: int) -> tuple[str, int] | None:
        """Pod ``i``'s server's role and its replicas online (None: it does not answer)."""
        with contextlib.suppress(redis.RedisError):
            info = self._info(i)
            return str(info["role"]), online_replicas(info)
        return None

    def follows(self, i: int) -> int:
        """The port of the primary pod ``i``'s server replicates."""
        return int(self._info(i)["master_port"])

    def primary(self) -> int | None:
        """The pod the live sentinels name as the primary (None: none answers)."""
        for i in self.procs:
            with contextlib.suppress(redis.RedisError):
                ask = redis.Redis(
                    port=self.sentinel_ports[i],
                    password=self.password,
                    socket_timeout=1,
                    decode_responses=True,
                )
                _, port = ask.sentinel_get_master_addr_by_name(SERVICE)
                return self.redis_ports.index(int(port))
        return None

    def stop(self) -> None:
        for i in list(self.procs):
            self.kill(i)
