"""The OpenAI-compatible HTTP API: request bodies, checked by the same rules as ``generate``,
and the streamed chunks of OpenAI-compatible servers, as Seedance's clients of them read them.

Pure: bytes in, a validated :class:`OpenAIRequest` (or a :class:`SeedanceError`) out. Fields that
OpenAI defines and Seedance does not use (``frequency_penalty``, ``user``, ...) are accepted
and ignored, as clients send them by default; ``n`` other than 1 is refused. Tools and tool
messages are written in the generic format of :mod:`seedance.protocol.tools`.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from seedance.protocol.codec import MAX_TOP_LOGPROBS, FrameLimits, validate_generate
from seedance.protocol.errors import InvalidJSON, InvalidRequest, SeedanceError
from seedance.protocol.messages import (
    ChatMessage,
    DoneFrame,
    ErrorFrame,
    Generate,
    TokenLogprob,
    ToolCallTurn,
    TopLogprob,
)
from seedance.protocol.schemas import format_schema
from seedance.protocol.tools import parse_tools

#: ``max_tokens`` of ``/v1/completions`` when absent (OpenAI's default).
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16

ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}  # and "tool", whose turns carry the call they answer


class _ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class _Function(msgspec.Struct):
    name: str
    arguments: str = "{}"


class _ToolCall(msgspec.Struct):
    function: _Function
    id: str | None = None
    type: str = "function"


class Message(msgspec.Struct):
    """A chat message as OpenAI's APIs send it (text, and an assistant's tool calls)."""

    role: str
    content: str | list[_ContentPart] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Extension(msgspec.Struct, forbid_unknown_fields=True):
    """Seedance's own fields, in ``"seedance": {...}``."""

    #: The reply survives a dropped connection: ``GET /v1/streams/{id}`` with ``Last-Event-ID``
    #: reads the rest (SSE events then carry ``id: <request id>:<seq>``).
    resumable: bool = False
    #: Tenant WebAssembly modules the request runs through, after its tenant's own.
    modules: list[str] | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """A named JSON Schema, as ``response_format.json_schema`` carries it (and, with its type
    beside it, the Responses API's ``text.format``)."""

    name: str | None = None
    schema: Any = None  # checked by format_schema, which names the field
    strict: bool | None = None
    description: str | None = None


class _ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    priority: int = 0  # -10 .. 10, higher first, up to the tenant's maximum
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1
    response_format: _ResponseFormat | None = None
    ignore_eos: bool = False  # vLLM's and llama-server's extension
    seedance: _Extension | None = None


