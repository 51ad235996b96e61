"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Same engines, admission queue, limits and cancellation as ``/v2/infer``, without sessions: the
request carries the whole conversation. Streaming replies are Server-Sent Events (``data:``
chunks, ``data: [DONE]``, ``stream_options.include_usage``). A client that drops the connection
aborts the generation at once, also while it waits for admission or for its first token.

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
from typing import TYPE_CHECKING, Any, Final

import msgspec

from seedance.engines.base import GenerationRequest, SamplingParams, TokenDelta
from seedance.observability.audit import kinds as audit
from seedance.observability.audit.records import json_text, text_sha256
from seedance.observability.logs import bind_request
from seedance.observability.metrics import RequestMeter
from seedance.observability.tracing import Attributes, Tracing, request_attributes
from seedance.protocol.codec import FrameLimits
from seedance.protocol.errors import (
    EngineError,
    InternalError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    SeedanceError,
)
from seedance.protocol.messages import FinishReason, RequestId, ms
from seedance.protocol.openai import OpenAIRequest, decode_chat, decode_completion, error_body
from seedance.server.errors import error_headers
from seedance.server.state import ServedModel, ServerState
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal, refusal_record
from seedance.tenants.policy import check_model, check_priority

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_encode = msgspec.json.Encoder().encode
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _Disconnected(Exception):
    """The client went away."""


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
        call = HttpCall(self, request_id, scope, send)
        bind_request(request_id, call.trace.trace_id)  # for this task and those it starts
        try:
            # The door first: a caller that is not let in costs no body read and no parse.
            call.principal = authenticate_http(self.state, scope)
            call.authenticated = True
            body = await _read_body(receive, self.state.config.max_frame_bytes)
        except _Disconnected:
            call.ended()
            return
        except SeedanceError as exc:
            await call.fail(exc)
            call.ended()
            return
        call.work = work = asyncio.create_task(call.run(body))
        watcher = asyncio.create_task(_wait_disconnect(receive))
        calls = self.state.http_calls
        calls.add(call)
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:  # the client left: abort the generation behind it
                work.cancel()
                call.outcome = call.outcome or "aborted"
            else:
                watcher.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)
            if call.interrupted is not None and work.cancelled() and watcher not in done:
                with contextlib.suppress(OSError):  # the client left meanwhile
                    await call.fail(call.interrupted)  # shutdown: the reply still ends well
        finally:
            calls.discard(call)
        call.ended()


