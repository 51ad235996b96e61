"""``seedance serve``: run the app under uvicorn with Seedance's transport and shutdown.

Shutdown on SIGTERM or SIGINT, in order:

1. stop accepting connections;
2. refuse new generations (``overloaded``) and let running ones finish, for at most
   ``drain_timeout_s`` (a second signal skips the wait);
3. cancel what still runs (its ``done`` frame says ``cancelled``) and close every connection
   with 1001;
4. stop the engines.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import uvicorn
from starlette.applications import Starlette

from seedance import __version__
from seedance.config import ServerConfig
from seedance.server.app import create_app
from seedance.server.handshake import HandshakeLimits, http_protocol
from seedance.server.state import ServerState
from seedance.server.transport import websocket_protocol

logger = logging.getLogger("seedance")


class SeedanceServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Everything loaded so far (modules, the engine) lives as long as the process: keep it
        # out of the collector's scans, so a full collection costs in proportion to traffic.
        gc.freeze()
        if self.started:
            for host, port in self.bound_addresses():
                logger.info(
                    "Seedance %s serving model %s (engine %s): connect to ws://%s:%d/v2/infer "
                    "(health: http://%s:%d/healthz)",
                    __version__,
                    self.state.default_model,
                    self.state.models[self.state.default_model].engine.info.engine,
                    host,
                    port,
                    host,
                    port,
                )
            access = self.state.access
            (logger.warning if access.open else logger.info)("access: %s", access.describe())

    def bound_addresses(self) -> list[tuple[str, int]]:
        addresses = []
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                addresses.append((f"[{host}]" if ":" in host else host, port))
        return addresses

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: %d connection(s) open", len(self.state.connections))
        for server in self.servers:
            server.close()  # 1. stop accepting
        drain = asyncio.create_task(self.state.drain(self.state.config.drain_timeout_s))
        while not drain.done():
            if self.force_exit:  # a second signal: do not wait for generations
                drain.cancel()
                break
            await asyncio.wait({drain}, timeout=0.1)
        await asyncio.gather(drain, return_exceptions=True)
        await super().shutdown(sockets)
        logger.info("stopped")


def build_server(config: ServerConfig, app: Starlette | None = None) -> SeedanceServer:
    """The server for ``config``, serving ``app`` (default: ``create_app(config)``)."""
    app = app or create_app(config)
    state: ServerState = app.state.seedance
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=http_protocol(
            HandshakeLimits(
                timeout_s=config.handshake_timeout_s,
                max_total=config.max_handshakes,
                max_per_address=config.max_handshakes_per_address,
                max_header_bytes=config.max_header_bytes,
            )
        ),
        h11_max_incomplete_event_size=config.max_header_bytes,
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
    return SeedanceServer(uv_config, state)


def serve(config: ServerConfig) -> None:
    """Serve until a signal stops the server."""
    build_server(config).run()