class _ChatBody(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None  # checked by parse_tools, which names the field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # deprecated by OpenAI: refused


class _CompletionBody(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, or token ids
    logprobs: int | None = None  # the alternatives per token (the legacy API's one field)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One request of either endpoint, as the server runs it."""

    kind: Literal["chat", "completion"]
    model: str | None
    generate: Generate  # messages (chat) or prompt (completion), and the sampling fields
    stream: bool
    include_usage: bool
    #: Sampling fields the body left out (the engine may use the model's defaults for them).
    unset: frozenset[str] = frozenset()
    #: Whether the body set ``max_tokens`` (else the server's default, held to the model's).
    max_tokens_given: bool = True

    @property
    def messages(self) -> tuple[ChatMessage, ...]:
        """Chat: the conversation; completion: one user message holding the raw prompt."""
        return tuple(self.generate.turns())


_chat_decoder = msgspec.json.Decoder(_ChatBody)
_completion_decoder = msgspec.json.Decoder(_CompletionBody)


def decode_chat(body: bytes, limits: FrameLimits) -> OpenAIRequest:
    """A ``/v1/chat/completions`` body."""
    parsed = decode_body(_chat_decoder, body)
    if parsed.functions:
        raise InvalidRequest("functions: deprecated by OpenAI; use tools", param="functions")
    tools = parse_tools(parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls)
    messages = [chat_message(i, m) for i, m in enumerate(parsed.messages)]
    if not messages:
        raise InvalidRequest("messages must hold at least one message")
    max_tokens = parsed.max_tokens
    if parsed.max_completion_tokens is not None:  # the newer name wins
        max_tokens = parsed.max_completion_tokens
    top = parsed.top_logprobs
    if top is not None and not parsed.logprobs:
        raise InvalidRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
    logprobs = _top_logprobs(top or 0, "top_logprobs") if parsed.logprobs else None
    return _request(
        "chat",
        parsed,
        limits,
        max_tokens,
        messages=messages,
        logprobs=logprobs,
        tools=parsed.tools if tools is not None else None,
        tool_choice=parsed.tool_choice if tools is not None else None,
        parallel_tool_calls=parsed.parallel_tool_calls if tools is not None else None,
    )


def decode_completion(body: bytes, limits: FrameLimits) -> OpenAIRequest:
    """A ``/v1/completions`` body (one prompt)."""
    parsed = decode_body(_completion_decoder, body)
    prompt = parsed.prompt
    text: dict[str, Any] = {"prompt": prompt}
    if isinstance(prompt, list):
        if prompt and all(isinstance(token, int) for token in prompt):
            prompt = [prompt]  # one prompt of token ids
        if len(prompt) != 1:
            raise InvalidRequest("prompt: one prompt per request is supported")
        (one,) = prompt
        if isinstance(one, int):
            raise InvalidRequest("prompt: a string, token ids, or a list of one of them")
        text = {"prompt": one} if isinstance(one, str) else {"prompt_ids": one}
    max_tokens = parsed.max_tokens
    if max_tokens is None:
        max_tokens = limits.default_max_tokens(COMPLETIONS_DEFAULT_MAX_TOKENS)
    logprobs = None if parsed.logprobs is None else _top_logprobs(parsed.logprobs, "logprobs")
    return _request("completion", parsed, limits, max_tokens, logprobs=logprobs, **text)


def _top_logprobs(value: int, field: str) -> int:
    """How many alternatives each token's log probability comes with, held to 0-20."""
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{field} must be between 0 and {MAX_TOP_LOGPROBS}", param=field)
    return value


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSON(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # nesting deeper than the parser goes, in any field, ignored or not
        raise InvalidJSON("the body is not valid JSON: nested too deeply") from None
    except UnicodeError:
        raise InvalidJSON("the body is not valid JSON: not valid UTF-8") from None


def chat_message(index: int, message: Message) -> ChatMessage:
    """``messages[index]`` as the engines take it; roles and parts Seedance does not serve are
    refused by name. An assistant's tool calls and a tool's result stay what they are (the
    engine's prompt writes them: :func:`seedance.protocol.tools.plain`)."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise InvalidRequest(f"messages[{index}].content: only text parts are supported")
        content = "".join(part.text or "" for part in content)
    text = content or ""
    if message.role == "tool":
        return ChatMessage("tool", text, tool_call_id=message.tool_call_id)
    role = ROLES.get(message.role)
    if role is None:
        raise InvalidRequest(
            f"messages[{index}].role: {message.role!r} is not supported "
            "(system, developer, user, assistant, tool)"
        )
    if message.tool_calls:
        if role != "assistant":
            raise InvalidRequest(f"messages[{index}].tool_calls: only an assistant's")
        calls = tuple(
            ToolCallTurn(c.id or "", c.function.name, c.function.arguments)
            for c in message.tool_calls
        )
        return ChatMessage("assistant", text, tool_calls=calls)
    return ChatMessage(role, text)  # type: ignore[arg-type]


def _request(
    kind: Literal["chat", "completion"],
    body: _Common,
    limits: FrameLimits,
    max_tokens: int | None,
    **text: Any,
) -> OpenAIRequest:
    if body.n != 1:
        raise InvalidRequest("n: only 1 choice per request is supported")
    fields: dict[str, Any] = {
        "max_tokens": limits.default_max_tokens() if max_tokens is None else max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "stop": body.stop,
        "seed": body.seed,
        "priority": body.priority,
        "stream": body.stream,
        "resumable": bool(body.seedance and body.seedance.resumable),
        "modules": body.seedance.modules if body.seedance else None,
        "schema": _schema(body.response_format),
        "ignore_eos": body.ignore_eos,
    }
    generate = Generate(**fields, **text)
    validate_generate(generate, limits)
    options = body.stream_options
    return OpenAIRequest(
        kind=kind,
        model=body.model,
        generate=generate,
        stream=body.stream,
        include_usage=bool(options and options.include_usage),
        unset=frozenset(name for name in ("temperature", "top_p") if getattr(body, name) is None),
        max_tokens_given=max_tokens is not None,
    )


def _schema(response_format: _ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind, spec = response_format.type, response_format.json_schema
    field = "response_format.json_schema" if kind == "json_schema" else "response_format"
    if spec is None:
        return format_schema(kind, None, field)
    return format_schema(kind, spec.schema, field, strict=spec.strict)


# --------------------------------------------------------------------------- streamed replies


class ChunkToolCall(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: dict[str, Any] | None = None


class ChunkDelta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class _UpstreamTop(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class _UpstreamLogprob(_UpstreamTop):
    top_logprobs: list[_UpstreamTop] = []


class ChunkLogprobs(msgspec.Struct):
    """A streamed choice's ``logprobs``: Chat Completions' ``content`` entries, or the legacy
    Completions lists."""

    content: list[_UpstreamLogprob] | None = None
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None

    def entries(self) -> list[TokenLogprob]:
        """One entry per token, in Seedance's (and Chat Completions') shape."""

        def top(entry: _UpstreamTop) -> TopLogprob:
            raw = entry.bytes if entry.bytes is not None else list(entry.token.encode())
            return TopLogprob(entry.token, entry.logprob, raw)

        if self.content is not None:
            return [
                TokenLogprob(e.token, e.logprob, top(e).bytes, [top(t) for t in e.top_logprobs])
                for e in self.content
            ]
        values, tops = self.token_logprobs or [], self.top_logprobs or []
        out = []
        for i, token in enumerate(self.tokens or ()):
            logprob = values[i] if i < len(values) else None
            alternatives = tops[i] if i < len(tops) else None
            others = [TopLogprob(t, v, list(t.encode())) for t, v in (alternatives or {}).items()]
            out.append(TokenLogprob(token, logprob or 0.0, list(token.encode()), others))
        return out


class ChunkChoice(msgspec.Struct):
    delta: ChunkDelta | None = None  # chat completions
    text: str | None = None  # completions
    finish_reason: str | None = None
    logprobs: ChunkLogprobs | None = None

    @property
    def content(self) -> str | None:
        """The text this choice adds, whichever endpoint sent it."""
        return self.delta.content if self.delta is not None else self.text

    @property
    def calls(self) -> bool:
        """Whether this choice adds to a tool call (its name, or a part of its arguments)."""
        return bool(self.delta is not None and self.delta.tool_calls)


class ChunkUsage(msgspec.Struct):
    completion_tokens: int = 0
    prompt_tokens: int | None = None


class StreamChunk(msgspec.Struct):
    """One ``data:`` event of a streamed reply (``error`` when the server failed mid-stream)."""

    choices: list[ChunkChoice] = []
    usage: ChunkUsage | None = None
    error: dict[str, Any] | None = None


decode_stream_chunk = msgspec.json.Decoder(StreamChunk).decode


async def sse_data(lines: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The payloads of a Server-Sent Events body's ``data:`` lines, up to ``[DONE]``."""
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield data


# --------------------------------------------------------------------------- ended replies

EndStatus = Literal["completed", "incomplete", "cancelled", "failed"]


def end_status(end: DoneFrame | ErrorFrame | None) -> EndStatus:
    """The status OpenAI's Responses and Realtime APIs give a reply that ended with ``end``
    (None: aborted, its client gone)."""
    if isinstance(end, ErrorFrame):
        return "failed"
    if end is None or end.finish_reason == "cancelled":
        return "cancelled"
    return "incomplete" if end.finish_reason == "length" else "completed"


def audit_seq(end: DoneFrame | ErrorFrame | None) -> dict[str, int]:
    """The ``audit_seq`` field of a reply that ended with ``end`` (its audit record's index:
    GET /v1/lineage/{id}), where it has one; added to a Responses or Realtime response."""
    if isinstance(end, DoneFrame) and end.audit_seq is not None:
        return {"audit_seq": end.audit_seq}
    return {}


# --------------------------------------------------------------------------- errors

_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    426: "invalid_request_error",
    429: "rate_limit_error",
}
_encode_json = msgspec.json.Encoder().encode


def error_object(error: SeedanceError) -> dict[str, Any]:
    """An error as the OpenAI API shapes it: ``{"message", "type", "param", "code"}``."""
    kind = _ERROR_TYPES.get(error.http_status, "server_error")
    body: dict[str, Any] = {
        "message": error.message,
        "type": kind,
        "param": error.param,
        "code": error.code,
    }
    if error.reason is not None:  # history_lost: why
        body["reason"] = error.reason
    return body


def error_body(error: SeedanceError) -> bytes:
    """An HTTP error body as the OpenAI API shapes it (``{"error": {...}}``)."""
    return _encode_json({"error": error_object(error)})