class HttpCall:
    """One HTTP request, from its body to the last byte of its response."""

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        request_id: RequestId,
        scope: Scope,
        send: Send,
    ) -> None:
        self.endpoint = endpoint
        self.scope = scope
        self.authenticated = False
        self.parts: list[str] = []  # the reply, for its hash in the audit record
        self._audited = False
        self._counted = False  # the metrics have the request (see _count)
        self.state = endpoint.state
        self.request_id = request_id
        self.send = send
        self.started = False  # response headers sent
        self.received = time.monotonic()
        self.model: ServedModel | None = None
        self.request: OpenAIRequest | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.admitted_at: float | None = None
        self.outcome = ""
        self.error: SeedanceError | None = None
        self.meter: RequestMeter | None = None
        self.principal = OPEN_PRINCIPAL
        self.work: asyncio.Task[None] | None = None  # run(), once the body is read
        self.interrupted: SeedanceError | None = None  # why the server stopped it
        self.trace = self.state.tracing.request(
            endpoint.operation,
            Tracing.from_headers(scope.get("headers", ())),
            self.received,
            self._span_attributes,
        )
        self._trace_header = (b"traceparent", self.trace.traceparent.encode())

    async def run(self, body: bytes) -> None:
        try:
            tenant = self.principal.tenant
            limits = self.endpoint.limits.capped(tenant.quotas.max_tokens)
            self.request = request = self.endpoint._decode(body, limits)
            self.model = model = self.state.resolve_model(request.model)
            check_model(self.principal, model.name, self.state.models)
            check_priority(self.principal, request.generate.priority)
            self.meter = RequestMeter(
                self.state.metrics,
                model.name,
                model.engine.info.engine,
                self.principal.name,
                self.received,
                self.trace.token_times,
            )
            if model.limits.max_tokens < request.generate.max_tokens:
                raise InvalidRequest(f"max_tokens must be between 1 and {model.limits.max_tokens}")
            if self.state.draining:
                raise Overloaded("the server is shutting down; retry on another server")
            self.state.check_audit()
            engine = model.engine
            messages = request.messages
            raw = request.kind == "completion"
            self.prompt_tokens = engine.prompt_tokens(messages, raw=raw)
            usage = self.state.usage
            usage.start_request(
                tenant.name, tenant.quotas, self.prompt_tokens, request.generate.max_tokens
            )
            try:
                await model.admission.acquire(
                    request.generate.priority, tenant=tenant.name, weight=tenant.tier
                )
                self.admitted_at = time.monotonic()
                self.meter.admitted(self.admitted_at, self.prompt_tokens)
                try:
                    await self._generate(model, request)
                finally:
                    model.admission.release()
            finally:
                usage.end_request(tenant.name, self.completion_tokens)
        except asyncio.CancelledError:
            raise
        except SeedanceError as exc:
            await self.fail(exc)
        except Exception:
            logger.exception("request %s failed", self.request_id)
            await self.fail(InternalError(f"internal error on request {self.request_id}"))

    async def _generate(self, model: ServedModel, request: OpenAIRequest) -> None:
        message = request.generate
        generation = GenerationRequest(
            request_id=self.request_id,
            messages=request.messages,
            params=SamplingParams.of(message, request.unset),
            prompt_tokens=self.prompt_tokens,
            priority=message.priority,
            raw=request.kind == "completion",
        )
        chunks = _Chunks(request, self.request_id, model.name)
        parts = self.parts
        finish: FinishReason = "stop"
        stream = model.engine.generate(generation)
        meter = self.meter
        assert meter is not None
        try:
            async for delta in stream:
                if delta.tokens:
                    meter.tokens(time.monotonic(), delta.tokens)
                self.completion_tokens += delta.tokens
                parts.append(delta.text)
                if request.stream:
                    await self._stream_delta(chunks, delta)
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                    break
        except (asyncio.CancelledError, SeedanceError):
            raise
        except Exception as exc:
            logger.exception("engine failed on request %s", self.request_id)
            raise EngineError(f"the model failed on request {self.request_id}; retry") from exc
        finally:
            await stream.aclose()
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        self.outcome = finish
        await self._audit()  # the reply ends once its record is on disk
        self._count()
        if request.stream:
            await self._stream_end(chunks, finish, usage)
        else:
            await self._respond(200, _JSON_HEADERS, chunks.whole("".join(parts), finish, usage))

    async def _stream_delta(self, chunks: _Chunks, delta: TokenDelta) -> None:
        if not self.started:
            await self._start(200, _SSE_HEADERS)
            if chunks.request.kind == "chat":  # the role comes first, as OpenAI sends it
                await self._event(chunks.delta({"role": "assistant", "content": ""}))
        if delta.text:
            await self._event(chunks.delta(delta.text))

    async def _stream_end(self, chunks: _Chunks, finish: str, usage: dict[str, int]) -> None:
        if not self.started:
            await self._start(200, _SSE_HEADERS)
        await self._event(chunks.delta(None, finish))
        if chunks.request.include_usage:
            await self._event(chunks.usage(usage))
        await self.send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def interrupt(self, error: SeedanceError) -> None:
        """Stop the generation (the server is shutting down); the client gets ``error``."""
        if self.work is not None and not self.work.done():
            self.interrupted = error
            self.work.cancel()

    async def fail(self, error: SeedanceError) -> None:
        self.outcome = error.code
        self.error = error
        with contextlib.suppress(Overloaded):  # an error goes out audited or not
            await self._audit()
        self._count()
        if not self.started:
            headers = [*_JSON_HEADERS, *error_headers(error)]
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

    async def _event(self, data: bytes) -> None:
        await self.send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
        )

    async def _respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await self._start(status, [*headers, (b"content-length", str(len(body)).encode())])
        await self.send({"type": "http.response.body", "body": body})

    @property
    def first_token_at(self) -> float | None:
        return self.meter.first_token if self.meter is not None else None

    async def _audit(self) -> None:
        """Write this request's record; with ``--audit-fsync record``, wait until it is on
        disk (when it cannot be written and the log is required: ``overloaded``)."""
        if self._audited:
            return
        self._audited = True
        await self.state.audited(self._audit_record, f"request {self.request_id}")

    def _audit_record(self) -> audit.AuditRecord:
        if not self.authenticated:
            error = self.error or InternalError("refused")
            return refusal_record("http", self.scope, None, error)
        model, request = self.model, self.request
        prompt: Any = None
        if request is not None:
            prompt = [{"role": m.role, "content": m.content} for m in request.messages]
        timing_end = time.monotonic()
        return audit.Request(
            api="http",
            tenant=self.principal.name,
            credential=self.principal.credential,
            request_id=self.request_id,
            trace_id=self.trace.trace_id,
            model=model.name if model is not None else None,
            model_version=model.engine.info.version if model is not None else None,
            engine=model.engine.info.engine if model is not None else None,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            prompt_sha256=text_sha256(json_text(prompt)) if prompt is not None else None,
            completion_sha256=text_sha256("".join(self.parts)),
            outcome=self.outcome or "aborted",
            queue_ms=_ms(self.admitted_at, self.received),
            ttft_ms=_ms(self.first_token_at, self.received),
            total_ms=_ms(timing_end, self.received),
        )

    def _count(self) -> None:
        """The request's metrics, once: before its last bytes go out when it ends well or
        with an error, so that a client holding its reply finds it counted."""
        if self.meter is not None and not self._counted:
            self._counted = True
            self.meter.ended(time.monotonic(), self.outcome or "aborted")

    def ended(self) -> None:
        """The response is over: metrics, the trace, the log line, and the audit record if
        the request ended without one (the client left)."""
        if not self._audited:
            self._audited = True
            self.state.audit_submit(self._audit_record)
        self._count()
        self._end_trace()
        self.log()

    def _span_attributes(self) -> Attributes:
        return {
            "gen_ai.operation.name": self.endpoint.operation,
            "seedance.tenant": self.principal.name,
            "seedance.request_id": self.request_id,
            "http.request.method": "POST",
            "url.path": self.endpoint.path,
        }

    def _end_trace(self) -> None:
        trace = self.trace
        if trace.span is None:
            return
        attributes: dict[str, str | int | float] = {
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "gen_ai.response.id": self.request_id,
        }
        model, request = self.model, self.request
        if model is not None:
            attributes["gen_ai.request.model"] = model.name
            attributes["gen_ai.response.model"] = model.name
            attributes["seedance.engine"] = model.engine.info.engine
            trace.span.update_name(f"{self.endpoint.operation} {model.name}")
        if request is not None:
            attributes.update(request_attributes(request.generate))
        error = self.error
        trace.end(
            received=self.received,
            admitted=self.admitted_at,
            first_token=self.first_token_at,
            last_token=self.meter.last_token if self.meter is not None else None,
            outcome=self.outcome or "aborted",
            error=None if error is None else (error.code, error.message),
            attributes=attributes,
        )

    def log(self) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        ttft = (
            "-"
            if self.first_token_at is None
            else f"{(self.first_token_at - self.received) * 1000:.1f}"
        )
        logger.info(
            "request %s http=%s tenant=%s model=%s outcome=%s prompt_tokens=%d "
            "completion_tokens=%d ttft_ms=%s total_ms=%.1f",
            self.request_id,
            self.endpoint.kind,
            self.principal.name,
            self.model.name if self.model else "-",
            self.outcome or "aborted",
            self.prompt_tokens,
            self.completion_tokens,
            ttft,
            (now - self.received) * 1000,
        )


class _Chunks:
    """OpenAI's response objects for one request."""

    def __init__(self, request: OpenAIRequest, request_id: str, model: str) -> None:
        self.request = request
        self.chat = request.kind == "chat"
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
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


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
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
