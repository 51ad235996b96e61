"""One client connection on ``/v2/infer``: frames in, generations out, heartbeats, timeouts.

The receive loop never waits on a generation: each ``generate`` runs in its own task, which
writes ``start``, ``token`` and ``done`` frames through the connection's :class:`Outbound`
queue. A ``cancel`` or a disconnect closes the engine's iterator, which stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.protocol.codec import (
    TokenFrameEncoder,
    check_frame_size,
    classify_binary,
    decode_client_text,
    encode_error,
    encode_frame,
)
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    CLOSE_IDLE_TIMEOUT,
    CLOSE_NORMAL,
    EngineError,
    InternalError,
    Overloaded,
    SeedanceError,
    SessionBusy,
)
from seedance.protocol.messages import (
    HEARTBEAT_PING,
    HEARTBEAT_PONG,
    Cancel,
    ChatMessage,
    DoneFrame,
    EndSession,
    FinishReason,
    Generate,
    Ping,
    PongFrame,
    RequestId,
    StartFrame,
    Timing,
    Usage,
)
from seedance.server.transport import AsgiWebSocket, Outbound
from seedance.sessions.context import fit_context
from seedance.sessions.session import Session, Turn

if TYPE_CHECKING:
    from seedance.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)

# How long a close may wait for queued frames before the socket is dropped.
CLOSE_FLUSH_TIMEOUT_S = 5.0


def new_request_id() -> RequestId:
    return RequestId("r-" + secrets.token_hex(6))


def new_trace_id() -> str:
    return secrets.token_hex(16)


class _Generation:
    """The request running on this connection."""

    __slots__ = ("cancel_requested", "request_id", "task")

    def __init__(self, request_id: RequestId) -> None:
        self.request_id = request_id
        self.task: asyncio.Task[None] | None = None
        self.cancel_requested = False


class Connection:
    def __init__(
        self,
        state: ServerState,
        ws: AsgiWebSocket,
        session: Session,
        model: ServedModel,
        peer: str,
    ) -> None:
        self.state = state
        self.config = state.config
        self.ws = ws
        self.session = session
        self.model = model
        self.peer = peer
        self.id = "c-" + secrets.token_hex(4)
        self.out = Outbound(
            ws, max_pending_bytes=self.config.max_pending_bytes, on_overflow=self._on_overflow
        )
        self._loop = asyncio.get_running_loop()
        self.opened_at = self._loop.time()
        self.last_inbound = self.opened_at
        self._ping_sent_at: float | None = None
        self.last_rtt_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._generation: _Generation | None = None
        self._run_task: asyncio.Task[object] | None = None
        self._closing = False
        self.close_code: int | None = None
        self.requests = 0

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve until the client or the server closes the connection."""
        self._run_task = asyncio.current_task()
        self.out.start()
        self._arm_timer()
        logger.info(
            "conn %s open peer=%s session=%s model=%s",
            self.id,
            self.peer,
            self.session.session_id,
            self.model.name,
        )
        try:
            await self._receive_loop()
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            await self._finish()

    async def _receive_loop(self) -> None:
        receive = self.ws.receive
        while True:
            event = await receive()
            if event["type"] == "websocket.disconnect":
                if self.close_code is None:
                    self.close_code = int(event.get("code", 1005))
                return
            self.last_inbound = self._loop.time()
            text = event.get("text")
            try:
                if text is not None:
                    await self._on_text(text)
                else:
                    self._on_binary(event.get("bytes") or b"")
            except SeedanceError as exc:
                self.out.put(encode_error(exc))
                if exc.close_code is not None:
                    self.close(exc.close_code, exc.code)
            except Exception:
                reference = self.id + "-" + secrets.token_hex(3)
                logger.exception("conn %s: failed on a frame (ref %s)", self.id, reference)
                self.out.put(encode_error(InternalError(f"internal error (ref {reference})")))

    async def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        generation = self._generation
        if generation is not None and generation.task is not None:
            generation.task.cancel()  # disconnect: abort the engine work, send nothing
            await asyncio.gather(generation.task, return_exceptions=True)
        await self.out.stop()
        duration = self._loop.time() - self.opened_at
        logger.info(
            "conn %s closed code=%s duration_s=%.1f requests=%d",
            self.id,
            self.close_code,
            duration,
            self.requests,
        )

    def close(self, code: int, reason: str = "") -> None:
        """Close after the queued frames are sent; drop the socket if they cannot be."""
        if self._closing:
            return
        self._closing = True
        self.close_code = code
        self._cancel_generation(silent=True)
        self.out.close(code, reason)
        self._loop.call_later(CLOSE_FLUSH_TIMEOUT_S, self._abort, "close did not flush")

    async def shutdown(self) -> None:
        """Server shutdown: cancel what still runs (its ``done`` says so), then close 1001."""
        generation = self._generation
        if generation is not None and generation.task is not None:
            self._cancel_generation(silent=False)
            await asyncio.gather(generation.task, return_exceptions=True)
        self.close(CLOSE_GOING_AWAY, "server shutting down")

    def _abort(self, why: str) -> None:
        if self.out.closed and self._run_task is not None and self._run_task.done():
            return
        logger.warning("conn %s dropped: %s", self.id, why)
        if self.close_code is None:
            self.close_code = 1006
        self._closing = True
        if not self.ws.abort() and self._run_task is not None:
            self._run_task.cancel()  # no way to drop the socket: stop serving it

    def _on_overflow(self) -> None:
        self._abort(f"client not reading: over {self.config.max_pending_bytes} bytes held")

    # ------------------------------------------------------------------ inbound frames

    async def _on_text(self, text: str) -> None:
        message = decode_client_text(text, self.model.limits)
        if isinstance(message, Generate):
            self._start_generation(message)
        elif isinstance(message, Ping):
            self.out.put(encode_frame(PongFrame(id=message.id)))
        elif isinstance(message, Cancel):
            generation = self._generation
            if generation is not None and message.request_id in (None, generation.request_id):
                self._cancel_generation(silent=False)
        elif isinstance(message, EndSession):
            await self._end_session()

    def _on_binary(self, data: bytes) -> None:
        check_frame_size(data, self.config.max_frame_bytes)
        if classify_binary(data) == "ping":
            self.out.put(HEARTBEAT_PONG)
        elif self._ping_sent_at is not None:
            self.last_rtt_s = self._loop.time() - self._ping_sent_at
            self._ping_sent_at = None

    async def _end_session(self) -> None:
        self._cancel_generation(silent=True)
        await self.state.sessions.delete(self.session)
        logger.info("session %s ended by client (conn %s)", self.session.session_id, self.id)
        self.close(CLOSE_NORMAL, "session ended")

    # ------------------------------------------------------------------ generations

    def _start_generation(self, message: Generate) -> None:
        request_id = RequestId(message.request_id) if message.request_id else new_request_id()
        try:
            self._admit(message, request_id)
        except SeedanceError as exc:
            exc.request_id = request_id
            raise
        except Exception as exc:
            logger.exception("request %s failed to start", request_id)
            raise InternalError(
                f"internal error on request {request_id}", request_id=request_id
            ) from exc

    def _admit(self, message: Generate, request_id: RequestId) -> None:
        """Check the request against the session and the context window, then start it."""
        if self.state.draining:
            raise Overloaded("the server is shutting down; retry on another server")
        session = self.session
        if session.active_request is not None:
            raise SessionBusy(
                f"request {session.active_request} is still running on this session; "
                "cancel it or wait for its done frame"
            )
        engine = self.model.engine
        name = self.model.name
        new_turns = [Turn(m, engine.count_message_tokens(m), name) for m in message.turns()]
        history = [] if message.reset else self._history()
        context, prompt_tokens = fit_context(
            history,
            new_turns,
            context_length=engine.info.context_length,
            reply_overhead=engine.reply_overhead_tokens,
            max_tokens=message.max_tokens,
        )
        session.begin(request_id)
        generation = _Generation(request_id)
        self._generation = generation
        self.requests += 1
        generation.task = asyncio.create_task(
            self._generate(generation, message, new_turns, context, prompt_tokens),
            name=f"generate-{request_id}",
        )

    def _history(self) -> list[Turn]:
        """The session's turns, recounted if they were counted for another model."""
        engine, name = self.model.engine, self.model.name
        return [
            t if t.model == name else Turn(t.message, engine.count_message_tokens(t.message), name)
            for t in self.session.turns
        ]

    def _cancel_generation(self, *, silent: bool) -> None:
        generation = self._generation
        if generation is None or generation.task is None or generation.task.done():
            return
        generation.cancel_requested = not silent
        generation.task.cancel()

    async def _generate(
        self,
        generation: _Generation,
        message: Generate,
        new_turns: list[Turn],
        context: list[Turn],
        prompt_tokens: int,
    ) -> None:
        loop = self._loop
        out = self.out
        model = self.model
        request_id = generation.request_id
        trace_id = new_trace_id()
        received = loop.time()
        admitted_at: float | None = None
        first_token_at: float | None = None
        completion_tokens = 0
        finish: FinishReason | None = None
        error_code = ""
        parts: list[str] = []
        if self.config.log_prompts:
            logger.debug("request %s prompt=%r", request_id, [t.message for t in new_turns])
        try:
            await model.admission.acquire()
            admitted_at = loop.time()
            out.put(
                encode_frame(
                    StartFrame(
                        request_id=request_id,
                        trace_id=trace_id,
                        model=model.name,
                        prompt_tokens=prompt_tokens,
                    )
                )
            )
            request = GenerationRequest(
                request_id=request_id,
                messages=tuple(t.message for t in context),
                params=SamplingParams(
                    max_tokens=message.max_tokens,
                    temperature=message.temperature,
                    top_p=message.top_p,
                    stop=message.stop_strings(),
                    seed=message.seed,
                ),
                prompt_tokens=prompt_tokens,
            )
            encoder = TokenFrameEncoder(request_id) if message.stream else None
            stream = model.engine.generate(request)
            try:
                async for delta in stream:
                    if delta.tokens:
                        if first_token_at is None:
                            first_token_at = loop.time()
                        parts.append(delta.text)
                        if encoder is not None:
                            out.put(encoder.encode(delta.text, completion_tokens, delta.tokens))
                            if out.congested:
                                await out.wait_writable()
                        completion_tokens += delta.tokens
                    if delta.finish_reason is not None:
                        finish = delta.finish_reason
                        break
            except (asyncio.CancelledError, SeedanceError):
                raise
            except Exception as exc:
                logger.exception("engine failed on request %s", request_id)
                raise EngineError(f"the model failed on request {request_id}; retry") from exc
            finally:
                await stream.aclose()
            finish = finish or "stop"
            reply = "".join(parts)
            answer = ChatMessage("assistant", reply)
            turns = [
                *new_turns,
                Turn(answer, model.engine.count_message_tokens(answer), model.name),
            ]
            self.session.commit(
                turns, reset=message.reset, max_tokens=model.engine.info.context_length
            )
            await self.state.sessions.save(self.session)
            out.put(
                self._done(
                    request_id,
                    trace_id,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    received,
                    admitted_at,
                    first_token_at,
                    None if message.stream else reply,
                )
            )
        except asyncio.CancelledError:
            if not generation.cancel_requested:
                finish = None
                error_code = "aborted"
                raise
            finish = "cancelled"
            out.put(
                self._done(
                    request_id,
                    trace_id,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    received,
                    admitted_at,
                    first_token_at,
                    None if message.stream else "".join(parts),
                )
            )
        except SeedanceError as exc:
            error_code = exc.code
            out.put(encode_error(exc, request_id))
        except Exception:
            error_code = "internal_error"
            logger.exception("request %s failed", request_id)
            out.put(
                encode_error(InternalError(f"internal error on request {request_id}"), request_id)
            )
        finally:
            if admitted_at is not None:
                model.admission.release()
            self.session.end(request_id)
            if self._generation is generation:
                self._generation = None
            self._log_request(
                request_id,
                finish,
                error_code,
                prompt_tokens,
                completion_tokens,
                received,
                admitted_at,
                first_token_at,
            )
            if self.config.log_prompts and parts:
                logger.debug("request %s completion=%r", request_id, "".join(parts))

    def _done(
        self,
        request_id: str,
        trace_id: str,
        finish: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        received: float,
        admitted_at: float | None,
        first_token_at: float | None,
        text: str | None,
    ) -> str:
        now = self._loop.time()
        return encode_frame(
            DoneFrame(
                done=True,
                request_id=request_id,
                trace_id=trace_id,
                finish_reason=finish,
                usage=Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens),
                timing=Timing(
                    queue_ms=_ms((admitted_at or now) - received),
                    ttft_ms=None if first_token_at is None else _ms(first_token_at - received),
                    total_ms=_ms(now - received),
                ),
                text=text,
            )
        )

    def _log_request(
        self,
        request_id: str,
        finish: FinishReason | None,
        error_code: str,
        prompt_tokens: int,
        completion_tokens: int,
        received: float,
        admitted_at: float | None,
        first_token_at: float | None,
    ) -> None:
        now = self._loop.time()
        logger.info(
            "request %s conn=%s session=%s model=%s outcome=%s prompt_tokens=%d "
            "completion_tokens=%d queue_ms=%.1f ttft_ms=%s total_ms=%.1f",
            request_id,
            self.id,
            self.session.session_id,
            self.model.name,
            finish or error_code,
            prompt_tokens,
            completion_tokens,
            _ms((admitted_at or now) - received),
            "-" if first_token_at is None else f"{_ms(first_token_at - received):.1f}",
            _ms(now - received),
        )

    # ------------------------------------------------------------------ heartbeats and timeouts

    def _arm_timer(self) -> None:
        config = self.config
        due = self.last_inbound + config.idle_timeout_s
        if self._ping_sent_at is None or self._ping_sent_at < self.last_inbound:
            due = min(due, self.last_inbound + config.heartbeat_interval_s)
        stalled = self.out.stalled_since
        if stalled is not None:
            due = min(due, stalled + config.write_timeout_s)
        else:
            due = min(due, self._loop.time() + config.write_timeout_s)
        self._timer = self._loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        config = self.config
        now = self._loop.time()
        stalled = self.out.stalled_since
        if stalled is not None and now - stalled >= config.write_timeout_s:
            self._abort(f"client not reading: nothing written for {config.write_timeout_s:g} s")
            return
        if self._closing:
            return  # close() bounds its own flush
        self.last_inbound = max(self.last_inbound, self.ws.last_control_frame_at())
        idle = now - self.last_inbound
        if idle >= config.idle_timeout_s:
            logger.info("conn %s idle for %.1f s: closing", self.id, idle)
            self.close(CLOSE_IDLE_TIMEOUT, "idle timeout")
            return
        if idle >= config.heartbeat_interval_s and (
            self._ping_sent_at is None or self._ping_sent_at < self.last_inbound
        ):
            self._ping_sent_at = now
            self.out.put(HEARTBEAT_PING)
        self._arm_timer()


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
