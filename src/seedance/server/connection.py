"""One client connection on ``/v2/infer``: frames in, generations out, heartbeats, timeouts.

The receive loop never waits on a generation: each ``generate`` runs in its own task, which
writes its frames to a stream log; the connection follows the log (a :class:`Follower`) and
sends them through its :class:`Outbound` queue, as does any other connection that resumes the
same generation. A ``cancel`` closes the engine's iterator, which stops the engine; so does a
disconnect of the last reader of a request that is not resumable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from typing import TYPE_CHECKING

from seedance.observability.audit import kinds as audit
from seedance.observability.tracing import Attributes, Tracing
from seedance.protocol.codec import (
    check_frame_size,
    classify_binary,
    decode_client_text,
    encode_error,
    encode_frame,
)
from seedance.protocol.e2e import SEALED, Channel
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    CLOSE_IDLE_TIMEOUT,
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    EncryptionFailed,
    InternalError,
    InvalidRequest,
    SeedanceError,
)
from seedance.protocol.messages import (
    HEARTBEAT_PING,
    HEARTBEAT_PONG,
    Cancel,
    ClientMessage,
    DoneFrame,
    EndSession,
    ErrorFrame,
    Generate,
    Ping,
    PongFrame,
    RequestId,
    Resume,
    StartFrame,
)
from seedance.server.outbound import Outbound, close_websocket
from seedance.server.requests import Generation, Requester, admit, new_request_id
from seedance.server.transport import AsgiWebSocket
from seedance.sessions.session import Session
from seedance.streams.log import StreamLog
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from seedance.protocol.qos import QoS
    from seedance.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)

# How long a close may wait for queued frames before the socket is dropped.
CLOSE_FLUSH_TIMEOUT_S = 5.0


def new_connection_id() -> str:
    return "c-" + secrets.token_hex(4)


class Follower:
    """A connection reading one generation's stream log: frames go out as they are logged."""

    __slots__ = ("behind", "connection", "log", "on_tokens", "out", "tokens")

    def __init__(self, connection: Connection, log: StreamLog, seq: int = 0) -> None:
        self.connection = connection
        self.out = out = connection.out
        self.log = log
        self.tokens = out.token_stream(log.request_id)
        self.tokens.seq = seq  # the first token this reader lacks
        self.on_tokens = self.tokens.push
        self.behind = False
        out.watcher = self._watch
        if out.congested:
            self._watch(True)

    def _watch(self, congested: bool) -> None:
        """The connection's socket fell behind or caught up: the log's writer waits for it."""
        if congested != self.behind:
            self.behind = congested
            self.log.set_behind(congested)

    def on_start(self, frame: StartFrame) -> None:
        # Shares a write with the first token when that comes at once.
        self.out.put_soon(encode_frame(frame))

    def on_end(self, frame: DoneFrame | ErrorFrame | None) -> None:
        if frame is not None:
            self.out.put(encode_frame(frame))
        self.stop()

    def stop(self) -> None:
        """No longer this connection's stream."""
        if self.out.watcher == self._watch:
            self.out.watcher = None
        if self.behind:
            self.behind = False
            self.log.set_behind(False)
        connection = self.connection
        if connection._follower is self:
            connection._follower = None


