"""``seedance serve``: run the app under uvicorn with Seedance's transport and shutdown.

Shutdown on SIGTERM or SIGINT, in order:

1. stop accepting connections;
2. refuse new generations (``overloaded``) and let running ones finish, for at most
   ``drain_timeout_s`` (a second signal skips the wait);
3. end what still runs with its final frame: a WebSocket generation's ``done`` says
   ``cancelled`` (then the close 1001), an OpenAI API request gets an ``overloaded`` error (an
   error event and ``[DONE]`` in a stream);
4. stop the engines and seal the audit log.

A third signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette

from seedance import __version__
from seedance.config import ConfigError, ServerConfig
from seedance.server.app import create_app
from seedance.server.handshake import (
    HandshakeLimits,
    descriptor_limit,
    http_protocol,
    raise_descriptor_limit,
    sized_for,
)
from seedance.server.state import ServerState
from seedance.server.tls import ServerTls
from seedance.server.uvicorn_ws import websocket_protocol

if TYPE_CHECKING:
    from seedance.server import http3

logger = logging.getLogger("seedance")


class SeedanceConfig(uvicorn.Config):
    """uvicorn's configuration, serving TLS with a context of ours (:mod:`seedance.server.tls`):
    uvicorn builds its own from file names and settings, and takes a ready context only from
    0.47 (``ssl_context_factory``)."""

    def __init__(self, *args: Any, tls: ssl.SSLContext | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tls = tls

    def load(self) -> None:
        super().load()
        if self.tls is not None:
            self.ssl = self.tls


class SeedanceServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown, and a main loop that starts the
    shutdown as soon as it is asked for (uvicorn's polls every 100 ms). With ``tls``, it
    serves ``wss://`` and ``https://`` and watches the certificates while it runs."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        tls: ServerTls | None,
        app: Starlette,
    ) -> None:
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)
        self.state = state
        self.tls = tls
        self.app = app  # what the HTTP/3 listener serves (uvicorn's wraps it)
        self.http3: http3.Http3Listener | None = None
        self.http3_certificate: http3.LocalCertificate | None = None  # made without --tls-cert
        self._metrics_server: asyncio.Server | None = None  # a worker's, for the others

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set by a signal, or by a thread that embeds the server: wakes the main loop."""
        self._should_exit = value
        loop, wake = self._loop, self._wake
        if value and loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):  # the date header, max requests, the exit
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # uvicorn says it started at the end of its own startup; ours goes on (the HTTP/3
        # listener on the port it bound), and says so when it is done.
        started, self.started = self.started, False
        # Everything loaded so far (modules, the engine) lives as long as the process: keep it
        # out of the collector's scans, so a full collection costs in proportion to traffic.
        gc.freeze()
        worker = self.state.config.worker
        if started:
            if worker is not None:  # the supervisor says where to connect
                from seedance.server.siblings import share_metrics

                self._metrics_server = await share_metrics(worker, self.state.metrics.render)
                logger.info("worker %d serving (pid %d)", worker.index, os.getpid())
            else:
                self._announce()
            if self.tls is not None:
                logger.info("TLS: %s", self.tls.describe())
                self.tls.start()
            if self.state.config.tls.http3:
                await self._start_http3()
            access = self.state.access
            (logger.warning if access.open else logger.info)("access: %s", access.describe())
            if worker is not None:
                from seedance.server.siblings import serving

                default = self.state.models[self.state.models.default]
                serving(worker, default.name, default.engine.info.engine)
        self.started = started

    def _announce(self) -> None:
        default = self.state.models[self.state.models.default]
        for host, port in self.bound_addresses():
            announce(default.name, default.engine.info.engine, self.tls is not None, host, port)

    async def _start_http3(self) -> None:
        """The QUIC listener on the TCP listener's port number, with its certificate (or a
        short-lived one of its own), reloaded with it; and the headers and the answer of
        ``/v2/webtransport`` that say where it is.

        Of several workers only the first listens (the packets of one QUIC connection must
        reach one process, and the kernel spreads UDP datagrams by address, which a client
        that moves changes); every worker says where it is, with the certificate the
        supervisor made for them all."""
        from seedance.server import http3  # aioquic: only where it is asked for

        config, app = self.state.config, self.app
        worker = config.worker
        limit = config.max_frame_bytes
        port = self.bound_addresses()[0][1]
        if worker is not None:
            self.http3_certificate = worker.http3_certificate
        elif self.tls is None:
            self.http3_certificate = http3.LocalCertificate.make(config.host)
        local = self.http3_certificate
        listens = worker is None or worker.index == 0  # of several workers, the first
        if local is not None and listens:
            logger.info(
                "HTTP/3: a self-signed ECDSA certificate valid 13 days, SHA-256 %s (for "
                "WebTransport's serverCertificateHashes)",
                local.sha256,
            )
        if listens:
            if self.tls is not None:
                files = self.tls.files
                self.http3 = listener = http3.Http3Listener(app, files.cert, files.key, limit)
                self.tls.on_reload.append(lambda files: listener.load(files.cert, files.key))
            else:
                assert local is not None
                self.http3 = http3.Http3Listener(app, local.cert, local.key, limit)
            try:
                await self.http3.start(config.host, port)
            except OSError as exc:  # as uvicorn does when its own port is taken
                logger.error("HTTP/3: cannot listen on UDP port %d: %s", port, exc.strerror or exc)
                raise SystemExit(1) from None
            logger.info("HTTP/3 and WebTransport on UDP port %d", port)
        name, value = http3.alt_svc(port)
        advertised = [(name.encode(), value.encode())]
        self.config.encoded_headers += advertised  # HTTP/1.1 answers name the listener
        self.server_state.default_headers += advertised
        self.state.webtransport = {
            "offered": True,
            "path": "/v2/infer",
            "port": port,
            "certificate_sha256": None if local is None else local.sha256,
        }

    def bound_addresses(self) -> list[tuple[str, int]]:
        addresses = []
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                addresses.append((f"[{host}]" if ":" in host else host, port))
        return addresses

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, or in a worker of ``--workers N``: SIGTERM and SIGINT ignored (a
        terminal or a service manager sends them to every process of the group: the
        supervisor passes them on, once, on the worker's input: seedance.server.worker)."""
        main = threading.current_thread() is threading.main_thread()
        if self.state.config.worker is None or not main:
            with super().capture_signals():
                yield
            return
        handlers: dict[signal.Signals, Any] = {
            signal.SIGUSR1: signal.SIG_IGN,
            signal.SIGTERM: signal.SIG_IGN,
            signal.SIGINT: signal.SIG_IGN,
        }
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM or SIGINT. The first starts the shutdown; a second (either signal) skips the
        wait for running generations, which still end with their final frames; a third exits
        at once (uvicorn's forced exit: no final frames, the engines not stopped)."""
        again = self.should_exit
        super().handle_exit(sig, frame)
        if again:
            shutdown = self.state.shutdown
            self.force_exit = shutdown.hurry
            shutdown.hurry = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.state
        for server in self.servers:
            server.close()  # 1. stop accepting
        if self.http3 is not None:
            self.http3.stop_accepting()
        logger.info("shutting down: %d connection(s) open", len(state.peers))
        drain = asyncio.create_task(state.drain(state.config.drain_timeout_s))
        while not drain.done():
            if self.force_exit:  # a third signal: leave now
                drain.cancel()
                break
            await asyncio.wait({drain}, timeout=0.1)
        await asyncio.gather(drain, return_exceptions=True)
        await self._close_connections(sockets)
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self.tls is not None:
            await self.tls.close()
        if self.http3 is not None:
            self.http3.close()
        logger.info("stopped")

    async def _close_connections(self, sockets: list[socket.socket] | None) -> None:
        """uvicorn's own shutdown (uvicorn.Server.shutdown), without its fixed 100 ms pause
        when the drain left no connection open: stop listening, ask each connection to close,
        wait for them and their tasks (at most ``timeout_graceful_shutdown``), then the app's
        lifespan shutdown (the engines stop, the audit log is sealed)."""
        for sock in sockets or []:
            sock.close()
        connections = list(self.server_state.connections)
        for connection in connections:
            connection.shutdown()
        if connections:
            await asyncio.sleep(0.1)
        try:
            await asyncio.wait_for(
                self._wait_tasks_to_complete(), timeout=self.config.timeout_graceful_shutdown
            )
        except asyncio.TimeoutError:
            tasks = self.server_state.tasks
            logger.error("cancelling %d task(s): graceful shutdown timed out", len(tasks))
            for task in tasks:
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()


def announce(model: str, engine: str, tls: bool, host: str, port: int, workers: int = 1) -> None:
    """The line that says where to connect (``connect to ws://HOST:PORT/v2/infer``: people
    and scripts read it), for one process or the supervisor of ``workers``."""
    ws, http = ("wss", "https") if tls else ("ws", "http")
    how = f" with {workers} workers" if workers > 1 else ""
    logger.info(
        "Seedance %s serving model %s (engine %s)%s: connect to %s://%s:%d/v2/infer "
        "(health: %s://%s:%d/healthz)",
        __version__,
        model,
        engine,
        how,
        ws,
        host,
        port,
        http,
        host,
        port,
    )


def require_aioquic(config: ServerConfig) -> None:
    """:class:`ConfigError` when ``--http3`` is asked for and aioquic is not installed."""
    if config.tls.http3 and importlib.util.find_spec("aioquic") is None:
        raise ConfigError(
            "--http3 needs aioquic, which needs Python 3.11 or later (pip install aioquic)"
        )


def build_server(config: ServerConfig, app: Starlette | None = None) -> SeedanceServer:
    """The server for ``config``, serving ``app`` (default: ``create_app(config)``);
    :class:`ConfigError` when its TLS files do not load."""
    require_aioquic(config)
    tls = ServerTls.of(config.tls)
    app = app or create_app(config)
    state: ServerState = app.state.seedance
    if tls is not None:
        state.metrics.add_collector(tls.collect)
    uv_config = SeedanceConfig(
        app,
        tls=tls.context if tls is not None else None,
        host=config.host,
        port=config.port,
        http=http_protocol(
            sized_for(
                HandshakeLimits(
                    timeout_s=config.handshake.timeout_s,
                    max_total=config.handshake.max_total,
                    max_per_address=config.handshake.max_per_address,
                    max_header_bytes=config.handshake.max_header_bytes,
                    trusted_proxies=config.trusted_proxies,
                ),
                descriptor_limit(),  # the caps leave descriptors for established connections
            )
        ),
        # The client's address from X-Forwarded-For, when the connection comes from one of
        # these (uvicorn's ProxyHeadersMiddleware); none: the header is ignored.
        proxy_headers=True,
        forwarded_allow_ips=list(config.trusted_proxies),
        h11_max_incomplete_event_size=config.handshake.max_header_bytes,
        ws=websocket_protocol(config.max_pending_bytes),
        ws_max_size=config.max_frame_bytes,
        ws_ping_interval=None,  # the protocol's own heartbeat replaces it
        ws_ping_timeout=None,
        ws_per_message_deflate=False,
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    return SeedanceServer(uv_config, state, tls, app)


def raise_descriptors() -> None:
    """A serving process's first step: its soft descriptor limit up to its hard one (logged),
    so that the caps sized from it (:func:`~seedance.server.handshake.sized_for`) are wide."""
    raised = raise_descriptor_limit()
    if raised is not None:
        logger.info("file descriptors: soft limit raised from %d to %d", *raised)


def serve(config: ServerConfig) -> None:
    """Serve until a signal stops the server (the descriptor limit raised first)."""
    raise_descriptors()
    build_server(config).run()
