"""The server's side of the engine process: :class:`RemoteEngine` and :class:`EngineProcess`.

When the engine process dies (a signal, an abort, an out-of-memory kill), every connection
stays open: the server logs the cause and what was running, ``/healthz`` answers 503, and the
process is started again (at once the first time, then with a backoff while it keeps dying:
:func:`seedance.children.restart_delay`). Each running request waits for it at most
``--engine-restart-wait`` seconds and then goes on from its last token: the reply so far
becomes the prompt's continuation, and the new tokens are a new sample after it. A request
that meets a second crash, or a restart that takes longer than the wait, ends with
``engine_error`` (retryable). New requests wait the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import zmq
import zmq.asyncio

from seedance import children
from seedance.children import Child, exit_cause
from seedance.config import ConfigError
from seedance.engines.base import (
    Engine,
    EngineHealth,
    GenerationRequest,
    ModelInfo,
    TokenDelta,
    Tokenizer,
)
from seedance.engines.core import wire
from seedance.eventloop import LightQueue, timeout
from seedance.protocol.errors import EngineError, error_from_wire
from seedance.protocol.messages import ChatMessage
from seedance.protocol.schemas import OutputSchema
from seedance.protocol.tools import CallFormat, Tools

if TYPE_CHECKING:
    from seedance.config import ServerConfig

logger = logging.getLogger(__name__)

#: How often the server says hello to an engine process that has not answered yet.
_HELLO_EVERY_S: Final = 0.05
#: How long a closing engine process may take before it is killed.
_CLOSE_WAIT_S: Final = 10.0
#: The file in the workers' folder that says how the last engine process ended.
ENDED_FILE: Final = "engine-ended"
#: What a request's queue receives when the engine process running it died.
_LOST: Final = None


class EngineProcess:
    """Starts the engine process, and starts it again when it dies (module docstring). Owned
    by the server, or by the supervisor of several workers."""

    def __init__(self, config: ServerConfig, endpoint: str) -> None:
        self.config = config
        self.endpoint = endpoint
        self.proc: Child | None = None
        self.started_at = 0.0
        #: Told on the event loop when the process died (its cause), and when a new one was
        #: started (not yet serving: say hello).
        self.on_down: Callable[[str], None] = lambda cause: None
        self.on_up: Callable[[], None] = lambda: None
        self._crashes = 0  # in a row (children.restart_delay)
        self._stopping = False
        self._restart: asyncio.Task[None] | None = None
        #: Where to write how a process ended (its pid, then the cause), for servers that
        #: attached to it and see it go without seeing why (None: nobody attaches).
        self.report: Path | None = None

    def start(self) -> wire.Ready:
        """Start the process and wait until it serves (its model loaded): its
        :class:`~seedance.engines.core.wire.Ready`. A process that cannot build its engine
        is a :class:`ConfigError`, with its reason."""
        return await_ready(self.endpoint, self._spawn())

    def keep_alive(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on, start the process again whenever it dies."""
        assert self.proc is not None
        children.watch(self.proc, loop, self._ended)

    def forget(self, peer: str) -> None:
        """Tell the process that the server ``peer`` is gone (a worker that died): it stops
        that server's requests."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        with context.socket(zmq.DEALER) as socket:
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(self.endpoint)
            with contextlib.suppress(zmq.Again):
                socket.send(wire.encode(wire.Forget(peer.encode())), zmq.NOBLOCK)

    def stop(self) -> None:
        """End the process, for good (blocks: from a thread)."""
        self._stopping = True
        if self._restart is not None:
            self._restart.get_loop().call_soon_threadsafe(self._restart.cancel)
        if self.proc is not None:
            children.stop(self.proc, _CLOSE_WAIT_S)

    def _spawn(self) -> Child:
        proc = children.spawn("seedance.engines.core", (self.config, self.endpoint))
        self.proc, self.started_at = proc, time.monotonic()
        logger.info("engine process started (pid %d)", proc.pid)
        return proc

    def _ended(self, proc: Child) -> None:
        if self._stopping or proc is not self.proc:
            return
        lived_s = time.monotonic() - self.started_at
        self._crashes, delay = children.restart_delay(self._crashes, lived_s)
        cause = exit_cause(proc.returncode)
        logger.error(
            "the engine process (pid %d) %s after %.1f s; starting it again in %.1f s",
            proc.pid,
            cause,
            lived_s,
            delay,
        )
        if self.report is not None:  # for the workers attached to it
            with contextlib.suppress(OSError):
                self.report.write_text(f"{proc.pid} {cause}")
        self.on_down(cause)
        self._restart = asyncio.create_task(self._start_again(delay))

    async def _start_again(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if not self._stopping:
            self._spawn()
            self.keep_alive(asyncio.get_running_loop())
            self.on_up()


def await_ready(endpoint: str, proc: Child | None, timeout_s: float = 120.0) -> wire.Ready:
    """Say hello at ``endpoint`` until the engine process there answers, ``proc`` (the one
    being started) ends, or (none) ``timeout_s`` passes (blocks)."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.connect(endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None if proc is not None else time.monotonic() < deadline:
            with contextlib.suppress(zmq.Again):  # not bound yet
                socket.send(wire.encode(wire.Hello()), zmq.NOBLOCK)
            if socket.poll(int(_HELLO_EVERY_S * 1000)):
                answer = wire.decode_from_engine(socket.recv())
                if isinstance(answer, wire.Ready):
                    return answer
                if isinstance(answer, wire.Failed):
                    if proc is not None:
                        children.stop(proc, _CLOSE_WAIT_S)  # it waits to be told it was heard
                    raise ConfigError(answer.message)
        if proc is None:
            raise ConfigError(f"no engine process answered at {endpoint} in {timeout_s:.0f} s")
        raise ConfigError(
            f"the engine process {exit_cause(proc.wait())} while loading the model "
            "(its log lines above say why)"
        )
    finally:
        socket.close()
        context.term()