class Connection:
    def __init__(
        self,
        state: ServerState,
        ws: AsgiWebSocket,
        session: Session,
        model: ServedModel,
        peer: str,
        trace_parent: Context | None = None,
        principal: Principal = OPEN_PRINCIPAL,
        qos: QoS | None = None,
        *,
        connection_id: str | None = None,
        channel: Channel | None = None,
    ) -> None:
        self.state = state
        self.principal = principal
        self.tenant = principal.name
        self.quotas = principal.tenant.quotas
        #: The model's frame limits; requests without max_tokens get at most the tenant's.
        self.limits = model.limits.capped(self.quotas.max_tokens)
        self.config = state.config
        self.ws = ws
        self.session = session
        self.model = model
        self.peer = peer
        self.id = connection_id or new_connection_id()
        #: The client's trace context from the handshake: the parent of requests' spans.
        self.trace_parent = trace_parent
        self.trace = state.tracing.connection(trace_parent, self._span_attributes)
        #: Who asks, for every generation this connection starts.
        self.requester = Requester(principal, model, "websocket", session, self.id, self.trace, qos)
        self.out = Outbound(
            ws,
            max_pending_bytes=self.config.max_pending_bytes,
            on_overflow=self._on_overflow,
            on_failure=self._on_writer_failure,
            merger=state.merger,
        )
        #: End-to-end encryption (None: the client did not ask for it): every frame after the
        #: ``session`` frame is sealed (heartbeats excepted), every inbound one must be.
        self.channel = channel
        self._opened: str | bytes | None = None  # a frame opened on the direct path, then deferred
        if channel is not None:
            self.out.seal = channel.seal_frame
            if ws.writer is not None:  # and what the server writes on its own
                ws.writer.seal = channel.seal_frame
        self._loop = asyncio.get_running_loop()
        self.opened_at = self._loop.time()
        self.last_inbound = self.opened_at
        self._ping_sent_at: float | None = None  # loop time, for the timers
        self._ping_sent_clock = 0.0  # time.monotonic(), for the round trip
        self.last_rtt_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._follower: Follower | None = None  # the generation this connection reads
        self._run_task: asyncio.Task[object] | None = None
        self._closing = False
        self._failure_close: asyncio.Future[None] | None = None  # the 1011 after a fault
        self.close_code: int | None = None
        self.requests = 0
        self._deferred = 0  # messages left to the receive loop, to keep their order

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve until the client or the server closes the connection."""
        self._run_task = asyncio.current_task()
        self.state.metrics.connections_opened.inc()
        self._arm_timer()
        logger.info(
            "conn %s open peer=%s tenant=%s credential=%s session=%s model=%s",
            self.id,
            self.peer,
            self.tenant,
            self.principal.credential,
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
        # Messages come to _on_message as they are parsed where the server offers it; the
        # ASGI queue then brings the disconnect, and messages that must be awaited in order.
        self.ws.set_receiver(self._on_message)
        try:
            while True:
                event = await receive()
                if event["type"] == "websocket.disconnect":
                    if self.close_code is None:
                        self.close_code = int(event.get("code", 1005))
                    return
                self.last_inbound = self._loop.time()
                text = event.get("text")
                data = text if text is not None else event.get("bytes") or b""
                await self._dispatch(data)
                if self._deferred:
                    self._deferred -= 1
        finally:
            self.ws.set_receiver(None)

    def _on_message(self, data: bytes, is_text: bool) -> bool:
        """The direct path: handle a message as it is parsed; false defers it to the receive
        loop (an ``end_session`` or a ``resume``, which await the stores, and whatever follows
        it)."""
        if self._deferred:
            self._deferred += 1
            return False
        self.last_inbound = self._loop.time()
        try:
            text: str | bytes | None = data if is_text else None
            if self.channel is not None:
                text = self._open(data, is_text)
            if text is None:
                self._on_binary(data)
                return True
            message = decode_client_text(text, self.limits)
            if isinstance(message, EndSession | Resume):  # they await the stores
                self._deferred = 1
                if self.channel is not None:
                    self._opened = text  # opening it again would be a replay
                return False
            self._on_sync_message(message)
        except Exception as exc:
            self._on_error(exc)
        return True

    async def _dispatch(self, data: str | bytes) -> None:
        """The queued path: one message from the ASGI queue."""
        try:
            text: str | bytes | None = data if isinstance(data, str) else None
            if self.channel is not None:
                opened, self._opened = self._opened, None
                text = opened if opened is not None else self._open(data, text is not None)
            if text is None:
                self._on_binary(data)  # type: ignore[arg-type]
                return
            message = decode_client_text(text, self.limits)
            if isinstance(message, EndSession):
                await self._end_session()
            elif isinstance(message, Resume):
                await self._resume(message)
            else:
                self._on_sync_message(message)
        except Exception as exc:
            self._on_error(exc)

    def _open(self, data: str | bytes, is_text: bool) -> str | None:
        """An inbound frame of an encrypted connection: a sealed frame's text, None for a
        heartbeat; anything else fails the connection."""
        assert self.channel is not None
        if is_text or not isinstance(data, bytes):
            raise EncryptionFailed(
                "plaintext", "this connection encrypts every frame: a text frame was refused"
            )
        if data[:1] != bytes((SEALED,)):
            return None  # a heartbeat, or a frame the binary path refuses
        return self.channel.open(data)

    def fail(self, error: SeedanceError) -> None:
        """Send ``error``; close the connection if the error closes it."""
        if isinstance(error, EncryptionFailed) and not self._closing:
            self.state.metrics.encryption_failures.labels(error.reason or "").inc()
            logger.warning(
                "conn %s: end-to-end encryption failed (%s): %s; closing",
                self.id,
                error.reason,
                error.message,
            )
        self.out.put(encode_error(error))
        if error.close_code is not None:
            self.close(error.close_code, error.code)

    def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, SeedanceError):
            self.fail(exc)
            return
        reference = self.id + "-" + secrets.token_hex(3)
        logger.error("conn %s: failed on a frame (ref %s)", self.id, reference, exc_info=exc)
        self.out.put(encode_error(InternalError(f"internal error (ref {reference})")))

    async def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self._leave_stream()  # a disconnect: the last reader's leaving may abort it
        await self.out.stop()
        duration = self._loop.time() - self.opened_at
        code = "1006" if self.close_code is None else str(self.close_code)
        self.state.metrics.connections_closed.labels(code).inc()
        self.trace.end(self.close_code, self.requests)
        self.state.audit_submit(lambda: self._audit_record(duration))
        logger.info(
            "conn %s closed code=%s duration_s=%.1f requests=%d",
            self.id,
            self.close_code,
            duration,
            self.requests,
        )

    def close(self, code: int, reason: str = "", *, past_writer: bool = False) -> None:
        """Close after the queued frames are sent; drop the socket if they cannot be.
        ``past_writer``: the writer failed, so the close frame goes out without it."""
        if self._closing:
            return
        self._closing = True
        self.close_code = code
        self._leave_stream_soon()
        if past_writer:
            self._failure_close = asyncio.ensure_future(close_websocket(self.ws, code, reason))
        else:
            self.out.close(code, reason)
        self._loop.call_later(CLOSE_FLUSH_TIMEOUT_S, self._abort, "close did not flush")

    @property
    def idle(self) -> bool:
        """Reads no stream and is not closing: a shutdown may close it at once."""
        return self._follower is None and not self._closing

    @property
    def movable(self) -> bool:
        """Reads a resumable stream: in a cluster, its client can resume it on another node."""
        follower = self._follower
        return follower is not None and follower.log.resumable and not self._closing

    async def shutdown(self) -> None:
        """Server shutdown: cancel what still runs (its ``done`` says so), then close 1001."""
        await self._stop_generation(silent=False)
        self.close(CLOSE_GOING_AWAY, "server shutting down")

    def _abort(self, why: str) -> None:
        if self._run_task is not None and self._run_task.done():
            return  # already over
        logger.warning("conn %s dropped: %s", self.id, why)
        if self.close_code is None:
            self.close_code = 1006
        self._closing = True
        if not self.ws.abort() and self._run_task is not None:
            self._run_task.cancel()  # no way to drop the socket: stop serving it

    def _on_overflow(self) -> None:
        self._abort(f"client not reading: over {self.config.max_pending_bytes} bytes held")

    def _on_writer_failure(self, exc: BaseException) -> None:
        """The writer of this connection failed (a fault of ours, not the client going away):
        say so in the log with the connection and the request it was writing, and end the
        connection with 1011 (the close frame sent past the failed writer)."""
        follower = self._follower
        request = follower.log.request_id if follower is not None else "-"
        logger.error(
            "conn %s: the writer failed (request %s); closing with %d",
            self.id,
            request,
            CLOSE_INTERNAL_ERROR,
            exc_info=exc,
        )
        self.close(CLOSE_INTERNAL_ERROR, "internal error", past_writer=True)

    def _audit_record(self, duration_s: float) -> audit.Connection:
        return audit.Connection(
            tenant=self.tenant,
            credential=self.principal.credential,
            connection=self.id,
            peer=self.peer,
            session=self.session.session_id,
            model=self.model.name,
            duration_ms=round(duration_s * 1000, 3),
            close_code=1006 if self.close_code is None else self.close_code,
            requests=self.requests,
        )

    def _refusal_record(self, request_id: RequestId, error: SeedanceError) -> audit.Request:
        """The record of a request refused before it started."""
        return audit.Request(
            api="websocket",
            tenant=self.tenant,
            credential=self.principal.credential,
            connection=self.id,
            session=self.session.session_id,
            request_id=request_id,
            model=self.model.name,
            outcome=error.code,
        )

    def _span_attributes(self) -> Attributes:
        return {
            "seedance.tenant": self.tenant,
            "seedance.connection_id": self.id,
            "seedance.session_id": self.session.session_id,
            "gen_ai.request.model": self.model.name,
            "client.address": self.peer.rpartition(":")[0] or self.peer,
            "url.path": "/v2/infer",
        }

    # ------------------------------------------------------------------ inbound frames

    def _on_sync_message(self, message: ClientMessage) -> None:
        if isinstance(message, Generate):
            self._start_generation(message)
        elif isinstance(message, Ping):
            self.out.put(encode_frame(PongFrame(id=message.id)))
        elif isinstance(message, Cancel):
            generation = self._running()
            if generation is not None and message.request_id in (None, generation.request_id):
                generation.cancel(silent=False)

    def _on_binary(self, data: bytes) -> None:
        check_frame_size(data, self.config.max_frame_bytes)
        if classify_binary(data) == "ping":
            self.out.put(HEARTBEAT_PONG)
        elif self._ping_sent_at is not None:
            self.last_rtt_s = time.monotonic() - self._ping_sent_clock
            self._ping_sent_at = None
            self.state.metrics.heartbeat_rtt.observe(self.last_rtt_s)

    async def _end_session(self) -> None:
        generation = self._running()
        if generation is not None:
            generation.cancel(silent=True)
        self.state.streams.forget(self.tenant, self.session.session_id)
        await self.state.sessions.delete(self.session)
        logger.info("session %s ended by client (conn %s)", self.session.session_id, self.id)
        self.close(CLOSE_NORMAL, "session ended")

    async def end_session_by_admin(self) -> None:
        """An administrator ended the session: what runs is cancelled (its ``done`` says so),
        then the connection closes with 1000."""
        await self._stop_generation(silent=False)
        self.close(CLOSE_NORMAL, "session ended by an administrator")

    # ------------------------------------------------------------------ generations

    def _start_generation(self, message: Generate) -> None:
        # When the frame was read (it is handled as it is parsed). Request timings use
        # time.monotonic(): uvloop's loop.time() counts whole milliseconds.
        received = time.monotonic()
        request_id = RequestId(message.request_id) if message.request_id else new_request_id()
        try:
            self._admit(message, request_id, received)
        except SeedanceError as exc:
            exc.request_id = request_id
            self.state.count_refusal(self.model, self.tenant, exc.code)
            self._trace_refusal(message, request_id, received, exc)
            self.state.audit_submit(functools.partial(self._refusal_record, request_id, exc))
            raise
        except Exception as exc:
            logger.exception("request %s failed to start", request_id)
            raise InternalError(
                f"internal error on request {request_id}", request_id=request_id
            ) from exc

    def _admit(self, message: Generate, request_id: RequestId, received: float) -> None:
        """Start a generation on this session and follow its log."""
        trace_parent = (
            Tracing.from_field(message.traceparent) if message.traceparent else self.trace_parent
        )
        served = self.state.resolve_model(self.model.name, self.session.session_id)
        if served is not self.model:  # a reload swapped a new version in since the last
            self.model = served
            self.limits = served.limits.capped(self.quotas.max_tokens)
            # A new requester: a running generation keeps its own (and its version's engine).
            self.requester = dataclasses.replace(self.requester, model=served)
        generation = admit(
            self.state, self.requester, message, request_id, received, trace_parent=trace_parent
        )
        self._follower = follower = Follower(self, generation.log)
        generation.log.attach(follower)
        self.requests += 1

    def _trace_refusal(
        self, message: Generate, request_id: RequestId, received: float, error: SeedanceError
    ) -> None:
        """A span for a request refused before it started (busy session, no room, ...)."""
        tracing = self.state.tracing
        if not tracing.enabled:
            return
        parent = self.trace_parent
        if message.traceparent:
            with contextlib.suppress(SeedanceError):  # the refusal may be this field's
                parent = Tracing.from_field(message.traceparent)
        attributes = {"seedance.request_id": request_id, "seedance.connection_id": self.id}
        trace = tracing.request(
            f"chat {self.model.name}", parent, received, lambda: attributes, self.trace
        )
        trace.end(
            received=received,
            admitted=None,
            first_token=None,
            last_token=None,
            outcome=error.code,
            error=(error.code, error.message),
            attributes={"gen_ai.request.model": self.model.name},
        )

    def _running(self) -> Generation | None:
        """The session's running generation (started here or on another connection)."""
        return self.state.running_on(self.session)

    async def _resume(self, message: Resume) -> None:
        """Follow a generation of this session from the token after ``after_seq``."""
        if self._follower is not None:
            raise InvalidRequest(
                f"this connection is reading {self._follower.log.request_id}; "
                "resume another stream once it is done",
                request_id=message.request_id,
            )
        session_id = self.session.session_id
        log = await self.state.streams.find(
            self.tenant, session_id, message.request_id, message.epoch
        )
        follower = Follower(self, log, message.after_seq + 1)
        try:
            log.attach(follower, message.after_seq)
        except BaseException:
            follower.stop()  # a cursor the log refused: this connection reads nothing
            raise
        if log.running:
            self._follower = follower
            generation = self._running()
            if generation is not None:
                generation.reader_joined()
        logger.info(
            "conn %s resumed %s after seq %d (%s)",
            self.id,
            message.request_id,
            message.after_seq,
            "live" if log.running else "done",
        )

    def _followed(self, follower: Follower | None) -> Generation | None:
        """The running generation ``follower`` reads (None: none, or it has ended)."""
        generation = self._running()
        if follower is None or generation is None or generation.log is not follower.log:
            return None
        return generation

    def _leave_stream_soon(self) -> None:
        """Stop reading; the generation decides what that means (see ``reader_left``)."""
        follower = self._follower
        if follower is None:
            return
        follower.log.detach(follower)
        follower.stop()
        generation = self._followed(follower)
        if generation is not None:
            generation.reader_left()

    async def _leave_stream(self) -> None:
        """Stop reading, and wait for the generation if that aborted it."""
        follower = self._follower
        self._leave_stream_soon()
        generation = self._followed(follower)
        if generation is None:
            return
        log = generation.log
        if not log.resumable and not log.readers and generation.task is not None:
            await asyncio.gather(generation.task, return_exceptions=True)

    async def _stop_generation(self, *, silent: bool) -> None:
        """Cancel the generation this connection reads and wait until it has ended."""
        generation = self._followed(self._follower)
        if generation is not None and generation.task is not None:
            generation.cancel(silent=silent)
            await asyncio.gather(generation.task, return_exceptions=True)

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
            self._ping_sent_clock = time.monotonic()
            self.out.put(HEARTBEAT_PING)
        self._arm_timer()
