"""One client connection on ``/v2/infer``: frames in, generations out, heartbeats, timeouts.

The receive loop never waits on a generation: each ``generate`` runs in its own task, which
writes its frames to a stream log; the connection reads the log (a
:class:`~seedance.server.lifecycle.reader.Reading` whose sink, a :class:`Follower`, is pushed
every token) and sends them through its :class:`Outbound` queue, as does any other connection
that resumes the same generation. A ``cancel`` closes the engine's iterator, which stops the
engine; so does a disconnect of the last reader of a request that is not resumable.

A connection is in one :class:`State` at a time: ``OPEN`` (serving, reading no stream),
``STREAMING`` (reading a stream log), ``CLOSING`` (its close under way: queued frames flush
first, for at most :data:`CLOSE_FLUSH_TIMEOUT_S`), ``CLOSED``. Its keepalive is
:class:`~seedance.server.keepalive.Keepalive`'s: standard WebSocket pings until the client
speaks the binary heartbeat, and never idle while it streams a reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from msgspec import structs

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
from seedance.protocol.embeddings import embeddings_request, vector
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    CLOSE_IDLE_TIMEOUT,
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    EncryptionFailed,
    InternalError,
    InvalidRequest,
    SeedanceError,
    Unauthorized,
)
from seedance.protocol.messages import (
    HEARTBEAT_PING,
    HEARTBEAT_PONG,
    Cancel,
    ClientMessage,
    DoneFrame,
    Embed,
    EmbeddingsFrame,
    EmbeddingsUsage,
    EndSession,
    ErrorFrame,
    Generate,
    Ping,
    PongFrame,
    RequestId,
    Resume,
    StartFrame,
)
from seedance.protocol.tensors import (
    TENSOR,
    HeldTensors,
    Tensor,
    decode_tensor,
    encode_tensor,
    token_rows,
)
from seedance.server.keepalive import Action, Heartbeat, Keepalive
from seedance.server.lifecycle.admit import Requester, admit, new_request_id, prepare
from seedance.server.lifecycle.embed import embed
from seedance.server.lifecycle.reader import Reading
from seedance.server.outbound import Outbound, close_websocket
from seedance.server.transport import AsgiWebSocket
from seedance.sessions.session import Session
from seedance.streams.log import StreamLog
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from seedance.protocol.qos import QoS
    from seedance.server.lifecycle.generation import Generation
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.peers import Kind
    from seedance.server.lifecycle.refusals import Arrival
    from seedance.server.lifecycle.services import Services

logger = logging.getLogger(__name__)

# How long a close may wait for queued frames before the socket is dropped.
CLOSE_FLUSH_TIMEOUT_S = 5.0


def new_connection_id() -> str:
    return "c-" + secrets.token_hex(4)


class State(enum.Enum):
    OPEN = "open"
    STREAMING = "streaming"
    CLOSING = "closing"
    CLOSED = "closed"


class Follower:
    """A connection's sink of one generation's stream log: frames go out as they are logged."""

    __slots__ = ("behind", "connection", "log", "on_tokens", "out", "tokens")

    def __init__(self, connection: Connection, log: StreamLog, seq: int = 0) -> None:
        self.connection = connection
        self.out = out = connection.out
        self.log = log
        self.tokens = out.token_stream(log.request_id)
        self.tokens.seq = seq  # the first token this reader lacks
        self.tokens.logprobs = log.logprobs
        self.tokens.tensors, self.tokens.token_ids = log.tensors, log.token_ids
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
        if frame is None and getattr(self.log, "lost", False):
            # Another node runs it now: this client reconnects and resumes there.
            self.connection.close(CLOSE_GOING_AWAY, "the stream moved to another node")

    def stop(self) -> None:
        """No longer this connection's stream."""
        if self.out.watcher == self._watch:
            self.out.watcher = None
        if self.behind:
            self.behind = False
            self.log.set_behind(False)
        self.connection._stream_over(self)


