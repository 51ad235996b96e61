"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Same engines, admission, limits and request lifecycle as ``/v2/infer``
(:func:`seedance.server.requests.admit`), without sessions: the request carries the whole
conversation. The response is a reader of the generation's stream log, as a WebSocket
connection is. Streaming replies are Server-Sent Events (``data:`` chunks, ``data: [DONE]``,
``stream_options.include_usage``). A client that drops the connection aborts the generation
at once, also while it waits for admission or for its first token, unless the request asked
to survive it (``"seedance": {"resumable": true}``): its events then carry
``id: <request id>:<seq>`` and ``GET /v1/streams/{request id}`` with ``Last-Event-ID`` reads
the rest.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status each Seedance error names (``http_status``); ``code`` is the Seedance error code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol

import msgspec

from seedance.observability.audit import kinds as audit
from seedance.observability.logs import bind_request
from seedance.observability.tracing import Attributes, Tracing, request_attributes
from seedance.protocol.codec import FrameLimits
from seedance.protocol.errors import (
    InternalError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    SeedanceError,
    error_from_wire,
)
from seedance.protocol.messages import DoneFrame, ErrorFrame, RequestId, StartFrame, ms
from seedance.protocol.openai import OpenAIRequest, decode_chat, decode_completion, error_body
from seedance.protocol.qos import qos_from_headers
from seedance.server.errors import error_headers
from seedance.server.requests import Generation, Prompt, Requester, admit
from seedance.server.state import ServedModel, ServerState
from seedance.streams.log import StreamLog
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal, refusal_record
from seedance.tenants.policy import check_model

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_encode = msgspec.json.Encoder().encode
JSON_HEADERS: Final = [(b"content-type", b"application/json")]
SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: Reply text waiting for a response's socket past which the generation waits (backpressure).
HIGH_WATER_BYTES: Final = 64 * 1024
SHUTTING_DOWN: Final = "the server is shutting down; retry on another server"


class Disconnected(Exception):
    """The client went away."""


class HttpEndpoint(Protocol):
    """What an :class:`HttpCall` knows of the endpoint it serves."""

    kind: str  # for the log line
    operation: str  # the trace's operation name
    path: str


