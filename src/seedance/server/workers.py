"""``seedance serve --workers N``: N worker processes serving one port, and their supervisor.

The ``seedance serve`` process becomes the supervisor. It serves nothing itself:

- **The port.** It binds the address once with ``SO_REUSEPORT`` (a port of 0 is chosen here,
  once), and each worker binds it again and listens: the kernel spreads new connections over
  the workers' listening sockets, each with its own accept queue and event loop.
- **What the workers share.** Any worker serves any session, so sessions, stream logs,
  quotas, locks and revocations live where every worker reaches them: the cluster mode's Redis
  stores (:mod:`seedance.cluster`), which already give several processes the semantics of one.
  With ``--redis`` the workers are nodes of that cluster; without it the supervisor starts a
  private ``redis-server`` on a Unix socket in a temporary folder (no port, nothing saved) and
  stops it last. A second implementation of those stores for workers alone would be a second
  place for each rule (fencing, quotas, resume across processes) to go wrong.
- **The audit log.** One file and one chain in order: each worker appends to it under a lock,
  continuing from the last record whichever worker wrote it
  (:class:`~seedance.observability.audit.AuditLog`, ``shared``).
- **The engine.** An engine that loads a model (``EngineSpec.local_model``: ``llamacpp``)
  runs once, in an engine process the supervisor starts and starts again when it dies
  (:class:`~seedance.engines.core.remote.EngineProcess`); each worker attaches to it. Other
  engines (``synthetic``, gateway mode) run in each worker, as does an embedding model
  (``--embedding-model``: small, each worker's on its share of the cores).
- **HTTP/3** (``--http3``): the first worker alone listens on QUIC, since the datagrams of one
  QUIC connection must reach one process and the kernel spreads UDP datagrams by address,
  which a client that moves changes; every worker advertises it (``Alt-Svc``,
  ``/v2/webtransport``), with the self-signed certificate made here when there is no
  ``--tls-cert``.
- **A worker that dies** (a signal, an out-of-memory kill) loses its own connections, nothing
  else: the supervisor logs how it ended, tells the engine process to drop its requests, and
  starts it again (at once, then with a backoff while it keeps dying). Its clients reconnect
  to another worker, which takes their resumable streams over as a node of a cluster does.
- **Stopping.** SIGTERM or SIGINT to the supervisor is passed to each worker once, as a byte
  on its input (a second one hurries them, a third ends them at once, as for one process;
  signals would coalesce), and as SIGUSR1, which ends a worker that does not serve yet; the
  workers ignore SIGTERM and SIGINT themselves, which a terminal's Ctrl-C or a service manager
  sends every process of the group. The supervisor waits for the workers' drains, then stops
  the engine process and the private Redis. A supervisor killed outright (kill -9) takes the
  workers and the private Redis with it (Linux), as one process's threads go with it.

Each worker is ``python -m seedance.server.worker`` (:mod:`seedance.children`): its settings
pickled on its standard input, with a copy of the engines a program gave the supervisor, if it
gave any (as :func:`~seedance.server.app.create_app` takes them). What the workers share with
each other (the port, the word that they serve, their metrics) is
:mod:`seedance.server.siblings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from seedance import children
from seedance.children import Child, exit_cause
from seedance.config import ConfigError, ServerConfig, WorkerSetup
from seedance.engines.core.remote import ENDED_FILE, EngineProcess
from seedance.engines.local import machine_cores
from seedance.engines.registry import engine_spec
from seedance.eventloop import install_uvloop
from seedance.server.siblings import bind_shared, serving_what

if TYPE_CHECKING:
    from seedance.engines.base import Engine

logger = logging.getLogger("seedance")

#: How long workers may take to start (a model engine's workers wait for its engine process).
START_TIMEOUT_S: Final = 300.0


@dataclass
class _Worker:
    index: int
    proc: Child
    started_at: float
    crashes: int = 0


def worker_count(config: ServerConfig) -> int:
    """``--workers``: the count asked for, or (auto) the cores this process may use."""
    return config.workers or machine_cores()


def check(config: ServerConfig, own_engines: bool = False) -> None:
    """Refuse what several workers cannot do yet, before anything starts (``own_engines``:
    the workers serve engines a program made, not ``config.engine``)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError(f"--workers {worker_count(config)}: this system has no SO_REUSEPORT")
    if config.registry.path is not None:
        raise ConfigError(
            f"--workers {worker_count(config)}: --model-registry (models loaded per worker) is not "
            "supported yet"
        )
    spec = engine_spec(config.engine)
    if spec.local_model and spec.front is None and not own_engines:
        raise ConfigError(
            f"--workers {worker_count(config)}: the {config.engine} engine cannot be shared by "
            "several workers (it cannot run in an engine process of its own)"
        )
    if config.cluster.redis_url is None and _redis_server() is None:
        raise ConfigError(
            f"--workers {worker_count(config)}: the workers share sessions, quotas and stream "
            "logs through Redis: pass --redis URL, or install redis-server (the Debian package "
            "redis-server) for a private one"
        )


