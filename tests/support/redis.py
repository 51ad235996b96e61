"""A real ``redis-server`` for the cluster tests: started on a free port in the test's own
directory, stopped (or killed, or restarted with its data) by the test."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

from seedance.cluster.local import redis_command
from seedance.netutil import free_port
from tests.support.tools import tool


class RedisServer:
    """``redis-server`` on 127.0.0.1; ``aof``: append-only file with ``appendfsync always``
    (what survives a restart), else no persistence at all."""

    def __init__(self, directory: Path, *, aof: bool = False) -> None:
        tool("redis-server", "redis-server")  # skips the test when it is missing
        self.directory = directory
        self.aof = aof
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> RedisServer:
        args = redis_command(self.port, str(self.directory), "always" if self.aof else None)
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as sock,
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
