"""The engine process: builds the configured engine and runs what the server sends it.

Started by :class:`~seedance.engines.core.remote.EngineProcess` as ``python -m
seedance.engines.core``, a child of the server (:mod:`seedance.children`: when the server ends
or dies, so does the engine process), with the server's configuration and the endpoint to
bind. Its log lines, and whatever a crash of native code writes (the Python stacks
``faulthandler`` dumps on a fatal signal, llama.cpp's abort message), go to the server's
standard error.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import AsyncGenerator

import zmq
import zmq.asyncio

from seedance.children import parent_gone, read_setup
from seedance.config import ConfigError, ServerConfig
from seedance.engines.base import Engine, TokenDelta
from seedance.engines.core import wire
from seedance.eventloop import install_uvloop, timeout
from seedance.protocol.errors import SeedanceError

logger = logging.getLogger("seedance.engine_process")

#: How long a process whose engine could not be built waits for the server to ask why.
_FAILED_LINGER_S = 10.0


class EngineCore:
    """Runs requests on ``engine`` for the servers connected to ``socket`` (a ``ROUTER``)."""

    def __init__(self, engine: Engine, socket: zmq.asyncio.Socket) -> None:
        self.engine = engine
        self.socket = socket
        self.epoch = os.getpid()
        self._runs: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        self._peers: set[bytes] = set()
        #: Deltas produced in this round of the event loop, by server: sent in one message each.
        self._outbox: dict[bytes, list[wire.Delta]] = {}
        self._loop = asyncio.get_running_loop()

    async def serve(self) -> None:
        """Answer the servers' messages until cancelled."""
        stats = asyncio.create_task(self._send_stats_forever())
        try:
            while True:
                peer, payload = await self.socket.recv_multipart()
                try:
                    message = wire.decode_to_engine(payload)
                except Exception as exc:  # a server of another version: say so, go on
                    logger.error("unreadable message from a server: %s", exc)
                    continue
                if isinstance(message, wire.Forget):
                    self._forget(message.peer)
                elif isinstance(message, wire.Hello):
                    self._peers.add(peer)
                    ready = wire.Ready(self.epoch, self.engine.info, self.engine.max_concurrency)
                    self._send(peer, ready)
                elif message.epoch != self.epoch:
                    continue  # meant for the process this one replaced
                elif isinstance(message, wire.Submit):
                    key = (peer, message.no)
                    self._runs[key] = asyncio.create_task(self._run(key, message))
                else:
                    run = self._runs.get((peer, message.no))
                    if run is not None:
                        run.cancel()
        finally:
            stats.cancel()
            for run in list(self._runs.values()):
                run.cancel()
            await asyncio.gather(*self._runs.values(), return_exceptions=True)

    def _forget(self, peer: bytes) -> None:
        self._peers.discard(peer)
        gone = [run for (owner, _), run in self._runs.items() if owner == peer]
        for run in gone:
            run.cancel()
        if gone:
            logger.info("%s is gone: %d request(s) of it stopped", peer.decode(), len(gone))

    async def _run(self, key: tuple[bytes, int], submit: wire.Submit) -> None:
        peer, no = key
        stream: AsyncGenerator[TokenDelta, None] = self.engine.generate(submit.request)
        try:
            async for delta in stream:
                self._emit(
                    peer,
                    wire.Delta(
                        no, delta.text, delta.tokens, delta.finish_reason, delta.logprobs, delta.ids
                    ),
                )
        except asyncio.CancelledError:
            pass  # the server cancelled it: it reads no more of it
        except SeedanceError as exc:
            self._emit(peer, wire.Delta(no, exc.message, 0, error=exc.code))
        except Exception as exc:
            logger.exception("request %s failed in the engine", submit.request.request_id)
            self._emit(peer, wire.Delta(no, f"the engine failed: {exc!r}", 0, error="engine_error"))
        finally:
            await stream.aclose()
            del self._runs[key]

    def _emit(self, peer: bytes, delta: wire.Delta) -> None:
        box = self._outbox.get(peer)
        if box is None:
            box = self._outbox[peer] = []
            if len(self._outbox) == 1:  # the first of this round: sent after the round
                self._loop.call_soon(self._flush)
        box.append(delta)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for peer, items in outbox.items():
            self._send(peer, wire.Deltas(items))

    def _send(self, peer: bytes, message: wire.Ready | wire.Deltas | wire.Stats) -> None:
        wire.send_now(self.socket, (peer, wire.encode(message)))

    async def _send_stats_forever(self) -> None:
        engine = self.engine
        while True:
            await asyncio.sleep(wire.STATS_INTERVAL_S)
            health = engine.health()
            stats = wire.Stats(
                health.ok,
                health.detail,
                engine.unfinished_requests(),
                engine.kv_cache_usage(),
                engine.prompt_cache(),
            )
            for peer in self._peers:
                self._send(peer, stats)


async def _serve(config: ServerConfig, endpoint: str) -> int:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    try:
        from seedance.engines.registry import create_engine

        try:
            engine = create_engine(config.replace(engine_process=False))
        except ConfigError as exc:
            await _refuse(socket, exc.message)
            return 2
        engine.own_process = True
        await engine.start()
        core = EngineCore(engine, socket)
        serving = asyncio.create_task(core.serve())
        await parent_gone()
        logger.info("the server is gone: the engine process ends")
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await engine.close()
        return 0
    finally:
        socket.close()
        context.term()


async def _refuse(socket: zmq.asyncio.Socket, message: str) -> None:
    """Answer the server's hello with why the engine could not be built, and end when the
    server has read it (it closes this process's input)."""
    try:
        async with timeout(_FAILED_LINGER_S):
            peer, _ = await socket.recv_multipart()
            await socket.send_multipart((peer, wire.encode(wire.Failed(message))))
            await parent_gone()
    except asyncio.TimeoutError:
        logger.error("the engine could not be built: %s", message)


def main() -> int:
    """The engine process's entry point."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The server ends this process when it ends (it closes the input), after its drain: a
    # Ctrl-C to the terminal's process group, or a service manager's SIGTERM to every process
    # of the service, must not cut the running replies short before that.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config, endpoint = read_setup()
    from seedance.observability.logs import configure_logging

    configure_logging(config.log_level, "process=engine")
    install_uvloop()
    return asyncio.run(_serve(config, endpoint))
