"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Same engines, admission, limits and request lifecycle as ``/v2/infer``
(:mod:`seedance.server.lifecycle`), without sessions: the request carries the whole
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

import logging
import secrets
import time
from typing import Any

import msgspec

from seedance.observability.tracing import request_attributes
from seedance.protocol.codec import FrameLimits
from seedance.protocol.errors import InvalidRequest, Overloaded, SeedanceError
from seedance.protocol.messages import (
    DoneFrame,
    ErrorFrame,
    RequestId,
    TokenLogprob,
    ToolCallTurn,
)
from seedance.protocol.openai import decode_chat, decode_completion
from seedance.protocol.qos import qos_from_headers
from seedance.protocol.tools import CallReader, kept, parse_tools
from seedance.server.http_call import (
    JSON_HEADERS,
    SSE_HEADERS,
    HttpCall,
    Receive,
    Scope,
    Send,
)
from seedance.server.lifecycle.admit import (
    Requester,
    admit,
    explicit_prompt,
    prepare,
    token_prompt,
)
from seedance.server.lifecycle.drain import SHUTTING_DOWN
from seedance.server.lifecycle.generation import Generation
from seedance.server.lifecycle.reader import Reading, end_error
from seedance.server.lifecycle.services import Services
from seedance.streams.log import StreamLog

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


class OpenAIEndpoint:
    """One of the two endpoints, as a plain ASGI app (it watches for disconnects itself)."""

    def __init__(self, services: Services, kind: str) -> None:
        self.services = services
        self.kind = kind
        self.operation = "chat" if kind == "chat" else "text_completion"
        self._decode = decode_chat if kind == "chat" else decode_completion

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        call = HttpCall(self.services, scope, send, self.operation, request_id)
        await call.answer(receive, lambda body: self.run(call, body))

    async def run(self, call: HttpCall, body: bytes) -> None:
        try:
            generation = self._admit(call, body)
        except Exception as exc:
            await call.fail(exc)
            return
        await relay(call, generation.log, generation)

    def _admit(self, call: HttpCall, body: bytes) -> Generation:
        services = self.services
        principal = call.principal
        # Bodies are read against the largest model limit, then held to the chosen model.
        limits = FrameLimits(services.config.max_frame_bytes, services.models.max_tokens)
        request = self._decode(body, limits.capped(principal.tenant.quotas.max_tokens))
        call.arrival.attributes = dict(request_attributes(request.generate))
        model, message = prepare(
            services,
            call.arrival,
            request.model,
            call.request_id,
            request.generate,
            unset=request.unset | ({"max_tokens"} if not request.max_tokens_given else set()),
            schema_field="response_format",
        )
        if message.prompt_ids is not None:
            prompt = token_prompt(model, message.prompt_ids, request.unset)
        else:
            prompt = explicit_prompt(
                model,
                request.messages,
                raw=request.kind == "completion",
                unset=request.unset,
                message=message,
            )
        qos = qos_from_headers(call.scope.get("headers", ()))
        requester = Requester(principal, model, "http", qos=qos)
        call.generation = generation = admit(
            services, call.arrival, requester, message, prompt=prompt
        )
        generation.log.meta = {
            "kind": request.kind,
            "include_usage": request.include_usage,
            "created": int(time.time()),
            "model": model.name,
        }
        if message.tools:  # the reply is read for calls
            generation.log.meta["tools"] = kept(message, model.engine.call_format)
        return generation


async def relay(
    call: HttpCall, log: StreamLog, generation: Generation | None, after_seq: int = -1
) -> None:
    """Follow ``log`` from ``after_seq`` and write the response, to the log's end."""
    meta = log.meta
    assert meta is not None  # an OpenAI API request's log
    chunks = _Chunks(meta["kind"], log.request_id, meta["model"], meta["created"])
    if "tools" in meta:
        tools = parse_tools(*meta["tools"])
        chunks.calls = None if tools is None else CallReader(tools, log.request_id)
    response = call.response
    first = after_seq + 1  # the seq of the next token to send
    if log.logprobs is not None:  # a resumed reply's offsets count the text already sent
        chunks.offset = sum(len(entry.token) for entry in log.logprobs[:first])
    if chunks.calls is not None and after_seq >= 0:  # what was sent, read again unsent
        whole, rest = "".join(log.texts[: log.entries]), log.missing(after_seq)
        chunks.calls.skip(whole[: len(whole) - len(rest[0] if rest else "")])
    with Reading(log, generation, after_seq) as reading:
        async for text, last_seq in reading:
            if not response.started:  # headers with the first text
                await response.start(200, SSE_HEADERS)
                if chunks.chat:  # the role comes first, as OpenAI sends it
                    await response.event(chunks.delta({"role": "assistant", "content": ""}))
            event_id = f"{log.request_id}:{last_seq}" if log.resumable else None
            logprobs = None if log.logprobs is None else log.logprobs[first : last_seq + 1]
            for event in chunks.events(text, logprobs):
                await response.event(event, event_id)
            first = last_seq + 1
    await _finish(call, log, reading.end, chunks)


