"""OpenAI's Realtime API, text only: client events in, server events out, in both shapes the
``openai`` package speaks: GA (``client.realtime.connect``) and beta
(``client.beta.realtime.connect``, the ``OpenAI-Beta: realtime=v1`` header).

Pure: the server (:mod:`seedance.server.realtime`) keeps the state and the sockets. The
shapes differ in names (GA ``response.output_text.delta``, ``conversation.item.added`` and
``.done``, ``output_modalities``, ``max_output_tokens``; beta ``response.text.delta``,
``conversation.item.created``, ``modalities``, ``max_response_output_tokens``) and in an
assistant item's content part (GA ``output_text``, beta ``text``); :class:`Shape` holds them.

**Tools.** ``session.update`` and ``response.create`` take function ``tools`` (flat, as the
Responses API), ``tool_choice`` and ``parallel_tool_calls``, checked as Chat Completions checks
them (:mod:`seedance.protocol.tools`). A reply that calls them is one ``function_call`` item
per call; the client answers with a ``function_call_output`` item and asks for the next
response.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from seedance.protocol.errors import InvalidJSON, InvalidRequest, SeedanceError
from seedance.protocol.messages import ChatMessage, DoneFrame, ErrorFrame, ToolCallTurn, Usage
from seedance.protocol.openai import ROLES, end_status, error_object
from seedance.protocol.tools import parse_tools

#: Client events about audio or items, which a text-only server refuses by name.
UNSUPPORTED: Final = (
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "conversation.item.truncate",
    "transcription_session.update",
)


@dataclass(frozen=True, slots=True)
class Shape:
    """The names one flavour of the API uses."""

    beta: bool
    text_delta: str
    text_done: str
    modalities: str  # the session's and the response's field
    max_tokens: str  # the session's and a response's token limit field
    assistant_part: str

    @staticmethod
    def of(beta: bool) -> Shape:
        if beta:
            return Shape(
                True,
                "response.text.delta",
                "response.text.done",
                "modalities",
                "max_response_output_tokens",
                "text",
            )
        return Shape(
            False,
            "response.output_text.delta",
            "response.output_text.done",
            "output_modalities",
            "max_output_tokens",
            "output_text",
        )


@dataclass(slots=True)
class SessionConfig:
    """What ``session.update`` sets: the defaults of every response."""

    instructions: str = ""
    temperature: float | None = None
    max_output_tokens: int | None = None  # None: "inf" (the model's limit)
    #: The functions a reply may call, and how (OpenAI's fields, checked).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


@dataclass(slots=True)
class ResponseParams:
    """One ``response.create``: the session's defaults, overridden."""

    instructions: str
    temperature: float | None
    max_output_tokens: int | None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def tool_fields(self) -> dict[str, Any]:
        """The tools as a generation's fields (none: no tools, or ``tool_choice: none``)."""
        if parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls) is None:
            return {}
        return {
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }


# --------------------------------------------------------------------------- client events


def decode_event(text: str) -> dict[str, Any]:
    try:
        event = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidJSON(f"not a JSON event: {exc}") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise InvalidRequest("an event is a JSON object with a string 'type'")
    return event


def check_modalities(value: Any, name: str) -> None:
    if value is None:
        return
    if not isinstance(value, list) or any(m not in ("text", "audio") for m in value):
        raise InvalidRequest(f"{name}: a list of 'text'")
    if "audio" in value:
        raise InvalidRequest(f"{name}: audio is not supported (text only); use ['text']")


def max_tokens_of(value: Any, name: str, limit: int) -> int | None:
    """``"inf"`` (None) or 1 .. ``limit``."""
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise InvalidRequest(f"{name}: 'inf' or an integer between 1 and {limit}")
    return value


