"""OpenAI's Responses API, text only: request bodies in, Response objects and stream events out.

Pure: bytes in, a validated :class:`ResponsesRequest` (or a :class:`SeedanceError`) out; and
the objects and events of a response built from what its stream log holds (:class:`Rendered`),
so that every reader, live or resuming, sees the same events with the same numbers.

**Event numbers.** A response's events are numbered from what they say, not from how they were
sent: ``response.created`` 0, ``response.in_progress`` 1, ``response.output_item.added`` 2,
``response.content_part.added`` 3; a ``response.output_text.delta`` carrying tokens ``a..b``
of the reply is ``4 + b``; after the reply's ``n`` tokens, ``response.output_text.done`` is
``4 + n``, then the part's and the item's ``done`` and the last event (``response.completed``,
``response.incomplete`` or ``response.failed``). Numbers only grow, and a resume
``starting_after=N`` gets exactly the events above ``N`` (the tokens after token ``N - 4``, in
as few deltas as it likes): every event once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from seedance.protocol.codec import MAX_TOP_LOGPROBS, FrameLimits, validate_generate
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import ChatMessage, DoneFrame, ErrorFrame, Generate, TokenLogprob
from seedance.protocol.openai import ROLES, JsonSchemaFormat, decode_body, end_status
from seedance.protocol.schemas import format_schema

#: Sequence numbers of the events before the first token's.
CREATED, IN_PROGRESS, ITEM_ADDED, PART_ADDED, FIRST_DELTA = 0, 1, 2, 3, 4

_TEXT_PARTS: Final = ("input_text", "output_text", "text")
MAX_METADATA: Final = 16
_TEXT: Final = {"type": "text"}
#: What ``include`` names to have each output text's tokens' log probabilities.
LOGPROBS: Final = "message.output_text.logprobs"

Status = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


class _Part(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Item(msgspec.Struct, kw_only=True):
    role: str | None = None
    content: str | list[_Part] | None = None
    type: str = "message"
    id: str | None = None
    status: str | None = None


class _Format(JsonSchemaFormat, kw_only=True):
    type: str = "text"


class _Text(msgspec.Struct):
    format: _Format | None = None


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[_Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    # Accepted as OpenAI's defaults (anything else is refused by name below).
    tools: list[Any] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    text: _Text | None = None
    truncation: str | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    #: Seedance: the request's priority (-10 .. 10), as on /v2/infer.
    priority: int = 0


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A ``POST /v1/responses`` body, as the server runs it."""

    model: str | None
    input: tuple[ChatMessage, ...]  # the turns it adds to the conversation
    instructions: str | None
    previous_response_id: str | None
    store: bool
    background: bool
    stream: bool
    metadata: dict[str, str]
    generate: Generate  # the sampling fields, checked by the /v2/infer rules
    unset: frozenset[str]
    #: Whether the body set ``max_output_tokens`` (else the default, held to the model's).
    max_tokens_given: bool = True
    #: ``text.format`` as the response echoes it.
    text_format: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(_TEXT))


_decoder = msgspec.json.Decoder(_Body)