class OpenAIEndpoint:
    """One of the two endpoints, as a plain ASGI app (it watches for disconnects itself)."""

    def __init__(self, state: ServerState, kind: str) -> None:
        self.state = state
        self.kind = kind
        self.operation = "chat" if kind == "chat" else "text_completion"
        self.path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        self._decode = decode_chat if kind == "chat" else decode_completion
        # Bodies are checked against the largest model limit, then against the chosen model.
        self.limits = FrameLimits(
            max_frame_bytes=state.config.max_frame_bytes,
            max_tokens=max(m.limits.max_tokens for m in state.models.values()),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = RequestId(
            ("chatcmpl-" if self.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        )
        call = HttpCall(self.state, request_id, scope, send, self)
        await call.answer(receive, call.run)


class HttpCall:
    """One HTTP request, from its body to the last byte of its response.

    Refusals before a generation starts are reported here (metrics, trace, audit, log line);
    an admitted request's are its :class:`~seedance.server.requests.Generation`'s.
    """

    def __init__(
        self,
        state: ServerState,
        request_id: RequestId,
        scope: Scope,
        send: Send,
        endpoint: HttpEndpoint | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.operation = endpoint.operation if endpoint is not None else "stream"
        self.path = endpoint.path if endpoint is not None else scope.get("path", "")
        self.scope = scope
        self.authenticated = False
        self._audited = False
        self.state = state
        self.request_id = request_id
        self.send = send
        self.started = False  # response headers sent
        self.received = time.monotonic()
        self.model: ServedModel | None = None
        self.request: OpenAIRequest | None = None
        self.outcome = ""
        self.error: SeedanceError | None = None
        self.principal = OPEN_PRINCIPAL
        self.generation: Generation | None = None
        self.trace = state.tracing.request(
            self.operation,
            Tracing.from_headers(scope.get("headers", ())),
            self.received,
            self._span_attributes,
        )
        self._trace_header = (b"traceparent", self.trace.traceparent.encode())

    async def answer(self, receive: Receive, run: Callable[[bytes], Awaitable[None]]) -> None:
        """A POST: the caller checked, its body read, then ``run(body)`` served (:meth:`serve`);
        a refusal or a client gone before is answered and reported here."""
        bind_request(self.request_id, self.trace.trace_id)  # for this task and those it starts
        try:
            # The door first: a caller that is not let in costs no body read and no parse.
            self.principal = authenticate_http(self.state, self.scope)
            self.authenticated = True
            body = await read_body(receive, self.state.config.max_frame_bytes)
        except Disconnected:
            self.ended()
            return
        except SeedanceError as exc:
            await self.fail(exc)
            self.ended()
            return
        await self.serve(run(body), receive)

    async def serve(self, work: Awaitable[None], receive: Receive) -> None:
        """Run ``work`` (the response) while watching for the client leaving, which stops it."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.create_task(_wait_disconnect(receive))
        calls = self.state.http_calls
        calls.add(self)
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:  # the client left: stop reading the log (see reader_left)
                task.cancel()
                self.outcome = self.outcome or "aborted"
            else:
                watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        finally:
            calls.discard(self)
        self.ended()

    async def run(self, body: bytes) -> None:
        try:
            generation = self._admit(body)
        except Exception as exc:
            await self.fail(exc)
            return
        request = self.request
        assert request is not None
        generation.log.meta = {
            "kind": request.kind,
            "include_usage": request.include_usage,
            "created": int(time.time()),
            "model": generation.requester.model.name,
        }
        await self.relay(generation.log, generation)

    def _admit(self, body: bytes) -> Generation:
        endpoint = self.endpoint
        assert isinstance(endpoint, OpenAIEndpoint)
        state = self.state
        tenant = self.principal.tenant
        limits = endpoint.limits.capped(tenant.quotas.max_tokens)
        self.request = request = endpoint._decode(body, limits)
        self.model = model = state.resolve_model(request.model, self.request_id)
        check_model(self.principal, model.name, state.models)
        message = request.generate
        if model.limits.max_tokens < message.max_tokens:
            raise InvalidRequest(f"max_tokens must be between 1 and {model.limits.max_tokens}")
        raw = request.kind == "completion"
        messages = request.messages
        prompt = Prompt(
            messages,
            model.engine.prompt_tokens(messages, raw=raw),
            raw=raw,
            unset=request.unset,
        )
        qos = qos_from_headers(self.scope.get("headers", ()))
        requester = Requester(self.principal, model, "http", qos=qos)
        self.generation = generation = admit(
            state,
            requester,
            message,
            self.request_id,
            self.received,
            prompt=prompt,
            operation=endpoint.operation,
            trace=self.trace,
        )
        return generation

    async def relay(
        self, log: StreamLog, generation: Generation | None, after_seq: int = -1
    ) -> None:
        """Follow ``log`` from ``after_seq`` and write the response, to the log's end."""
        follower = HttpFollower(log, after_seq)
        log.attach(follower, after_seq)
        if generation is not None:
            generation.reader_joined()
        meta = log.meta
        assert meta is not None  # an OpenAI API request's log
        chunks = _Chunks(meta["kind"], log.request_id, meta["model"], meta["created"])
        ids = log.resumable
        try:
            while True:
                await follower.wait()
                if log.stream:
                    text, last_seq = follower.take()
                    if not self.started and text:  # headers with the first text
                        await self._start(200, SSE_HEADERS)
                        if chunks.chat:  # the role comes first, as OpenAI sends it
                            await self._event(chunks.delta({"role": "assistant", "content": ""}))
                    if text:
                        event_id = f"{log.request_id}:{last_seq}" if ids else None
                        await self._event(chunks.delta(text), event_id)
                if follower.ended:
                    break
        finally:
            log.detach(follower)
            follower.caught_up()
            if generation is not None:
                generation.reader_left()
        await self._finish(log, follower.end, chunks)

    async def _finish(
        self, log: StreamLog, end: DoneFrame | ErrorFrame | None, chunks: _Chunks
    ) -> None:
        """The response's last bytes: the reply's end, or its error."""
        if end is None:
            return
        if isinstance(end, ErrorFrame):
            body = end.error
            error = error_from_wire(
                body.code,
                body.message,
                request_id=end.request_id,
                retry_after_s=body.retry_after,
                reason=body.reason,
            )
            self.outcome = error.code
            await self._render_error(error)
            return
        if end.finish_reason == "cancelled":  # over HTTP only the server cancels: shutdown
            self.outcome = "overloaded"
            await self._render_error(Overloaded(SHUTTING_DOWN))
            return
        self.outcome = end.finish_reason
        usage = {
            "prompt_tokens": end.usage.prompt_tokens,
            "completion_tokens": end.usage.completion_tokens,
            "total_tokens": end.usage.total_tokens,
        }
        if log.stream:
            if not self.started:
                await self._start(200, SSE_HEADERS)
            await self._event(chunks.delta(None, end.finish_reason))
            if log.meta and log.meta.get("include_usage"):
                await self._event(chunks.usage(usage))
            await self.send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            whole = chunks.whole("".join(log.texts), end.finish_reason, usage)
            await self._respond(200, JSON_HEADERS, whole)

    async def fail(self, error: Exception) -> None:
        """Refused before a generation started: counted, audited, answered. Anything but a
        :class:`SeedanceError` is a fault of ours: logged with its traceback, answered as
        ``internal_error``."""
        if not isinstance(error, SeedanceError):
            logger.error("request %s failed", self.request_id, exc_info=error)
            error = InternalError(f"internal error on request {self.request_id}")
        self.outcome = error.code
        self.error = error
        self._audited = True
        with contextlib.suppress(Overloaded):  # an error goes out audited or not
            await self.state.audited(self._refusal_record, f"request {self.request_id}")
        if self.model is not None:
            self.state.count_refusal(self.model, self.principal.name, error.code)
        await self._render_error(error)

    async def _render_error(self, error: SeedanceError) -> None:
        if not self.started:
            headers = [*JSON_HEADERS, *error_headers(error)]
            await self._respond(error.http_status, headers, error_body(error))
            return
        # Mid-stream: the status is already 200; the error travels as an event, then the end.
        await self.send(
            {
                "type": "http.response.body",
                "body": b"data: " + error_body(error) + b"\n\ndata: [DONE]\n\n",
            }
        )

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        headers = [*headers, self._trace_header]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def _event(self, data: bytes, event_id: str | None = None) -> None:
        head = b"id: " + event_id.encode() + b"\n" if event_id is not None else b""
        await self.send(
            {
                "type": "http.response.body",
                "body": head + b"data: " + data + b"\n\n",
                "more_body": True,
            }
        )

    async def _respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await self._start(status, [*headers, (b"content-length", str(len(body)).encode())])
        await self.send({"type": "http.response.body", "body": body})

    def _refusal_record(self) -> audit.AuditRecord:
        if not self.authenticated:
            error = self.error or InternalError("refused")
            return refusal_record("http", self.scope, None, error)
        model = self.model
        return audit.Request(
            api="http",
            tenant=self.principal.name,
            credential=self.principal.credential,
            request_id=self.request_id,
            trace_id=self.trace.trace_id,
            model=model.name if model is not None else None,
            outcome=self.outcome or "aborted",
            total_ms=ms(time.monotonic() - self.received),
        )

    def ended(self) -> None:
        """The response is over. A refusal (or a client that left before it was admitted)
        gets its audit record, trace and log line here; an admitted request's generation
        reported them."""
        if self.generation is not None:
            return
        if not self._audited:
            self._audited = True
            self.state.audit_submit(self._refusal_record)
        self._end_trace()
        self.log()

    def _span_attributes(self) -> Attributes:
        return {
            "gen_ai.operation.name": self.operation,
            "seedance.tenant": self.principal.name,
            "seedance.request_id": self.request_id,
            "http.request.method": self.scope.get("method", "POST"),
            "url.path": self.path,
        }

    def _end_trace(self) -> None:
        trace = self.trace
        if trace.span is None:
            return
        attributes: dict[str, str | int | float] = {"gen_ai.response.id": self.request_id}
        model, request = self.model, self.request
        if model is not None:
            attributes["gen_ai.request.model"] = model.name
            attributes["seedance.engine"] = model.engine.info.engine
            trace.span.update_name(f"{self.operation} {model.name}")
        if request is not None:
            attributes.update(request_attributes(request.generate))
        error = self.error
        trace.end(
            received=self.received,
            admitted=None,
            first_token=None,
            last_token=None,
            outcome=self.outcome or "aborted",
            error=None if error is None else (error.code, error.message),
            attributes=attributes,
        )

    def log(self) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        logger.info(
            "request %s http=%s tenant=%s model=%s outcome=%s prompt_tokens=0 "
            "completion_tokens=0 ttft_ms=- total_ms=%.1f",
            self.request_id,
            self.endpoint.kind if self.endpoint is not None else "stream",
            self.principal.name,
            self.model.name if self.model else "-",
            self.outcome or "aborted",
            (time.monotonic() - self.received) * 1000,
        )


class HttpFollower:
    """An HTTP response reading a generation's log: the text waits here for the response's
    task, which takes all of it at once (so a slow client gets fewer, larger events)."""

    __slots__ = ("_texts", "_wake", "behind", "end", "ended", "last_seq", "log", "size")

    def __init__(self, log: StreamLog, after_seq: int = -1) -> None:
        self.log = log
        self._texts: list[str] = []
        self.size = 0
        self.last_seq = after_seq  # the seq of the last token taken or waiting
        self.behind = False
        self.ended = False
        self.end: DoneFrame | ErrorFrame | None = None
        self._wake = asyncio.Event()

    def on_start(self, frame: StartFrame) -> None:
        self._wake.set()

    def on_tokens(self, text: str, tokens: int) -> None:
        self._texts.append(text)
        self.size += len(text)
        self.last_seq += tokens
        self._wake.set()
        if self.size > HIGH_WATER_BYTES and not self.behind:
            self.behind = True
            self.log.set_behind(True)

    def on_end(self, frame: DoneFrame | ErrorFrame | None) -> None:
        self.ended = True
        self.end = frame
        self._wake.set()

    async def wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def take(self) -> tuple[str, int]:
        """The text waiting, and the seq of its last token."""
        text = "".join(self._texts)
        self._texts.clear()
        self.size = 0
        self.caught_up()
        return text, self.last_seq

    def caught_up(self) -> None:
        if self.behind:
            self.behind = False
            self.log.set_behind(False)


class StreamsEndpoint:
    """``GET /v1/streams/{request_id}``: the rest of a resumable reply, as Server-Sent Events.

    The cursor is the ``Last-Event-ID`` header (``<request id>:<seq>``, as the events carry it,
    and as a browser's ``EventSource`` sends it when it reconnects) or ``?after_seq=N``;
    without either the whole reply. Events after the cursor, then live, then the end.
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = RequestId(scope.get("path_params", {}).get("request_id", ""))
        call = HttpCall(self.state, request_id, scope, send)
        try:
            call.principal = authenticate_http(self.state, scope)
            call.authenticated = True
            after_seq = _cursor(scope, request_id)
            tenant = call.principal.name
            log = await self.state.streams.find(tenant, request_id, request_id, None)
            if log.meta is None or "kind" not in log.meta:  # a /v1/responses response
                raise InvalidRequest(
                    f"{request_id} is not a chat or completions reply; read a response's events "
                    "with GET /v1/responses/{id}?stream=true"
                )
        except SeedanceError as exc:
            exc.request_id = request_id
            await call.fail(exc)
            call.ended()
            return
        call.generation = generation = self.state.generations.get(request_id)
        call.outcome = "resumed"
        await call.serve(self._resume(call, log, generation, after_seq), receive)

    async def _resume(
        self, call: HttpCall, log: StreamLog, generation: Generation | None, after_seq: int
    ) -> None:
        try:
            await call.relay(log, generation, after_seq)
        except SeedanceError as exc:  # cursor_ahead, a cursor inside an event
            await call._render_error(exc)
            return
        logger.info("request %s resumed over http after seq %d", log.request_id, after_seq)


def _cursor(scope: Scope, request_id: str) -> int:
    """``after_seq`` from ``Last-Event-ID`` or the query (-1: from the start)."""
    headers = dict(scope.get("headers", ()))
    raw = headers.get(b"last-event-id")
    if raw is not None:
        text = raw.decode("latin-1")
        owner, sep, seq = text.rpartition(":")
        if not sep or owner != request_id or not seq.lstrip("-").isdigit():
            raise InvalidRequest(
                f"Last-Event-ID: expected {request_id}:<seq>, got {text!r}", request_id=request_id
            )
        return int(seq)
    query = scope.get("query_string", b"").decode("latin-1")
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == "after_seq":
            if not value.lstrip("-").isdigit() or int(value) < -1:
                raise InvalidRequest("after_seq: must be -1 or more", request_id=request_id)
            return int(value)
    return -1


class _Chunks:
    """OpenAI's response objects for one request."""

    def __init__(self, kind: str, request_id: str, model: str, created: int) -> None:
        self.chat = kind == "chat"
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }

    def delta(self, content: str | dict[str, str] | None, finish: str | None = None) -> bytes:
        if self.chat:
            if isinstance(content, dict):
                delta: dict[str, str] = content
            else:
                delta = {} if content is None else {"content": content}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        else:
            text = content if isinstance(content, str) else ""
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish
        return _encode({**self.head, "choices": [choice]})

    def usage(self, usage: dict[str, int]) -> bytes:
        return _encode({**self.head, "choices": [], "usage": usage})

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return _encode({**self.head, "object": kind, "choices": [choice], "usage": usage})


def authenticate_http(state: ServerState, scope: Mapping[str, Any]) -> Principal:
    """The caller of an HTTP request; refusals are counted."""
    try:
        return state.access.authenticate(scope)
    except SeedanceError as exc:
        state.metrics.refused(exc.code, "http")
        raise


def _ms(at: float | None, since: float) -> float | None:
    return None if at is None else ms(at - since)


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