def temperature_of(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 2:
        raise InvalidRequest(f"{name}: a number between 0 and 2")
    return float(value)


def update_session(config: SessionConfig, session: Any, shape: Shape, limit: int) -> SessionConfig:
    """``session.update``'s ``session``, applied (only the fields present)."""
    if not isinstance(session, dict):
        raise InvalidRequest("session: an object")
    known = {"type", "instructions", "temperature", "model", shape.modalities, shape.max_tokens}
    known |= set(_TOOL_FIELDS)
    for name in session:
        if name not in known:
            raise InvalidRequest(f"session.{name}: not supported (text sessions only)")
    if session.get("type", "realtime") != "realtime":
        raise InvalidRequest("session.type: only 'realtime' sessions (no transcription)")
    return _settings(config, session, "session", shape, limit)


def _settings(
    base: SessionConfig, fields: dict[str, Any], where: str, shape: Shape, limit: int
) -> SessionConfig:
    """The modalities checked, and the instructions, temperature and token limit of
    ``fields`` (the session's, or a response's) over ``base``'s."""
    check_modalities(fields.get(shape.modalities), f"{where}.{shape.modalities}")
    instructions = fields.get("instructions", base.instructions)
    if not isinstance(instructions, str):
        raise InvalidRequest(f"{where}.instructions: a string")
    temperature, max_tokens = base.temperature, base.max_output_tokens
    if "temperature" in fields:
        temperature = temperature_of(fields["temperature"], f"{where}.temperature")
    if shape.max_tokens in fields:
        name = f"{where}.{shape.max_tokens}"
        max_tokens = max_tokens_of(fields[shape.max_tokens], name, limit)
    tools = {name: fields.get(name, getattr(base, name)) for name in _TOOL_FIELDS}
    try:
        parse_tools(tools["tools"], tools["tool_choice"], tools["parallel_tool_calls"])
    except InvalidRequest as exc:
        param = f"{where}.{exc.param}" if exc.param else None
        raise InvalidRequest(f"{where}.{exc.message}", param=param) from None
    return SessionConfig(instructions, temperature, max_tokens, **tools)


#: The fields of a session or a response that say which tools a reply may call.
_TOOL_FIELDS: Final = ("tools", "tool_choice", "parallel_tool_calls")


def item_message(item: Any) -> ChatMessage:
    """``conversation.item.create``'s item, as a turn of the conversation: a text message, a
    call a reply made (``function_call``), or a call's result (``function_call_output``)."""
    if not isinstance(item, dict):
        raise InvalidRequest("item: an object")
    kind = item.get("type", "message")
    if kind == "function_call":
        call_id, name, arguments = (item.get(key) for key in ("call_id", "name", "arguments"))
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
            raise InvalidRequest("item: a function_call has a call_id and a name")
        if not isinstance(arguments, str):
            arguments = "{}"
        call = ToolCallTurn(call_id, name, arguments)
        return ChatMessage("assistant", "", tool_calls=(call,))
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id or not isinstance(output, str):
            raise InvalidRequest("item: a function_call_output has a call_id and an output (text)")
        return ChatMessage("tool", output, tool_call_id=call_id)
    if kind != "message":
        raise InvalidRequest(
            f"item.type: {kind!r} is not supported (message, function_call, function_call_output)"
        )
    role = ROLES.get(item.get("role") or "")
    if role is None:
        raise InvalidRequest(f"item.role: {item.get('role')!r} (user, assistant or system)")
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        raise InvalidRequest("item.content: a list of text parts")
    texts = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, dict) else part
            raise InvalidRequest(
                f"item.content[{i}].type: {kind!r} is not supported (text only: input_text)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"item.content[{i}].text: a string")
        texts.append(text)
    return ChatMessage(role, "".join(texts))  # type: ignore[arg-type]


def response_params(
    config: SessionConfig, response: Any, shape: Shape, limit: int
) -> ResponseParams:
    """``response.create``'s ``response`` over the session's defaults."""
    if response is None:
        response = {}
    if not isinstance(response, dict):
        raise InvalidRequest("response: an object")
    known = {"instructions", "temperature", "metadata", "conversation", *_TOOL_FIELDS}
    for name in response:
        if name not in known | {shape.modalities, shape.max_tokens}:
            raise InvalidRequest(f"response.{name}: not supported (text responses only)")
    if response.get("conversation", "auto") != "auto":
        raise InvalidRequest("response.conversation: only 'auto' (the session's conversation)")
    metadata = response.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise InvalidRequest("response.metadata: string pairs")
    settings = _settings(config, response, "response", shape, limit)
    return ResponseParams(
        settings.instructions,
        settings.temperature,
        settings.max_output_tokens,
        metadata,
        settings.tools,
        settings.tool_choice,
        settings.parallel_tool_calls,
    )


# --------------------------------------------------------------------------- server events


@dataclass(slots=True)
class Events:
    """The server events of one connection (event ids counted per connection)."""

    shape: Shape
    model: str
    session_id: str
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _prefix: str = field(default_factory=lambda: secrets.token_hex(4))

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": f"event_{self._prefix}{next(self._ids)}", **fields}

    def session(self, config: SessionConfig) -> dict[str, Any]:
        shape = self.shape
        limit: int | str = "inf" if config.max_output_tokens is None else config.max_output_tokens
        session: dict[str, Any] = {
            "model": self.model,
            "instructions": config.instructions,
            shape.modalities: ["text"],
            shape.max_tokens: limit,
        }
        if shape.beta:
            session["id"] = self.session_id
            session["temperature"] = config.temperature
        else:
            session["type"] = "realtime"
        session["tools"] = config.tools or []
        session["tool_choice"] = config.tool_choice or "auto"
        return session

    def error(self, error: SeedanceError, client_event_id: str | None) -> dict[str, Any]:
        body = error_object(error)
        body["event_id"] = client_event_id
        body.pop("reason", None)
        return self.event("error", error=body)

    def item(
        self,
        item_id: str,
        message: ChatMessage,
        status: Literal["in_progress", "completed", "incomplete"],
    ) -> dict[str, Any]:
        if message.tool_calls:
            return self.call_item(item_id, message.tool_calls[0], status)
        if message.role == "tool":
            return {
                "id": item_id,
                "object": "realtime.item",
                "type": "function_call_output",
                "status": status,
                "call_id": message.tool_call_id,
                "output": message.content,
            }
        if message.role == "assistant":
            parts = [{"type": self.shape.assistant_part, "text": message.content}]
            if status == "in_progress":
                parts = []
        else:
            parts = [{"type": "input_text", "text": message.content}]
        return {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": message.role,
            "status": status,
            "content": parts,
        }

    @staticmethod
    def call_item(
        item_id: str,
        call: ToolCallTurn,
        status: Literal["in_progress", "completed", "incomplete"],
    ) -> dict[str, Any]:
        """A ``function_call`` item (in progress: its arguments so far)."""
        return {
            "id": item_id,
            "object": "realtime.item",
            "type": "function_call",
            "status": status,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
        }

    def item_added(self, item: dict[str, Any], previous: str | None) -> list[dict[str, Any]]:
        """A user's (or a reply's) item joining the conversation."""
        if self.shape.beta:
            return [self.event("conversation.item.created", previous_item_id=previous, item=item)]
        return [self.event("conversation.item.added", previous_item_id=previous, item=item)]

    def response(
        self,
        response_id: str,
        params: ResponseParams,
        *,
        status: str = "in_progress",
        status_details: dict[str, Any] | None = None,
        output: list[dict[str, Any]] | None = None,
        usage: Usage | None = None,
    ) -> dict[str, Any]:
        limit: int | str = "inf" if params.max_output_tokens is None else params.max_output_tokens
        response: dict[str, Any] = {
            "id": response_id,
            "object": "realtime.response",
            "status": status,
            "status_details": status_details,
            "output": output or [],
            "conversation_id": "conv_" + self.session_id,
            self.shape.modalities: ["text"],
            "max_output_tokens": limit,
            "metadata": params.metadata,
            "usage": None if usage is None else _usage(usage),
        }
        if self.shape.beta:
            response["temperature"] = params.temperature
        return response

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "text", "text": text}


def ended(end: DoneFrame | ErrorFrame | None) -> tuple[str, dict[str, Any] | None]:
    """A response's ``status`` and ``status_details`` from its log's end."""
    status = end_status(end)
    if isinstance(end, ErrorFrame):
        error = {"type": "server_error", "code": end.error.code, "message": end.error.message}
        return status, {"type": "failed", "error": error}
    if status == "cancelled":
        return status, {"type": "cancelled", "reason": "client_cancelled"}
    if status == "incomplete":
        return status, {"type": "incomplete", "reason": "max_output_tokens"}
    return status, None


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "total_tokens": usage.total_tokens,
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "input_token_details": {
            "cached_tokens": 0,
            "text_tokens": usage.prompt_tokens,
            "audio_tokens": 0,
        },
        "output_token_details": {"text_tokens": usage.completion_tokens, "audio_tokens": 0},
    }