def decode_responses(body: bytes, limits: FrameLimits) -> ResponsesRequest:
    parsed: _Body = decode_body(_decoder, body)
    if parsed.tools:
        raise InvalidRequest(
            "tools: tools are not supported on the Responses API yet (POST "
            "/v1/chat/completions calls them)",
            param="tools",
        )
    if parsed.tool_choice not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice: only 'auto' and 'none' are supported (no tools)")
    text_format = parsed.text.format if parsed.text is not None else None
    schema = None
    if text_format is not None:
        schema = format_schema(
            text_format.type, text_format.schema, "text.format", strict=text_format.strict
        )
    if parsed.truncation not in (None, "disabled", "auto"):
        raise InvalidRequest("truncation: 'auto' or 'disabled'")
    if parsed.background and not parsed.store:
        raise InvalidRequest("background: a background response must be stored (store: true)")
    metadata = parsed.metadata or {}
    if len(metadata) > MAX_METADATA:
        raise InvalidRequest(f"metadata: at most {MAX_METADATA} pairs")
    turns = _input(parsed.input)
    if not turns:
        raise InvalidRequest("input: at least one message")
    max_tokens = parsed.max_output_tokens
    fields: dict[str, Any] = {
        "messages": turns,
        "max_tokens": limits.default_max_tokens() if max_tokens is None else max_tokens,
        "temperature": 1.0 if parsed.temperature is None else parsed.temperature,
        "top_p": 1.0 if parsed.top_p is None else parsed.top_p,
        "priority": parsed.priority,
        # The log keeps every token (a stored response can be read again as a stream).
        "stream": True,
        "resumable": parsed.store,
        "schema": schema,
        "logprobs": _logprobs(parsed),
    }
    generate = Generate(**fields)
    try:
        validate_generate(generate, limits)
    except InvalidRequest as exc:  # the /v2/infer names, as this API calls them
        message = exc.message.replace("max_tokens", "max_output_tokens")
        raise InvalidRequest(message.replace("messages", "input")) from None
    return ResponsesRequest(
        model=parsed.model,
        input=tuple(turns),
        instructions=parsed.instructions,
        previous_response_id=parsed.previous_response_id,
        store=parsed.store,
        background=parsed.background,
        stream=parsed.stream,
        metadata=metadata,
        generate=generate,
        unset=frozenset(n for n in ("temperature", "top_p") if getattr(parsed, n) is None),
        max_tokens_given=max_tokens is not None,
        text_format=_echo(text_format),
    )


