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

**A reply that calls tools** has no message: its output items are ``function_call`` items,
and its events after ``response.in_progress`` are numbered by where in the reply's text ``p``
what they say ends: ``2 + 4p`` a call's ``response.output_item.added``, ``3 + 4p`` a
``response.function_call_arguments.delta`` (its arguments up to ``p``), ``4 + 4p`` and
``5 + 4p`` the call's ``response.function_call_arguments.done`` and ``output_item.done``; the
last event is ``6 + 4n`` after a reply of ``n`` characters. A request with tools learns which
kind its reply is from the reply's first character (a call begins with ``<``, a text reply
never does), and only then sends the first item's ``added`` event.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from seedance.protocol.codec import MAX_TOP_LOGPROBS, FrameLimits, validate_generate
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import (
    ChatMessage,
    DoneFrame,
    ErrorFrame,
    Generate,
    TokenLogprob,
    ToolCallTurn,
)
from seedance.protocol.openai import (
    ROLES,
    JsonSchemaFormat,
    audit_seq,
    decode_body,
    end_status,
)
from seedance.protocol.schemas import format_schema
from seedance.protocol.tools import CallReader, Tools, parse_tools

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
    # A function_call (call_id, name, arguments) or its function_call_output (call_id, output).
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None


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
    tools: Any = None  # checked by parse_tools, which names the field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Accepted as OpenAI's defaults (anything else is refused by name below).
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
    tools = parse_tools(parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls)
    text_format = parsed.text.format if parsed.text is not None else None
    schema = None
    if text_format is not None:
        schema = format_schema(
            text_format.type, text_format.schema, "text.format", strict=text_format.strict
        )
    if tools is not None and schema is not None:
        raise InvalidRequest(
            "text.format: a reply that may call tools cannot be bound to a schema too",
            param="text.format",
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
    if tools is not None:
        fields.update(
            tools=parsed.tools,
            tool_choice=parsed.tool_choice,
            parallel_tool_calls=parsed.parallel_tool_calls,
        )
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
    """The input items as turns: messages, and the calls a reply made (``function_call``
    items, those in a row one assistant turn) with their results (``function_call_output``)."""
    if isinstance(value, str):
        return [ChatMessage("user", value)]
    turns: list[ChatMessage] = []
    for i, item in enumerate(value):
        if item.type == "function_call":
            call = _function_call(i, item)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                turns[-1] = msgspec.structs.replace(last, tool_calls=(*last.tool_calls, call))
            else:
                turns.append(ChatMessage("assistant", "", tool_calls=(call,)))
            continue
        if item.type == "function_call_output":
            if not item.call_id:
                raise InvalidRequest(f"input[{i}].call_id: required", param=f"input[{i}].call_id")
            output = _text(i, item.output, "output")
            turns.append(ChatMessage("tool", output, tool_call_id=item.call_id))
            continue
        if item.type != "message":
            raise InvalidRequest(
                f"input[{i}].type: {item.type!r} is not supported (message, function_call, "
                "function_call_output)",
                param=f"input[{i}].type",
            )
        role = ROLES.get(item.role or "")
        if role is None:
            raise InvalidRequest(
                f"input[{i}].role: {item.role!r} is not supported (user, assistant, system, "
                "developer)"
            )
        turns.append(ChatMessage(role, _text(i, item.content, "content")))  # type: ignore[arg-type]
    return turns


def _function_call(i: int, item: _Item) -> ToolCallTurn:
    """A ``function_call`` input item (a call a reply made, given back with its result)."""
    for name in ("call_id", "name"):
        if not getattr(item, name):
            raise InvalidRequest(f"input[{i}].{name}: required", param=f"input[{i}].{name}")
    arguments = item.arguments or "{}"
    try:
        parsed = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequest(
            f"input[{i}].arguments: a JSON object, as text", param=f"input[{i}].arguments"
        )
    assert item.call_id is not None and item.name is not None
    return ToolCallTurn(item.call_id, item.name, arguments)


def _text(i: int, content: str | list[_Part] | None, field: str) -> str:
    """An item's content (or a call's output): a string or text parts."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type not in _TEXT_PARTS or part.text is None:
                raise InvalidRequest(
                    f"input[{i}].{field}[{j}]: only text parts are supported "
                    "(input_text, output_text)"
                )
        return "".join(part.text or "" for part in content)
    return content or ""


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
    def tools(self) -> Tools | None:
        """The tools the request offered (None: none)."""
        offered = self.meta.get("tools")
        return None if offered is None else parse_tools(*offered)

    @property
    def calls(self) -> bool:
        """Whether the reply calls tools (it began a call), so far as it has come."""
        tools = self.tools
        return tools is not None and tools.is_call(self.text)

    @property
    def kind_known(self) -> bool:
        """Whether it is known yet what kind of reply this is (without tools: from the
        start; with them: from the reply's first character, or its end)."""
        return bool(self.text) or self.ended or "tools" not in self.meta

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
        output: list[dict[str, Any]] = []
        if isinstance(end, DoneFrame) and end.tool_calls:
            output = [function_call(call, done=True) for call in end.tool_calls]
        elif self.ended and self.text:
            output = [self.item(done=True)]
        tools, tool_choice, parallel = (meta.get("tools") or (None, None, None))[:3]
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
            "parallel_tool_calls": parallel is not False,
            "previous_response_id": meta.get("previous_response_id"),
            "temperature": meta.get("temperature"),
            "top_p": meta.get("top_p"),
            "text": {"format": meta.get("text_format", _TEXT)},
            "tool_choice": tool_choice or "auto",
            "tools": tools or [],
            "truncation": "disabled",
            "metadata": meta.get("metadata") or {},
            "usage": usage,
            "user": None,
            **audit_seq(end),
        }

    # ---------------------------------------------------------------- stream events

    def opening(self, after: int) -> list[dict[str, Any]]:
        """The events before the first token's that are numbered above ``after`` (the
        message's item and part: once it is known that the reply is a message)."""
        events = []
        if after < CREATED:
            events.append(self._lifecycle("response.created", CREATED, in_progress=True))
        if after < IN_PROGRESS:
            events.append(self._lifecycle("response.in_progress", IN_PROGRESS, in_progress=True))
        if self.kind_known and not self.calls:
            events.extend(self.message_opening(after))
        return events

    def message_opening(self, after: int) -> list[dict[str, Any]]:
        """The message's ``output_item.added`` and ``content_part.added``, those above
        ``after``."""
        events = []
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
        if self.calls:  # each call's end was an event of its own
            number = call_number(len(self.text), 4)
            return [self._last(number)] if number > after else []
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
        events.append(self._last(0))
        numbered = []
        for offset, event in enumerate(events):
            number = first + offset
            if number > after:
                event.pop("sequence_number", None)
                numbered.append({"type": event.pop("type"), "sequence_number": number, **event})
        return numbered

    def _last(self, number: int) -> dict[str, Any]:
        """The last event: ``response.completed``, ``.failed`` or ``.incomplete``."""
        kind = {
            "completed": "response.completed",
            "failed": "response.failed",
        }.get(self.status, "response.incomplete")  # incomplete, or cancelled (no event of its own)
        return {"type": kind, "sequence_number": number, "response": self.response()}

    def _lifecycle(self, kind: str, number: int, *, in_progress: bool) -> dict[str, Any]:
        response = self.response()
        if in_progress:  # as it was when the event was first sent
            response.update(status="in_progress", output=[], usage=None, error=None)
            response.update(incomplete_details=None, completed_at=None)
        return {"type": kind, "sequence_number": number, "response": response}


def call_number(position: int, step: int) -> int:
    """The number of the event of a reply that calls tools that says what ends at
    ``position`` of the reply (``step``: 0 a call added, 1 its arguments, 2 and 3 its end, 4
    the response's end)."""
    return 2 + 4 * position + step


def function_call(call: ToolCallTurn, *, done: bool) -> dict[str, Any]:
    """A ``function_call`` output item (not ``done``: as it begins, its arguments to come)."""
    return {
        "id": _item_id(call),
        "type": "function_call",
        "status": "completed" if done else "in_progress",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if done else "",
    }


def _item_id(call: ToolCallTurn) -> str:
    """The id of a call's output item (derived from the call's: the same on every read)."""
    return "fc_" + call.id.removeprefix("call_")


class CallEvents:
    """The events of a reply that calls tools, from its text as it comes (see the module for
    their numbers): those numbered above ``after``, the arguments a resuming client holds
    left out of the first delta it gets."""

    def __init__(self, response_id: str, tools: Tools, after: int) -> None:
        self.reader = CallReader(tools, response_id)
        self.after = after
        self.held = max(0, (after - 2) // 4)  # the reply's characters the client holds

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The events of the reply's next ``text``."""
        events = []
        for event in self.reader.feed(text):
            index = event.index
            call = self.reader.calls[index]  # its arguments so far
            if event.name:
                number = call_number(event.end, 0)
                added = {"output_index": index, "item": function_call(call, done=False)}
                events.append(self._event("response.output_item.added", number, added))
                continue
            where = {"item_id": _item_id(call), "output_index": index}
            if event.arguments:
                delta = event.arguments[max(0, self.held - (event.end - len(event.arguments))) :]
                number = call_number(event.end, 1)
                events.append(
                    self._event("response.function_call_arguments.delta", number, where, delta)
                )
            elif event.done:
                arguments = {"arguments": call.arguments}
                done_item = {"output_index": index, "item": function_call(call, done=True)}
                number = call_number(event.end, 2)
                events.append(
                    self._event("response.function_call_arguments.done", number, where | arguments)
                )
                events.append(self._event("response.output_item.done", number + 1, done_item))
        return [event for event in events if event["sequence_number"] > self.after]

    @staticmethod
    def _event(
        kind: str, number: int, fields: dict[str, Any], delta: str | None = None
    ) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": number, **fields}
        if delta is not None:
            event["delta"] = delta
        return event


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