async def _finish(
    call: HttpCall, log: StreamLog, end: DoneFrame | ErrorFrame | None, chunks: _Chunks
) -> None:
    """The response's last bytes: the reply's end, or its error."""
    if end is None:
        return
    if isinstance(end, ErrorFrame):
        error = end_error(end)
        call.outcome = error.code
        await call.render_error(error)
        return
    if end.finish_reason == "cancelled":  # over HTTP only the server cancels: shutdown
        call.outcome = "overloaded"
        await call.render_error(Overloaded(SHUTTING_DOWN))
        return
    call.outcome = end.finish_reason
    usage = {
        "prompt_tokens": end.usage.prompt_tokens,
        "completion_tokens": end.usage.completion_tokens,
        "total_tokens": end.usage.total_tokens,
    }
    response = call.response
    calls = end.tool_calls  # checked by the generation (a call it could not read: an error)
    finish = "tool_calls" if calls else end.finish_reason
    if log.stream:
        if not response.started:
            await response.start(200, SSE_HEADERS)
        await response.event(chunks.delta(None, finish, audit_seq=end.audit_seq))
        if log.meta and log.meta.get("include_usage"):
            await response.event(chunks.usage(usage))
        await response.write(b"data: [DONE]\n\n", more=False)
    else:
        text = "".join(log.texts)
        whole = chunks.whole(text, finish, usage, log.logprobs, calls)
        headers = JSON_HEADERS
        if end.audit_seq is not None:  # its record's index: GET /v1/lineage/{request_id}
            headers = [*JSON_HEADERS, (b"x-seedance-audit-seq", str(end.audit_seq).encode())]
        await response.respond(200, headers, whole)


class StreamsEndpoint:
    """``GET /v1/streams/{request_id}``: the rest of a resumable reply, as Server-Sent Events.

    The cursor is the ``Last-Event-ID`` header (``<request id>:<seq>``, as the events carry it,
    and as a browser's ``EventSource`` sends it when it reconnects) or ``?after_seq=N``;
    without either the whole reply. Events after the cursor, then live, then the end.
    """

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = RequestId(scope.get("path_params", {}).get("request_id", ""))
        services = self.services
        call = HttpCall(services, scope, send, "stream", request_id)
        try:
            principal = call.authenticate()
            services.access.check_resume(principal, call.arrival.peer)
            tenant = principal.name
            after_seq = _cursor(scope, request_id)
            log = await services.streams.find(tenant, request_id, request_id, None)
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
        generation = services.generations.get(tenant, request_id)
        call.outcome = "resumed"
        await call.serve(self._resume(call, log, generation, after_seq), receive)

    async def _resume(
        self, call: HttpCall, log: StreamLog, generation: Generation | None, after_seq: int
    ) -> None:
        try:
            await relay(call, log, generation, after_seq)
        except SeedanceError as exc:  # cursor_ahead, a cursor inside an event
            await call.render_error(exc)
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
        self.offset = 0  # completions: where the next token's text starts in the reply
        #: Chat with tools: reads the reply's calls as it streams (None: no tools).
        self.calls: CallReader | None = None

    def events(self, text: str, logprobs: list[TokenLogprob] | None) -> list[bytes]:
        """The chunks of the reply's next ``text``: its content, or with tools, the calls it
        begins and their arguments' parts (``delta.tool_calls``, as OpenAI streams them)."""
        if self.calls is None:
            return [self.delta(text, logprobs=logprobs)]
        out = []
        for event in self.calls.feed(text):
            if event.text:
                out.append(self.delta(event.text, logprobs=logprobs))
                logprobs = None
                continue
            if event.done:  # Chat Completions says nothing at a call's end
                continue
            function = {"arguments": event.arguments}
            call: dict[str, Any] = {"index": event.index}
            if event.name:  # a call begins
                call.update(id=event.id, type="function")
                function = {"name": event.name, "arguments": ""}
            call["function"] = function
            out.append(self.delta({"tool_calls": [call]}))
        return out

    def delta(
        self,
        content: str | dict[str, Any] | None,
        finish: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        *,
        audit_seq: int | None = None,
    ) -> bytes:
        """A chunk of the reply; the last (``finish``) carries its audit record's index."""
        if self.chat:
            if isinstance(content, dict):
                delta: dict[str, Any] = content
            else:
                delta = {} if content is None else {"content": content}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            text = content if isinstance(content, str) else ""
            choice = {"index": 0, "text": text}
        choice["logprobs"] = self.logprobs(logprobs)
        choice["finish_reason"] = finish
        chunk = {**self.head, "choices": [choice]}
        if audit_seq is not None:  # GET /v1/lineage/{request_id}
            chunk["audit_seq"] = audit_seq
        return _encode(chunk)

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """A choice's ``logprobs`` in its endpoint's shape (chat: ``content``, a list of
        entries; completions: the legacy parallel lists)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets, at = [], self.offset
        for entry in entries:
            offsets.append(at)
            at += len(entry.token)
        self.offset = at
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
            "text_offset": offsets,
        }

    def usage(self, usage: dict[str, int]) -> bytes:
        return _encode({**self.head, "choices": [], "usage": usage})

    def whole(
        self,
        text: str,
        finish: str,
        usage: dict[str, int],
        logprobs: list[TokenLogprob] | None = None,
        calls: list[ToolCallTurn] | None = None,
    ) -> bytes:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message = {**message, "content": None, "tool_calls": [_call(c) for c in calls]}
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": self.logprobs(logprobs),
                "finish_reason": finish,
            }
            kind = "chat.completion"
        else:
            entries = self.logprobs(logprobs)
            choice = {"index": 0, "text": text, "logprobs": entries, "finish_reason": finish}
            kind = "text_completion"
        return _encode({**self.head, "object": kind, "choices": [choice], "usage": usage})


def _call(call: ToolCallTurn) -> dict[str, Any]:
    """A call as Chat Completions writes it in ``message.tool_calls``."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}