class Connection:
    """One ``/v2/infer`` connection (a :class:`~seedance.server.lifecycle.peers.Peer`)."""

    kind: Kind = "infer"

    def __init__(
        self,
        services: Services,
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
        self.services = services
        self.principal = principal
        self.tenant = principal.name
        self.quotas = principal.tenant.quotas
        #: The model's frame limits; requests without max_tokens get at most the tenant's.
        self.limits = model.limits.capped(self.quotas.max_tokens)
        self.config = config = services.config
        self.ws = ws
        self.session = session
        self.model = model
        self.peer = peer
        self.id = connection_id or new_connection_id()
        self.name = f"conn {self.id}"
        #: The client's trace context from the handshake: the parent of requests' spans.
        self.trace_parent = trace_parent
        self.trace = services.tracing.connection(trace_parent, self._span_attributes)
        #: Who asks, for every generation this connection starts.
        self.requester = Requester(
            principal, model, "websocket", session, self.id, self.trace, qos, channel is not None
        )
        self.out = Outbound(
            ws,
            max_pending_bytes=config.max_pending_bytes,
            on_overflow=self._on_overflow,
            on_failure=self._on_writer_failure,
            merger=services.merger,
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
        self.keepalive = Keepalive(
            config.heartbeat_interval_s,
            config.idle_timeout_s,
            config.write_timeout_s,
            self.opened_at,
            # Standard pings where the server can send them: every client answers those.
            Heartbeat.CONTROL if ws.can_ping else Heartbeat.BINARY,
        )
        self._ping_sent_clock = 0.0  # time.monotonic(), for the round trip
        self.last_rtt_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.state = State.OPEN
        self._reading: Reading | None = None  # the stream this connection reads
        self._run_task: asyncio.Task[object] | None = None
        self._failure_close: asyncio.Future[None] | None = None  # the 1011 after a fault
        self.close_code: int | None = None
        self.requests = 0
        self._deferred = 0  # messages left to the receive loop, to keep their order
        self._embeddings: set[asyncio.Task[None]] = set()  # embed frames being answered
        self._tensors = HeldTensors(max_bytes=self.config.max_frame_bytes)  # requests' inputs
        ws.on_pong(self._on_control_pong)

    @property
    def scope(self) -> Mapping[str, Any]:
        return self.ws.scope

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve until the client or the server closes the connection."""
        self._run_task = asyncio.current_task()
        self.services.metrics.connections_opened.inc()
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
            if self.state is not State.CLOSING:
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
                self.keepalive.inbound(self._loop.time())
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
        self.keepalive.inbound(self._loop.time())
        try:
            text: str | bytes | None = data if is_text else None
            if self.channel is not None:
                text = self._open(data, is_text)
                if isinstance(text, bytes):  # an opened tensor frame
                    data, text = text, None
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
                if isinstance(text, bytes):  # an opened tensor frame
                    data, text = text, None
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

    def _open(self, data: str | bytes, is_text: bool) -> str | bytes | None:
        """An inbound frame of an encrypted connection: a sealed frame's JSON text, or its
        tensor frame (bytes); None for a heartbeat; anything else fails the connection."""
        assert self.channel is not None
        if is_text or not isinstance(data, bytes) or data[:1] == bytes((TENSOR,)):
            what = "a text frame" if is_text else "a tensor frame in the clear"
            raise EncryptionFailed(
                "plaintext", f"this connection encrypts every frame: {what} was refused"
            )
        if data[:1] != bytes((SEALED,)):
            return None  # a heartbeat, or a frame the binary path refuses
        return self.channel.open(data)

    def fail(self, error: SeedanceError) -> None:
        """Send ``error``; close the connection if the error closes it."""
        if isinstance(error, EncryptionFailed) and self.state is not State.CLOSING:
            self.services.metrics.encryption_failures.labels(error.reason or "").inc()
            logger.warning(
                "conn %s: end-to-end encryption failed (%s): %s; closing",
                self.id,
                error.reason,
                error.message,
            )
        self.out.put(encode_error(error))
        if error.close_code is not None:
            self.close(error.close_code, error.code)

    def shut_out(self, error: Unauthorized) -> None:
        """Its credential stopped passing: the error, then the close (4401); what it reads
        stops as a disconnect would stop it."""
        self.fail(error)

    def _on_error(self, exc: Exception) -> None:
        """A frame refused (reported as every refusal is) or a fault of ours."""
        if isinstance(exc, SeedanceError):
            self.services.refusals.refuse(self._arrival(exc.request_id), exc)
            self.fail(exc)
            return
        reference = self.id + "-" + secrets.token_hex(3)
        logger.error("conn %s: failed on a frame (ref %s)", self.id, reference, exc_info=exc)
        self.out.put(encode_error(InternalError(f"internal error (ref {reference})")))

    async def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._embeddings):  # nobody to answer
            task.cancel()
        await self._leave_stream()  # a disconnect: the last reader's leaving may abort it
        await self.out.stop()
        self.state = State.CLOSED
        duration = self._loop.time() - self.opened_at
        code = "1006" if self.close_code is None else str(self.close_code)
        self.services.metrics.connections_closed.labels(code).inc()
        self.trace.end(self.close_code, self.requests)
        self.services.audit.submit(lambda: self._audit_record(duration))
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
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self.state = State.CLOSING
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
        return self.state is State.OPEN

    @property
    def movable(self) -> bool:
        """Reads a resumable stream: in a cluster, its client can resume it on another node."""
        reading = self._reading
        return self.state is State.STREAMING and reading is not None and reading.log.resumable

    def going_away(self) -> None:
        self.close(CLOSE_GOING_AWAY, "server shutting down")

    async def shutdown(self) -> None:
        """Server shutdown: cancel what still runs (its ``done`` says so), then close 1001."""
        await self._stop_generation(silent=False)
        self.going_away()

    def _abort(self, why: str) -> None:
        if self._run_task is not None and self._run_task.done():
            return  # already over
        logger.warning("conn %s dropped: %s", self.id, why)
        if self.close_code is None:
            self.close_code = 1006
        if self.state is not State.CLOSED:
            self.state = State.CLOSING
        if not self.ws.abort() and self._run_task is not None:
            self._run_task.cancel()  # no way to drop the socket: stop serving it

    def _on_overflow(self) -> None:
        self._abort(f"client not reading: over {self.config.max_pending_bytes} bytes held")

    def _on_writer_failure(self, exc: BaseException) -> None:
        """The writer of this connection failed (a fault of ours, not the client going away):
        say so in the log with the connection and the request it was writing, and end the
        connection with 1011 (the close frame sent past the failed writer)."""
        reading = self._reading
        request = reading.log.request_id if reading is not None else "-"
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
            elif generation is None:  # one this connection reads, running elsewhere
                reading = self._reading
                request_id = message.request_id or (reading and reading.log.request_id)
                if request_id:
                    self.services.generations.cancel(
                        self.tenant, self.session.session_id, request_id
                    )
        elif isinstance(message, Embed):
            task = asyncio.create_task(self._embed(message))
            self._embeddings.add(task)
            task.add_done_callback(self._embeddings.discard)

    def _on_binary(self, data: bytes) -> None:
        check_frame_size(data, self.config.max_frame_bytes)
        kind = classify_binary(data)  # a frame that is neither a heartbeat nor a tensor: refused
        if kind == "tensor":  # an input of a request still to come: held for it
            self._tensors.add(decode_tensor(data))
            return
        self.keepalive.spoke_binary()
        if kind == "ping":
            self.out.put(HEARTBEAT_PONG)
        elif self.keepalive.ping_sent_at is not None:
            self._rtt(time.monotonic() - self._ping_sent_clock)

    def _on_control_pong(self) -> None:
        """The client answered a standard ping frame."""
        if self.keepalive.ping_sent_at is not None:
            self._rtt(time.monotonic() - self._ping_sent_clock)

    def _rtt(self, rtt_s: float) -> None:
        self.last_rtt_s = rtt_s
        self.keepalive.ping_sent_at = None
        self.services.metrics.heartbeat_rtt.observe(rtt_s)

    async def _end_session(self) -> None:
        generation = self._running()
        if generation is not None:
            generation.cancel(silent=True)
        services = self.services
        await services.streams.forget(self.tenant, self.session.session_id)
        await services.sessions.delete(self.session)
        logger.info("session %s ended by client (conn %s)", self.session.session_id, self.id)
        self.close(CLOSE_NORMAL, "session ended")

    async def end_session_by_admin(self) -> None:
        """An administrator ended the session: what runs is cancelled (its ``done`` says so),
        then the connection closes with 1000."""
        await self._stop_generation(silent=False)
        self.close(CLOSE_NORMAL, "session ended by an administrator")

    async def _embed(self, message: Embed) -> None:
        """An ``embed`` frame, beside whatever streams (it needs no session turn): its
        ``embeddings`` frame, or its error; reported as every API reports one."""
        request_id = RequestId(message.request_id) if message.request_id else new_request_id()
        tensors = self._tensors.take(request_id)
        arrival = self._arrival(request_id, operation="embeddings")
        arrival.model = None  # the embedding model, once chosen
        services = self.services
        try:
            tensor = claim(tensors, message.input_tensor, "input_tensor")
            rows = None if tensor is None else token_rows(tensor, "input_tensor")
            done = await embed(services, arrival, embeddings_request(message, rows))
        except asyncio.CancelledError:  # the connection closed first
            services.refusals.answered(arrival, "aborted")
            raise
        except Exception as exc:
            self._refuse(arrival, exc)
            return
        usage = EmbeddingsUsage(prompt_tokens=done.tokens, total_tokens=done.tokens)
        frame = EmbeddingsFrame(request_id=request_id, model=done.model.name, usage=usage)
        if message.encoding_format == "tensor":
            self.out.put(encode_tensor(Tensor(request_id, "embedding", done.vectors)))
            frame.tensors = ["embedding"]
        else:
            frame.data = [vector(v, message.encoding_format) for v in done.vectors]
        self.out.put(encode_frame(frame))
        self.requests += 1
        services.refusals.answered(arrival, "embedded", done.tokens)

    # ------------------------------------------------------------------ generations

    def _start_generation(self, message: Generate) -> None:
        # When the frame was read (it is handled as it is parsed). Request timings use
        # time.monotonic(): uvloop's loop.time() counts whole milliseconds.
        received = time.monotonic()
        request_id = RequestId(message.request_id) if message.request_id else new_request_id()
        parent, bad_parent = self.trace_parent, None
        if message.traceparent:
            try:
                parent = Tracing.from_field(message.traceparent)
            except SeedanceError as exc:  # the refusal is this field's
                bad_parent = exc
        services = self.services
        arrival = self._arrival(request_id, parent, received)
        try:
            if bad_parent is not None:
                raise bad_parent
            tensor = claim(self._tensors.take(request_id), message.prompt_tensor, "prompt_tensor")
            if tensor is not None:
                rows = token_rows(tensor, "prompt_tensor")
                if len(rows) != 1:
                    raise InvalidRequest("prompt_tensor: one prompt, shape [tokens] or [1, tokens]")
                message = structs.replace(message, prompt_ids=rows[0], prompt_tensor=None)
            # The version served now (a reload may have swapped one in since the last).
            served, message = prepare(
                services, arrival, self.model.name, self.session.session_id, message
            )
            if served is not self.model:
                self.model = served
                self.limits = served.limits.capped(self.quotas.max_tokens)
                # A new requester: a running generation keeps its own (and its version's).
                self.requester = dataclasses.replace(self.requester, model=served)
            generation = admit(services, arrival, self.requester, message)
        except Exception as exc:
            self._refuse(arrival, exc)
            return
        self._read(generation.log, generation)
        self.requests += 1

    def _refuse(self, arrival: Arrival, exc: Exception) -> None:
        """A request frame not admitted (or failed on the way): reported as every refusal is,
        and its error sent; anything but a :class:`SeedanceError` is a fault of ours, logged
        with its traceback and sent as ``internal_error``."""
        request_id = arrival.request_id
        error = exc if isinstance(exc, SeedanceError) else None
        if error is None:
            logger.error("request %s failed", request_id, exc_info=exc)
            error = InternalError(f"internal error on request {request_id}")
        error.request_id = request_id
        self.services.refusals.refuse(arrival, error)
        self.fail(error)

    def _arrival(
        self,
        request_id: str | None,
        parent: Context | None = None,
        received: float | None = None,
        operation: str = "chat",
    ) -> Arrival:
        """A frame of this connection, as it was read: what its span and report name (its
        parent: ``parent``, else the handshake's ``traceparent``, parsed once)."""
        arrival = self.services.refusals.arrive(
            "websocket",
            self.ws.scope,
            operation,
            request_id=request_id,
            parent=parent if parent is not None else self.trace_parent,
            received=received,
            link=self.trace,
            path="/v2/infer",
        )
        arrival.principal, arrival.model = self.principal, self.model
        arrival.connection_id, arrival.session_id = self.id, self.session.session_id
        return arrival

    def _read(self, log: StreamLog, generation: Generation | None, after_seq: int = -1) -> None:
        """Follow ``log`` from ``after_seq``: its frames go out as they are logged."""
        follower = Follower(self, log, after_seq + 1)
        reading = Reading(log, generation, after_seq, follower)
        self._reading = reading
        if log.running and self.state is State.OPEN:
            self.state = State.STREAMING
            self.keepalive.stream_started(self._loop.time())
        try:
            reading.__enter__()
        except BaseException:
            follower.stop()  # a cursor the log refused: this connection reads nothing
            raise

    def _stream_over(self, follower: Follower) -> None:
        """The stream ``follower`` read is over for this connection (ended, or left)."""
        reading = self._reading
        if reading is None or reading.sink is not follower:
            return
        self._reading = None
        if self.state is State.STREAMING:
            self.state = State.OPEN
        now = self._loop.time()
        self.keepalive.stream_ended(now)
        # The idle timeout counts again, from now; a timer due sooner looks then, and arms the
        # next (replacing it at every reply's end would fill the loop's heap with cancelled ones).
        timer = self._timer
        if timer is not None and self.keepalive.due(now, self.out.stalled_since) < timer.when():
            timer.cancel()
            self._arm_timer()

    def _running(self) -> Generation | None:
        """The session's running generation (started here or on another connection)."""
        return self.services.generations.running_on(self.session)

    async def _resume(self, message: Resume) -> None:
        """Follow a generation of this session from the token after ``after_seq``."""
        if self._reading is not None:
            raise InvalidRequest(
                f"this connection is reading {self._reading.log.request_id}; "
                "resume another stream once it is done",
                request_id=message.request_id,
            )
        self.services.access.check_resume(self.principal, self.peer, e2e=self.channel is not None)
        session_id = self.session.session_id
        log = await self.services.streams.find(
            self.tenant, session_id, message.request_id, message.epoch
        )
        self._read(log, self._running(), message.after_seq)
        logger.info(
            "conn %s resumed %s after seq %d (%s)",
            self.id,
            message.request_id,
            message.after_seq,
            "live" if log.running else "done",
        )

    def _leave_stream_soon(self) -> Reading | None:
        """Stop reading; the generation decides what that means (see ``reader_left``)."""
        reading = self._reading
        if reading is None:
            return None
        reading.close()
        reading.sink.stop()  # type: ignore[attr-defined]
        return reading

    async def _leave_stream(self) -> None:
        """Stop reading, and wait for the generation if that aborted it."""
        reading = self._leave_stream_soon()
        generation = reading.running if reading is not None else None
        if generation is None or generation.task is None:
            return
        log = generation.log
        if not log.resumable and not log.readers:
            await asyncio.gather(generation.task, return_exceptions=True)

    async def _stop_generation(self, *, silent: bool) -> None:
        """Cancel the generation this connection reads and wait until it has ended."""
        reading = self._reading
        generation = reading.running if reading is not None else None
        if generation is not None and generation.task is not None:
            generation.cancel(silent=silent)
            await asyncio.gather(generation.task, return_exceptions=True)

    # ------------------------------------------------------------------ heartbeats and timeouts

    def _arm_timer(self) -> None:
        due = self.keepalive.due(self._loop.time(), self.out.stalled_since)
        self._timer = self._loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        keepalive = self.keepalive
        now = self._loop.time()
        keepalive.inbound(self.ws.last_control_frame_at())
        action = keepalive.on_timer(now, self.out.stalled_since)
        if action is Action.CUT_OFF:
            self._abort(f"client not reading: nothing written for {keepalive.write_timeout_s:g} s")
            return
        if self.state is State.CLOSING:
            return  # close() bounds its own flush
        if action is Action.CLOSE_IDLE:
            logger.info("conn %s idle for %.1f s: closing", self.id, now - keepalive.active_since)
            self.close(CLOSE_IDLE_TIMEOUT, "idle timeout")
            return
        if action is Action.PING:
            self._ping_sent_clock = time.monotonic()
            if keepalive.heartbeat is Heartbeat.BINARY or not self.ws.ping():
                keepalive.spoke_binary()  # no ping frames here: the binary heartbeat then
                self.out.put(HEARTBEAT_PING)
        self._arm_timer()


def claim(tensors: Mapping[str, Tensor], name: str | None, field: str) -> Tensor | None:
    """The tensor a request's ``field`` names among those sent for it (None: it names none);
    a tensor sent for the request but not used, or one named but not sent, is refused."""
    if name is not None and name not in tensors:
        raise InvalidRequest(f"{field}: no tensor frame {name!r} was sent for this request")
    unused = sorted(set(tensors) - {name})
    if unused:
        raise InvalidRequest(
            f"tensor frame(s) {', '.join(map(repr, unused))} sent for this request, which "
            f"does not use them"
        )
    return None if name is None else tensors[name]