def _logprobs(body: _Body) -> int | None:
    """Alternatives per token's log probability, when ``include`` asks for
    ``message.output_text.logprobs`` (``top_logprobs``: 0 to 20)."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if LOGPROBS not in (body.include or ()):
        return None
    return top or 0


def _echo(text_format: _Format | None) -> dict[str, Any]:
    """``text.format`` as the response object repeats it (its fields that were set)."""
    if text_format is None:
        return dict(_TEXT)
    fields = msgspec.to_builtins(text_format)
    return {name: value for name, value in fields.items() if value is not None}


def _input(value: str | list[_Item]) -> list[ChatMessage]:
    if isinstance(value, str):
        return [ChatMessage("user", value)]
    turns = []
    for i, item in enumerate(value):
        if item.type != "message":
            raise InvalidRequest(f"input[{i}].type: {item.type!r} is not supported (message)")
        role = ROLES.get(item.role or "")
        if role is None:
            raise InvalidRequest(
                f"input[{i}].role: {item.role!r} is not supported (user, assistant, system, "
                "developer)"
            )
        content = item.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type not in _TEXT_PARTS or part.text is None:
                    raise InvalidRequest(
                        f"input[{i}].content[{j}]: only text parts are supported "
                        "(input_text, output_text)"
                    )
            content = "".join(part.text or "" for part in content)
        turns.append(ChatMessage(role, content or ""))  # type: ignore[arg-type]
    return turns


# --------------------------------------------------------------------------- what goes out


@dataclass(slots=True)
class Rendered:
    """A response as its log holds it; ``meta`` is what the request asked for (the log's
    ``meta``)."""

    id: str
    meta: dict[str, Any]
    text: str
    #: The tokens logged so far (the reply's when it ended).
    tokens: int
    started: bool
    end: DoneFrame | ErrorFrame | None
    ended: bool
    #: Each token's log probability, when the request included them (else None).
    logprobs: list[TokenLogprob] | None = None

    @property
    def status(self) -> Status:
        if not self.ended:
            return "in_progress" if self.started or not self.meta.get("background") else "queued"
        return end_status(self.end)

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def item(self, *, done: bool) -> dict[str, Any]:
        status = self.status
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": ("completed" if status == "completed" else "incomplete")
            if done
            else "in_progress",
            "content": [self.part(self.text, self.logprobs)] if done else [],
        }

    @staticmethod
    def part(text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def response(self) -> dict[str, Any]:
        """The Response object (``GET /v1/responses/{id}``, and in the lifecycle events)."""
        meta = self.meta
        status = self.status
        end = self.end
        usage = None
        if isinstance(end, DoneFrame):
            usage = {
                "input_tokens": end.usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": end.usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": end.usage.total_tokens,
            }
        error = None
        if isinstance(end, ErrorFrame):
            error = {"code": "server_error", "message": end.error.message}
        output = [self.item(done=True)] if self.ended and self.text else []
        return {
            "id": self.id,
            "object": "response",
            "created_at": meta["created_at"],
            "status": status,
            "completed_at": round(meta["created_at"] + end.timing.total_ms / 1000)
            if isinstance(end, DoneFrame) and status == "completed"
            else None,
            "background": meta.get("background", False),
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": meta.get("instructions"),
            "max_output_tokens": meta.get("max_output_tokens"),
            "model": meta["model"],
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": meta.get("previous_response_id"),
            "temperature": meta.get("temperature"),
            "top_p": meta.get("top_p"),
            "text": {"format": meta.get("text_format", _TEXT)},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "metadata": meta.get("metadata") or {},
            "usage": usage,
            "user": None,
        }

    # ---------------------------------------------------------------- stream events

    def opening(self, after: int) -> list[dict[str, Any]]:
        """The events before the first token's that are numbered above ``after``."""
        events = []
        if after < CREATED:
            events.append(self._lifecycle("response.created", CREATED, in_progress=True))
        if after < IN_PROGRESS:
            events.append(self._lifecycle("response.in_progress", IN_PROGRESS, in_progress=True))
        if after < ITEM_ADDED:
            events.append(
                {
                    "type": "response.output_item.added",
                    "sequence_number": ITEM_ADDED,
                    "output_index": 0,
                    "item": self.item(done=False),
                }
            )
        if after < PART_ADDED:
            events.append(
                {
                    "type": "response.content_part.added",
                    "sequence_number": PART_ADDED,
                    "item_id": self.message_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": self.part(""),
                }
            )
        return events

    def delta(self, text: str, last_seq: int, first_seq: int = 0) -> dict[str, Any]:
        """Tokens ``first_seq`` to ``last_seq`` (their text, and their log probabilities when
        the request included them)."""
        logprobs = self.logprobs
        return {
            "type": "response.output_text.delta",
            "sequence_number": FIRST_DELTA + last_seq,
            "item_id": self.message_id,
            "output_index": 0,
            "content_index": 0,
            "delta": text,
            "logprobs": [] if logprobs is None else logprobs[first_seq : last_seq + 1],
        }

    def closing(self, after: int) -> list[dict[str, Any]]:
        """The events after the last token's, numbered above ``after`` (the response has
        ended)."""
        first = FIRST_DELTA + self.tokens
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        events: list[dict[str, Any]] = [
            {
                "type": "response.output_text.done",
                **where,
                "text": self.text,
                "logprobs": self.logprobs or [],
            },
            {
                "type": "response.content_part.done",
                **where,
                "part": self.part(self.text, self.logprobs),
            },
            {"type": "response.output_item.done", "output_index": 0, "item": self.item(done=True)},
        ]
        status = self.status
        last = {
            "completed": "response.completed",
            "failed": "response.failed",
        }.get(status, "response.incomplete")  # incomplete, or cancelled (no event of its own)
        events.append({"type": last, "response": self.response()})
        numbered = []
        for offset, event in enumerate(events):
            number = first + offset
            if number > after:
                numbered.append({"type": event.pop("type"), "sequence_number": number, **event})
        return numbered

    def _lifecycle(self, kind: str, number: int, *, in_progress: bool) -> dict[str, Any]:
        response = self.response()
        if in_progress:  # as it was when the event was first sent
            response.update(status="in_progress", output=[], usage=None, error=None)
            response.update(incomplete_details=None, completed_at=None)
        return {"type": kind, "sequence_number": number, "response": response}


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