class RemoteEngine(Engine):
    """An engine that runs in a process of its own, seen from the server (module docstring).

    Built with the engine's *front* (``EngineSpec.front``): what counts and renders prompts,
    checks schemas and answers ``/tokenize`` here; the engine process does the rest.
    """

    def __init__(self, config: ServerConfig, front: Callable[[ModelInfo], Engine]) -> None:
        """``front(info)``: the engine's front for the model the engine process serves."""
        self.config = config
        self._dir: str | None = None
        #: The engine process this server started (None: it attaches to the one the
        #: supervisor of the workers keeps alive).
        self.process: EngineProcess | None = None
        worker = config.worker
        if worker is not None and worker.engine_endpoint is not None:
            self.endpoint = worker.engine_endpoint
            ready = await_ready(self.endpoint, None)
        else:
            self._dir = tempfile.mkdtemp(prefix="seedance-engine-")
            self.endpoint = f"ipc://{self._dir}/engine"
            self.process = EngineProcess(config, self.endpoint)
        try:
            if self.process is not None:
                ready = self.process.start()
            self.front = front(ready.info)
        except BaseException:
            self._forget_process()
            raise
        self._info = ready.info
        self.epoch: int | None = None  # the serving process's pid; None while there is none
        self.max_concurrency = ready.max_concurrency
        self.task = self.front.task
        self.message_overhead_tokens = self.front.message_overhead_tokens
        self.reply_overhead_tokens = self.front.reply_overhead_tokens
        self.logprobs = self.front.logprobs
        self.token_ids = self.front.token_ids
        self._runs: dict[int, LightQueue] = {}
        self._numbers = itertools.count()
        self._stats = wire.Stats(True, "", 0, None)
        self._ready = asyncio.Event()
        self._down = ""  # why there is no engine process: how the last one ended
        self._lost_epoch: int | None = None
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None

    # ------------------------------------------------------------------ what the front knows

    @property
    def info(self) -> ModelInfo:
        return self._info

    def count_tokens(self, text: str) -> int:
        return self.front.count_tokens(text)

    def count_message_tokens(self, message: ChatMessage) -> int:
        return self.front.count_message_tokens(message)

    def count_prompt_tokens(self, messages: Sequence[ChatMessage]) -> int:
        return self.front.count_prompt_tokens(messages)

    def prompt_tokens(
        self,
        messages: Sequence[ChatMessage],
        estimate: int | None = None,
        *,
        raw: bool = False,
        tools: Tools | None = None,
    ) -> int:
        return self.front.prompt_tokens(messages, estimate, raw=raw, tools=tools)

    @property
    def native_tools(self) -> bool:
        return self.front.native_tools

    @property
    def call_format(self) -> CallFormat:
        return self.front.call_format

    def check_schema(self, schema: OutputSchema, field: str) -> None:
        self.front.check_schema(schema, field)

    def tokenizer(self) -> Tokenizer | None:
        return self.front.tokenizer()

    # ------------------------------------------------------------------ the engine process

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._socket = socket = self._context.socket(zmq.DEALER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.IMMEDIATE, 1),  # nothing queued for a process that is not there
            (zmq.SNDHWM, 0),
            (zmq.RCVHWM, 0),
            (zmq.RECONNECT_IVL, 20),  # ms: to a restarted process at once
        ):
            socket.setsockopt(option, value)
        if self.config.worker is not None:  # so that the supervisor can name it
            socket.setsockopt(zmq.IDENTITY, self.config.worker.name.encode())
        socket.connect(self.endpoint)
        self._spawn(self._receive_forever())
        if self.process is not None:  # its end is told by the process itself, with the cause
            self.process.on_down = self._lost
            self.process.on_up = lambda: self._spawn(self._hello())
            self.process.keep_alive(loop)
        else:  # told by the socket: the supervisor starts it again
            self._spawn(self._watch_link(socket))
        await self._hello()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` until :meth:`close` (the tasks that ended are let go: a hello per
        restart does not pile up)."""
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(work))

    async def close(self) -> None:
        self._closing = True
        self._ready.set()  # nothing waits for a process any more
        await asyncio.to_thread(self._forget_process)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
        self._context.term()
        await self.front.close()

    def _forget_process(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def health(self) -> EngineHealth:
        if self.epoch is None:
            return EngineHealth(False, f"the engine process {self._why()}; it is restarting")
        return EngineHealth(self._stats.ok, self._stats.detail)

    @property
    def reported(self) -> wire.Stats:
        """The engine process's last report of itself (all its clients' requests)."""
        return self._stats

    def unfinished_requests(self) -> int | None:
        """This process's requests in the engine process (workers that share it add up to
        all of its own)."""
        return len(self._runs)

    def kv_cache_usage(self) -> float | None:
        return self._stats.kv_cache_usage

    def prompt_cache(self) -> tuple[int, int] | None:
        return self._stats.prompt_cache

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        wait_s = self.config.engine_restart_wait_s
        attempt: GenerationRequest | None = request
        texts: list[str] = []  # the reply so far, for a continuation
        tokens = 0
        crashed = False
        while attempt is not None:
            epoch = await self._serving(wait_s)
            no = next(self._numbers)
            self._runs[no] = queue = LightQueue()
            self._send(wire.Submit(epoch, no, attempt))
            ended = False
            try:
                while (delta := await queue.get()) is not _LOST:
                    if delta.error is not None:
                        ended = True
                        raise error_from_wire(
                            delta.error, delta.text, request_id=attempt.request_id
                        )
                    if delta.tokens:
                        texts.append(delta.text)
                        tokens += delta.tokens
                    ended = delta.finish_reason is not None
                    yield TokenDelta(
                        delta.text, delta.tokens, delta.finish_reason, delta.logprobs, delta.ids
                    )
                    if ended:
                        return
            finally:
                del self._runs[no]
                if not ended and self.epoch == epoch:  # the consumer went away: stop it there
                    self._send(wire.Cancel(epoch, no))
            if crashed or wait_s == 0:
                await self._learn_why()
                raise EngineError(
                    f"the engine process {self._why()} while it generated request "
                    f"{request.request_id}; retry"
                )
            crashed = True
            attempt = request.continued("".join(texts), tokens)
            logger.info(
                "request %s waits for the engine process and goes on after %d token(s)",
                request.request_id,
                tokens,
            )
        yield TokenDelta("", 0, "length")  # the crash came after its last token

    # ------------------------------------------------------------------ the link

    def _send(self, message: wire.Hello | wire.Submit | wire.Cancel) -> None:
        assert self._socket is not None, "start() first"
        # Not sent when no engine process is there: its requests then end as lost.
        wire.send_now(self._socket, (wire.encode(message),))

    async def _serving(self, wait_s: float) -> int:
        """The serving process's epoch; waits ``wait_s`` at most for one."""
        if self.epoch is None and not self._closing and wait_s > 0:
            try:
                async with timeout(wait_s):
                    await self._ready.wait()
            except asyncio.TimeoutError:
                pass
        if self._closing:
            raise EngineError("the server is shutting down")
        if self.epoch is None:
            raise EngineError(f"the engine process {self._why()} and is not back yet; retry")
        return self.epoch

    async def _receive_forever(self) -> None:
        runs = self._runs
        socket = self._socket
        assert socket is not None
        while True:
            message = wire.decode_from_engine(await socket.recv())
            if isinstance(message, wire.Deltas):
                for delta in message.items:
                    queue = runs.get(delta.no)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(message, wire.Stats):
                self._stats = message
            elif (
                isinstance(message, wire.Ready)
                and self.epoch is None
                and self._current(message.epoch)
            ):
                self.epoch = message.epoch
                self._ready.set()
                if self._down:
                    logger.warning("the engine process is back (pid %d)", self.epoch)

    def _current(self, epoch: int) -> bool:
        """Whether a :class:`~seedance.engines.core.wire.Ready` comes from the process that
        serves now (not a late answer of one that died)."""
        if self.process is not None:
            proc = self.process.proc
            return proc is not None and proc.pid == epoch
        return epoch != self._lost_epoch

    async def _hello(self) -> None:
        """Say hello until the engine process answers (or, one this server started, ends)."""
        proc = self.process.proc if self.process is not None else None
        while self.epoch is None and not self._closing:
            if proc is not None and proc.poll() is not None:
                return  # dead before it served: it is started again
            self._send(wire.Hello())
            with contextlib.suppress(asyncio.TimeoutError):
                async with timeout(_HELLO_EVERY_S):
                    await self._ready.wait()

    async def _watch_link(self, socket: zmq.asyncio.Socket) -> None:
        """An engine process this server did not start: it is gone when its connection is."""
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()  # EVENT_DISCONNECTED: the process is gone
                if self.epoch is not None:
                    self._lost("went away")
                    self._spawn(self._hello())
        finally:
            socket.disable_monitor()
            monitor.close()

    async def _learn_why(self, tries: int = 100) -> None:
        """Give the supervisor a moment (2 s at most) to say how the engine process ended: it
        learns it just after its workers see the process go (the file it writes is polled:
        it comes from another process)."""
        if self.process is not None:
            return
        for _ in range(tries):
            if self._why() != self._down:
                return
            await asyncio.sleep(0.02)

    def _why(self) -> str:
        """How the last engine process ended. One the supervisor of the workers keeps alive
        ended where only it could see how: it writes that down (:meth:`EngineProcess.report`)."""
        worker = self.config.worker
        if self.process is None and worker is not None:
            with contextlib.suppress(OSError, ValueError):
                pid, cause = (Path(worker.folder) / ENDED_FILE).read_text().split(" ", 1)
                if int(pid) == self._lost_epoch:
                    return cause
        return self._down

    def _lost(self, cause: str) -> None:
        """The engine process died (on the event loop): what ran in it waits for the next."""
        self._down = cause
        self._lost_epoch, self.epoch = self.epoch, None
        self._ready.clear()
        stats = self._stats
        if self._runs:
            logger.error(
                "%d request(s) of this server were running in the engine process (%s requests "
                "inside the engine, KV cache %s used); they go on in the next one",
                len(self._runs),
                "?" if stats.unfinished is None else stats.unfinished,
                "?" if stats.kv_cache_usage is None else f"{stats.kv_cache_usage:.0%}",
            )
        for queue in self._runs.values():
            queue.put_nowait(_LOST)