class Supervisor:
    """Starts the workers (and what they share), keeps them running, stops them."""

    def __init__(self, config: ServerConfig, engines: Sequence[Engine] | None = None) -> None:
        """``engines``: engines made by a program, not by ``config``: each worker serves a
        copy of them (pickled), and no engine process starts."""
        check(config, engines is not None)
        self.config = config
        self.engines = list(engines) if engines is not None else None
        self.count = worker_count(config)
        self.workers: dict[int, _Worker] = {}
        self.ready: set[int] = set()
        self.serves = ("", "")  # the model and engine the workers serve
        self._dir = tempfile.mkdtemp(prefix="seedance-workers-")
        self._redis: asyncio.subprocess.Process | None = None
        self._engine: EngineProcess | None = None
        self._stopping = False
        self._failed: int | None = None  # how a worker that could not start ended
        self._worker_config: ServerConfig | None = None
        self._signals = 0
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> int:
        install_uvloop()
        try:
            return asyncio.run(self._main())
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _main(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        # Workers start with SIGUSR1 ignored (inherited), until they can take it: a stop while
        # they start is also on their input, which they read once they serve.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            holder = bind_shared(self.config.host, self.config.port)  # the port, chosen once
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", self.config.host, self.config.port, exc)
            return 1
        port = holder.getsockname()[1]
        try:
            config = await self._shared(port)
            for index in range(self.count):
                self._start(config, index)
            if not await self._all_ready():
                await self._workers_gone()
                return 2 if self._failed == 2 else 1  # 2: a worker's settings were refused
            self._announce(port)
            await self._workers_gone()
            logger.info("every worker stopped")
            return 0
        except ConfigError as exc:
            logger.error("%s", exc.message)
            return 2
        finally:
            holder.close()
            await self._stop_shared()

    # ------------------------------------------------------------------ what the workers share

    async def _shared(self, port: int) -> ServerConfig:
        """Start the private Redis and the engine process as needed: the workers' settings."""
        config = self.config.replace(workers=1, port=port)
        if config.embeddings.threads == 0:  # each worker runs its own: a share of the cores
            config = config.replace(embedding_threads=max(1, machine_cores() // self.count))
        if config.cluster.redis_url is None:
            config = config.replace(redis_url=await self._start_redis())
        endpoint = None
        own_engines = self.engines is not None
        if not own_engines and (engine_spec(config.engine).local_model or config.engine_process):
            endpoint = f"ipc://{self._dir}/engine"
            self._engine = engine = EngineProcess(config, endpoint)
            engine.report = Path(self._dir) / ENDED_FILE
            await asyncio.to_thread(engine.start)  # the model loads once, here
            assert self._loop is not None
            engine.keep_alive(self._loop)
            config = config.replace(engine_process=True)  # each worker attaches to it
        local = None
        if config.tls.http3 and config.tls.cert is None:  # one certificate, for every worker
            from seedance.server.runner import require_aioquic

            require_aioquic(config)
            from seedance.server.http3 import LocalCertificate

            local = LocalCertificate.make(config.host)
        private = self._redis is not None
        setup = WorkerSetup(0, self.count, os.getpid(), self._dir, endpoint, local, private)
        return dataclasses.replace(config, worker=setup)

    async def _start_redis(self) -> str:
        path = Path(self._dir) / "redis.sock"
        server = _redis_server()
        assert server is not None
        argv = [server, "--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700"]
        argv += ["--dir", self._dir, "--save", "", "--appendonly", "no", "--loglevel", "warning"]
        argv += ["--logfile", str(Path(self._dir) / "redis.log")]
        # A session of its own: a terminal's Ctrl-C (or timeout(1)) signals the group, and
        # Redis must outlive the workers' drain. (Under systemd: KillMode=mixed.)
        parent = os.getpid()
        self._redis = proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: children.die_with_parent(parent),  # no thread runs yet
        )
        deadline = time.monotonic() + 30
        while not path.exists():
            if proc.returncode is not None or time.monotonic() > deadline:
                if proc.returncode is None:
                    proc.kill()
                log = (Path(self._dir) / "redis.log").read_text(errors="replace")
                raise ConfigError(
                    f"the private redis-server {exit_cause(await proc.wait())}: {log}"
                )
            await asyncio.sleep(0.02)
        logger.info("workers share a private redis-server (pid %d) at %s", proc.pid, path)
        return f"unix://{path}"

    async def _stop_shared(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)
        if self._redis is not None and self._redis.returncode is None:
            self._redis.terminate()
            await self._redis.wait()

    # ------------------------------------------------------------------ the workers

    def _start(self, config: ServerConfig, index: int, crashes: int = 0) -> None:
        assert config.worker is not None and self._loop is not None
        setup = dataclasses.replace(config.worker, index=index)
        config = dataclasses.replace(config, worker=setup)
        proc = children.spawn("seedance.server.worker", (config, self.engines))
        self.workers[index] = _Worker(index, proc, time.monotonic(), crashes)
        self._worker_config = config
        children.watch(proc, self._loop, lambda p: self._ended(index, p))
        logger.info("worker %d started (pid %d)", index, proc.pid)

    async def _workers_gone(self) -> None:
        while not (self._stopping and not self.workers):
            self._changed.clear()
            await self._changed.wait()

    async def _all_ready(self) -> bool:
        """Wait until every worker serves; false (and all stopped) if one ended first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.ready) < self.count:
            if self._stopping:
                return False
            if time.monotonic() > deadline:
                logger.error("the workers did not start within %.0f s", START_TIMEOUT_S)
                self._stop()
                return False
            for worker in self.workers.values():
                serves = serving_what(self._dir, worker.proc.pid)
                if serves is not None:
                    self.ready.add(worker.index)
                    self.serves = serves
            await asyncio.sleep(0.02)
        return True

    def _announce(self, port: int) -> None:
        from seedance.server.runner import announce  # uvicorn's and the app's modules

        host, tls = self.config.host, self.config.tls.cert is not None
        announce(*self.serves, tls, f"[{host}]" if ":" in host else host, port, self.count)

    def _ended(self, index: int, proc: Child) -> None:
        worker = self.workers.get(index)
        if worker is None or worker.proc is not proc:
            return
        del self.workers[index]
        self._changed.set()
        if self._engine is not None:
            self._engine.forget(f"worker-{index}-{proc.pid}")
        if self._stopping:
            logger.info("worker %d (pid %d) %s", index, proc.pid, exit_cause(proc.returncode))
            return
        if len(self.ready) < self.count:  # still starting: what stops one stops them all
            logger.error(
                "worker %d (pid %d) %s while starting (its lines above say why): stopping",
                index,
                proc.pid,
                exit_cause(proc.returncode),
            )
            self._failed = proc.returncode
            self._stop()
            return
        lived_s = time.monotonic() - worker.started_at
        crashes, delay = children.restart_delay(worker.crashes, lived_s)
        logger.error(
            "worker %d (pid %d) %s after %.1f s; its connections are lost (their clients "
            "reconnect to another worker); starting it again in %.1f s",
            index,
            proc.pid,
            exit_cause(proc.returncode),
            lived_s,
            delay,
        )
        assert self._loop is not None
        self._loop.call_later(delay, self._start_again, index, crashes)

    def _start_again(self, index: int, crashes: int) -> None:
        if not self._stopping and index not in self.workers:
            assert self._worker_config is not None
            self._start(self._worker_config, index, crashes)

    def _stop(self) -> None:
        """SIGTERM or SIGINT: each step of a shutdown, passed to every worker."""
        self._stopping = True
        self._signals += 1
        if self._signals == 1:
            logger.info("stopping %d worker(s)", len(self.workers))
        for worker in self.workers.values():
            if worker.proc.stdin is not None:  # what a serving worker reads: one byte a step
                with contextlib.suppress(OSError):
                    worker.proc.stdin.write(b"s")
                    worker.proc.stdin.flush()
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGUSR1)  # what ends one not serving yet
        self._changed.set()


def _redis_server() -> str | None:
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/sbin")
