"""Real servers on real sockets for the tests: in a thread of the test process
(:class:`RunningServer`, any ASGI app with :func:`asgi_server`), or ``seedance serve`` as a
subprocess (:class:`ServerProcess`, :func:`serve_fails`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from seedance.config import OPTIONS, PLAIN_FIELDS, ServerConfig
from seedance.engines.base import Engine
from seedance.engines.local import machine_cores
from seedance.engines.registry import engine_spec
from seedance.engines.synthetic import SyntheticEngine
from seedance.observability.tracing import Tracing
from seedance.server.app import create_app
from seedance.server.handshake import HandshakeLimits
from seedance.server.runner import SeedanceServer, build_server
from seedance.server.state import ServerState
from tests.support.waits import eventually

SEEDANCE = str(Path(sys.executable).with_name("seedance"))

#: The CPU threads a model engine started by a test may use: this test process's share of the
#: cores. ``make test`` runs the suite in several processes at once, and llama.cpp's threads
#: spin at every barrier of a step: two servers each on every core make each other wait for a
#: descheduled thread hundreds of times a token (in CI, a 16-token test with its llama.cpp
#: server's start was not done in 120 s).
#: conftest.py passes it to ``seedance serve`` subprocesses as ``SEEDANCE_THREADS``.
THREADS = max(1, machine_cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def server_config(**fields: Any) -> ServerConfig:
    """A :class:`ServerConfig` from server fields and the engine's own options together:
    ``server_config(engine="llamacpp", port=0, parallel=2)``; a model engine's threads are
    :data:`THREADS` unless given."""
    server = {opt.field for opt in OPTIONS} | set(PLAIN_FIELDS)
    options = {k: v for k, v in fields.items() if k not in server}
    settings = {k: v for k, v in fields.items() if k in server}
    spec = engine_spec(settings.get("engine", ServerConfig.engine))
    if any(opt.field == "threads" for opt in spec.declared):
        options.setdefault("threads", THREADS)
    return ServerConfig.of(**settings, engine_options=spec.options(**options))


class RunningServer:
    """A server on 127.0.0.1 with an ephemeral port, served from a background thread.

    Under ``SEEDANCE_TEST_WORKERS=N`` (``make test-workers``) the same settings and engines are
    served by ``--workers N`` instead, from a supervisor in a subprocess
    (:mod:`tests.support.supervise`): every test sees the same sockets and URLs. What only one
    process has (its state, its engine object, its connections) is then not here: a test that
    reads it is marked :func:`one_process_only`."""

    def __init__(
        self,
        config: ServerConfig,
        engines: Sequence[Engine] | None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = dataclasses.replace(config, host="127.0.0.1", port=0)
        self._process: ServerProcess | None = None
        if TEST_WORKERS:
            assert tracing is None, "tracing is one process's: mark the test one_process_only"
            self._setup = (dataclasses.replace(self.config, workers=int(TEST_WORKERS)), engines)
            return
        self.app = create_app(self.config, engines=engines, tracing=tracing)
        self._state: ServerState = self.app.state.seedance
        self.server: SeedanceServer = build_server(self.config, self.app)
        self._thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)

    @property
    def state(self) -> ServerState:
        if self._process is not None:
            raise AttributeError("the workers' state is theirs: mark the test one_process_only")
        return self._state

    @property
    def engine(self) -> Any:
        return self.state.models[self.state.models.default].engine

    @property
    def connections(self) -> list[Any]:
        """The open ``/v2/infer`` connections, as the server holds them.

        The server's thread adds and drops peers while a test reads them: iterating the
        registry copies it in one step (``Peers.__iter__``), where ``of_kind`` would walk the
        live dict and fail if it changed size meanwhile."""
        return [peer for peer in self.state.peers if peer.kind == "infer"]

    @property
    def handshakes(self) -> HandshakeLimits:
        """The connections still sending their request headers, as the server counts them."""
        limits: HandshakeLimits = self.server.config.http.limits  # type: ignore[union-attr]
        return limits

    def start(self) -> RunningServer:
        if TEST_WORKERS:
            self._process = ServerProcess(setup=self._setup)
            self.port = self._process.port
        else:
            self._start_thread()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.infer_url = f"{self.url}/v2/infer"
        self.http_url = f"http://127.0.0.1:{self.port}"
        return self

    def _start_thread(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        _, self.port = self.server.bound_addresses()[0]

    def stop(self) -> None:
        if self._process is not None:  # as the thread's join: a drain past 30 s is cut
            self._process.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=30)
            self._process.stop()
            return
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def lock_send_buffers(self, size: int = 4096) -> None:
        """Fix the kernel's send buffer of the server's side of each open connection at
        ``size``, for tests of a client that never reads.

        Left to itself, Linux grows a socket's send buffer up to ``tcp_wmem``'s maximum (4 MiB
        or more, by machine): a flood of 4-byte pongs then takes a million messages, seconds
        or minutes, before the server's own queue fills. Such a test checks the bound the
        server keeps itself, not how much the kernel takes first."""
        assert self.connections, "no connection yet"
        for connection in self.connections:
            writer = connection.ws.writer
            assert writer is not None, "the server offers no direct writer"
            sock = writer.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


@contextlib.contextmanager
def asgi_server(app: Any) -> Iterator[str]:
    """Serve any ASGI app on 127.0.0.1 from a thread; yields ``http://127.0.0.1:PORT``."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the ASGI server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        server.force_exit = True  # a request a test left hanging does not hold the exit
        thread.join(10)


def slow_engine(tokens_per_s: float = 50.0, ttft_ms: float = 0.0, **kwargs: Any) -> SyntheticEngine:
    return SyntheticEngine(tokens_per_s=tokens_per_s, ttft_ms=ttft_ms, **kwargs)


#: ``SEEDANCE_TEST_WORKERS=2``: every ``seedance serve`` a test starts runs that many workers
#: (``make test-workers``: the subprocess tests against ``--workers 2``).
TEST_WORKERS = os.environ.get("SEEDANCE_TEST_WORKERS", "")


def one_process_only(why: str) -> pytest.MarkDecorator:
    """Skip a test under ``SEEDANCE_TEST_WORKERS``: what it starts is refused with workers."""
    return pytest.mark.skipif(bool(TEST_WORKERS), reason=f"--workers: {why}")


class ServerProcess:
    """``seedance serve`` in a subprocess (for signals and the CLI)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
        prefix: Sequence[str] = (),
        setup: Any = None,
    ) -> None:
        """``preexec`` runs in the child before it starts (a lower resource limit, say);
        ``prefix`` comes before the command (``ip netns exec NS``). ``setup``: not the
        command line but :mod:`tests.support.supervise` with these (settings, engines)."""
        if TEST_WORKERS and "--workers" not in args:
            args = ("--workers", TEST_WORKERS, *args)

        # A group of its own: SIGSTOP and SIGCONT reach all of a node's processes (a frozen
        # machine), its workers and engine process included.
        def in_a_group() -> None:
            os.setpgrp()
            if preexec is not None:
                preexec()

        command = [SEEDANCE, "serve", "--port", "0", *args]
        if setup is not None:
            command = [sys.executable, "-m", "tests.support.supervise"]
        self.proc = subprocess.Popen(
            [*prefix, *command],
            stdin=subprocess.PIPE if setup is not None else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # The synthetic engine unless a test names another (the default loads a model).
            env={**os.environ, "SEEDANCE_ENGINE": "synthetic", **(env or {})},
            preexec_fn=in_a_group,
        )
        if setup is not None:  # as seedance.children hands it over; the input stays open
            assert self.proc.stdin is not None
            data = pickle.dumps(setup)
            self.proc.stdin.buffer.write(len(data).to_bytes(8, "big") + data)
            self.proc.stdin.flush()
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # A model engine's engine process loads the model before the workers start.
        deadline = time.monotonic() + (20 if setup is None else 120)
        while True:
            match = next(
                (
                    re.search(r"(wss?)://([\w.]+):(\d+)/v2/infer", line)
                    for line in self.lines
                    if "connect to" in line
                ),
                None,
            )
            if match:
                scheme, host, self.port = match.group(1), match.group(2), int(match.group(3))
                break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("server did not start:\n" + "".join(self.lines))
            time.sleep(0.02)
        self.host = "127.0.0.1" if host == "0.0.0.0" else host
        self.url = f"{scheme}://{self.host}:{self.port}"  # wss:// when served with TLS

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if sig in (signal.SIGSTOP, signal.SIGCONT):  # the whole node freezes, or wakes
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    async def logged(self, text: str, timeout_s: float = 10) -> None:
        """Return once the server's output has a line with ``text``."""
        await eventually(lambda: text in self.output, timeout_s, f"{text!r} in the log")

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(timeout=5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve_fails(*args: str, timeout_s: float = 60) -> str:
    """``seedance serve ARGS`` must stop at once with exit code 2 and no traceback; its
    stderr."""
    result = subprocess.run(
        [SEEDANCE, "serve", *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr
