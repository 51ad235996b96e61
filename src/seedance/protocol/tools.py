"""Tool calling: tools checked, written into the prompt, the reply bound to "a text reply or
calls of these tools", and the calls read back out of the reply.

A model whose chat template says nothing of tools (the embedded SmolLM2) is told of them in a
system message, and calls one in the **generic format** ::

    <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>

(the format Hermes-style templates such as Qwen 2.5's use). A template that writes tools
itself (:mod:`seedance.engines.template`) has its own :class:`CallFormat`: Hermes's, Llama
3.x's JSON (``{"name": ..., "parameters": {...}}``, calls apart by ``;``) or Mistral's
(``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``). Decoding is bound to a grammar
(:func:`grammar`, llguidance's Lark dialect with ``%json`` for each tool's parameters), so the
calls always parse and their arguments are valid for the tool's schema; :func:`parse_calls`
still checks both, and a reply cut inside a call (``max_tokens``) is an error, never a text
reply. A text reply may not begin with the format's first character (``<``, ``{``, ``[``):
that is how a call is told apart at once.

Pure: no I/O; the OpenAI APIs and ``/v2/infer`` share it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import jsonschema
import msgspec

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import ChatMessage, Generate, ToolCallTurn
from seedance.protocol.schemas import closed, output_schema

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS: Final = {"type": "object", "properties": {}}
_encode = msgspec.json.Encoder().encode

Choice = Literal["none", "auto", "required"] | str  # or the one tool's name


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a reply writes its calls: ``begin``, then each call (``open``, a JSON object with
    ``name`` and the arguments under ``key``, ``close``) with ``between`` between two, then
    ``end``; ``tag`` may come first (a special token: an engine that drops special tokens'
    text leaves it out)."""

    name: str
    open: str = ""
    close: str = ""
    key: str = "arguments"
    begin: str = ""
    between: str = ""
    end: str = ""
    tag: str = ""

    @property
    def lead(self) -> str:
        """The character a reply that calls begins with, and a text reply may not."""
        return (self.begin + self.open + "{")[0]


#: The generic format, Hermes's: what a template without tools of its own is told to write.
HERMES: Final = CallFormat("hermes", open="<tool_call>", close="</tool_call>")
#: Llama 3.1-3.3's JSON calls (their templates' custom tools).
LLAMA3_JSON: Final = CallFormat("llama3_json", key="parameters", between="; ")
#: Mistral's: one JSON array of calls after the ``[TOOL_CALLS]`` token.
MISTRAL: Final = CallFormat("mistral", begin="[", between=", ", end="]", tag="[TOOL_CALLS]")
FORMATS: Final = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: its name, what it does, and its parameters' schema."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools and how it lets the model use them."""

    tools: tuple[Tool, ...]
    choice: Choice = "auto"
    parallel: bool = True
    by_name: dict[str, Tool] = field(default_factory=dict, compare=False)
    #: How the reply writes its calls (the engine's: :attr:`Engine.call_format`).
    format: CallFormat = HERMES

    def is_call(self, text: str) -> bool:
        """Whether a reply that begins with ``text`` calls tools (and is not text)."""
        return text.startswith(self.format.lead)

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools the reply may call (``tool_choice`` naming one: that one)."""
        if self.choice in ("none", "auto", "required"):
            return self.tools if self.choice != "none" else ()
        return (self.by_name[self.choice],)

    def openai(self, *, callable_only: bool = False) -> dict[str, Any]:
        """The tools as Chat Completions asks for them (to pass them on to another server;
        ``callable_only``: only those the reply may call)."""
        choice: Any = self.choice
        if choice not in ("none", "auto", "required"):
            choice = {"type": "function", "function": {"name": choice}}
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in (self.callable if callable_only else self.tools)
        ]
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": self.parallel}


def parse_tools(
    tools: Any, tool_choice: Any, parallel: bool | None, format: str = HERMES.name
) -> Tools | None:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (None: no tools,
    or ``tool_choice: "none"``), for a reply that writes calls in ``format`` (a
    :class:`CallFormat`'s name). Each fault is an :class:`InvalidRequest` naming its field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice: there are no tools to call", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be a list", param="tools")
    checked: list[Tool] = []
    for i, spec in enumerate(tools):
        checked.append(_tool(spec, f"tools[{i}]"))
    by_name = {tool.name: tool for tool in checked}
    if len(by_name) != len(checked):
        raise InvalidRequest("tools: two tools have the same name", param="tools")
    choice = _choice(tool_choice, by_name)
    if choice == "none":
        return None
    return Tools(tuple(checked), choice, parallel is not False, by_name, FORMATS[format])


def offered(message: Generate, format: CallFormat = HERMES) -> Tools | None:
    """The tools a (validated) ``generate`` request offers, for a reply in ``format``."""
    return parse_tools(message.tools, message.tool_choice, message.parallel_tool_calls, format.name)


def kept(message: Generate, format: CallFormat) -> list[Any]:
    """What a stream log's ``meta`` keeps of a request's tools (``parse_tools(*kept)``: them)."""
    return [message.tools, message.tool_choice, message.parallel_tool_calls, format.name]


def _tool(spec: Any, where: str) -> Tool:
    if not isinstance(spec, dict) or spec.get("type", "function") != "function":
        raise InvalidRequest(f"{where}.type: only 'function' tools are supported", param=where)
    function = spec.get("function", spec)  # Chat Completions nests it; Responses does not
    if not isinstance(function, dict):
        raise InvalidRequest(f"{where}.function: must be an object", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"{where}.function.name: required, 1-64 letters, digits, _ or -", param=where
        )
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description: must be a string", param=where)
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_NO_PARAMETERS)
    output_schema(parameters, f"{where}.function.parameters")
    if function.get("strict"):
        parameters = closed(parameters)
    return Tool(name, description, parameters)


def _choice(value: Any, by_name: dict[str, Tool]) -> Choice:
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    name = None
    if isinstance(value, dict):
        function = value.get("function", value)  # {"type": "function", "function": {"name"}}
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(
            "tool_choice: 'none', 'auto', 'required' or {\"type\": \"function\", "
            '"function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in by_name:
        raise InvalidRequest(f"tool_choice: no tool is named {name!r}", param="tool_choice")
    return name


# --------------------------------------------------------------------------- the prompt

_OPEN, _CLOSE = HERMES.open, HERMES.close


def system_prompt(tools: Tools) -> str:
    """What the model is told of the tools it may call, and how to call them."""
    lines = [
        "You can call functions. To call one, reply with only this, once per call:",
        f'{_OPEN}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{_CLOSE}',
        "The functions:",
    ]
    for tool in tools.callable:
        spec = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        lines.append(_encode(spec).decode())
    if tools.choice == "auto":
        lines.append("If no function is needed, reply in plain text.")
    return "\n".join(lines)


def preamble(message: Generate) -> list[ChatMessage]:
    """The system turn that tells the model of a request's tools (none without tools): it
    opens the prompt, before the conversation, and is not kept in a session."""
    tools = offered(message)
    return [] if tools is None else [ChatMessage("system", system_prompt(tools))]


def call_text(name: str, arguments: str) -> str:
    """A call as a reply in the generic format writes it (for an assistant turn of the
    history)."""
    return f'{_OPEN}{{"name":{_encode(name).decode()},"arguments":{arguments or "{}"}}}{_CLOSE}'


def result_text(content: str) -> str:
    """A tool's result as the next turn gives it to the model."""
    return f"<tool_response>{content}</tool_response>"


def plain(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """``messages`` as a chat template without tools takes them: an assistant turn's calls
    written as the reply writes them, a tool's result as a user turn (the generic format)."""
    out = []
    for message in messages:
        if message.role == "tool":
            out.append(ChatMessage("user", result_text(message.content)))
        elif message.tool_calls:
            calls = "".join(call_text(c.name, c.arguments) for c in message.tool_calls)
            out.append(ChatMessage(message.role, message.content + calls))
        else:
            out.append(message)
    return out


# --------------------------------------------------------------------------- the grammar


def grammar(tools: Tools) -> str:
    """The Lark grammar (llguidance's dialect) of a reply to ``tools``: calls of the tools it
    may call in the tools' format, each with arguments valid for the tool's parameters (compact
    JSON, ``name`` first; a newline inside Hermes's tags allowed, as its templates write
    calls); with ``tool_choice: "auto"``, a text reply instead (not beginning with the
    format's first character)."""
    format = tools.format
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, format.key: tool.parameters},
            "required": ["name", format.key],
            "additionalProperties": False,
        }
        for tool in tools.callable
    ]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    body = f"%json {_encode(schema).decode()}"
    if format.open:  # a newline inside the tags is the Hermes templates' way
        body = f'{_quote(format.open)} "\\n"? {body} "\\n"? {_quote(format.close)}'
    more = f"({_quote(format.between)} call)*" if format.between else "call*"
    calls = " ".join(
        part
        for part in (
            _quote(format.begin),
            "call",
            more if tools.parallel else "",
            _quote(format.end),
        )
        if part
    )
    rules = [f"calls: {calls}", f"call: {body}"]
    if tools.choice == "auto":
        rules.insert(0, "start: calls | TEXT")
        rules.append(f"TEXT: /[^{re.escape(format.lead)}][\\s\\S]*/")
    else:
        rules.insert(0, "start: calls")
    return "\n".join(rules)


def _quote(literal: str) -> str:
    """A Lark string literal (empty: none)."""
    return _encode(literal).decode() if literal else ""


# --------------------------------------------------------------------------- the reply


class BadToolCall(InvalidRequest):
    """The reply's call does not parse, names no tool, or has arguments its schema refuses."""


def call_id(request_id: str, index: int) -> str:
    """The id of a reply's ``index``-th call: the same however often the reply is read."""
    digest = hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def parse_calls(text: str, tools: Tools, request_id: str = "") -> list[ToolCallTurn] | None:
    """The calls ``text`` (a whole reply) makes in the tools' format (None: it is a text
    reply); a reply that begins a call and does not make it whole raises :class:`BadToolCall`,
    as does a text reply where ``tool_choice`` asked for a call (an engine that does not bind
    its replies, gateway mode's upstream, may write one)."""
    if not tools.is_call(text):
        if tools.choice != "auto":
            raise BadToolCall(
                f"tool_choice {tools.choice!r} asked for a tool call and the reply is text"
            )
        return None
    format = tools.format
    calls: list[ToolCallTurn] = []
    decoder = json.JSONDecoder()
    at = len(format.tag) if format.tag and text.startswith(format.tag) else 0
    at = _expect(text, at, format.begin)
    while True:
        at = _expect(text, at, format.open)
        try:
            body, end = decoder.raw_decode(text, _skip_space(text, at))
        except json.JSONDecodeError:
            raise BadToolCall("the reply ended inside a tool call (max_tokens?)") from None
        at = _expect(text, end, format.close)
        calls.append(_call(body, tools, call_id(request_id, len(calls))))
        at = _skip_space(text, at)
        if format.end and text.startswith(format.end, at):
            at = _skip_space(text, at + len(format.end))
            if at < len(text):
                raise BadToolCall(f"the reply goes on after its tool calls at character {at}")
            return calls
        if at == len(text) and not format.end:
            return calls
        at = _expect(text, at, format.between.strip())


def _expect(text: str, at: int, literal: str) -> int:
    """Past ``literal`` where ``text`` has it at ``at`` (spaces before it skipped)."""
    at = _skip_space(text, at)
    if text.startswith(literal, at):
        return at + len(literal)
    if literal.startswith(text[at:]):
        raise BadToolCall("the reply ended inside a tool call (max_tokens?)")
    raise BadToolCall(f"the reply's tool call does not parse at character {at}")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _call(body: Any, tools: Tools, id: str) -> ToolCallTurn:
    key = tools.format.key
    if not isinstance(body, dict) or set(body) != {"name", key}:
        raise BadToolCall(f'a tool call must be {{"name": ..., "{key}": {{...}}}}')
    tool = tools.by_name.get(body["name"])
    if tool is None:
        raise BadToolCall(f"the reply called {body['name']!r}, which is not a tool")
    try:
        jsonschema.validate(body[key], tool.parameters)
    except jsonschema.ValidationError as exc:
        raise BadToolCall(f"the arguments of {tool.name} are not valid: {exc.message}") from None
    return ToolCallTurn(id, tool.name, _encode(body[key]).decode())


@dataclass(slots=True)
class CallEvent:
    """What a streamed reply adds: text, or a call begun (``name``), or part of a call's
    arguments (``arguments``), or the call's end (``done``), for the call ``index``; ``end``
    is where in the reply what it says ends."""

    index: int = -1
    text: str = ""
    name: str = ""
    id: str = ""
    arguments: str = ""
    done: bool = False
    end: int = 0


@functools.cache
def _patterns(format: CallFormat) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    """What begins a reply's first call, what begins each later one (up to its arguments,
    its name caught), and what ends a call, in ``format``."""
    space = r"\s*"
    head = (
        re.escape(format.open)
        + space
        + r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
        + re.escape(f'"{format.key}"')
        + r"\s*:\s*"
    )
    tag = f"(?:{re.escape(format.tag)})?" if format.tag else ""
    first = space + tag + space + re.escape(format.begin) + space + head
    later = space + re.escape(format.between.strip()) + space + head
    tail = space + r"\}" + space + re.escape(format.close)
    return re.compile(first), re.compile(later), re.compile(tail)


class CallReader:
    """Reads a reply's calls as its text streams in (the grammar wrote it: compact JSON,
    ``name`` first), so a client gets each call's name as soon as it is whole and its
    arguments piece by piece, as OpenAI streams them. The generation checks the whole reply
    (:func:`parse_calls`): this reader only cuts it up; ``calls`` holds each call begun, with
    its arguments so far, and ``whole`` how many of them have ended."""

    def __init__(self, tools: Tools, request_id: str = "") -> None:
        self.tools = tools
        self.request_id = request_id
        self.text = ""  # the whole reply so far
        self.calls: list[ToolCallTurn] = []
        self.whole = 0
        self._mode: Literal["", "text", "calls"] = ""
        # Reading calls: where (``_at``), and what comes there: a call's head (``head``),
        # its arguments (``arguments``), or the end of the call (``tail``).
        self._at = 0
        self._next: Literal["head", "arguments", "tail"] = "head"
        self._index = -1
        self._depth = 0  # brackets open in the arguments
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> Iterator[CallEvent]:
        """What ``text``, the next part of the reply, adds."""
        self.text += text
        if not self._mode and self.text:
            self._mode = "calls" if self.tools.is_call(self.text) else "text"
        if self._mode == "text":
            if text:
                yield CallEvent(text=text, end=len(self.text))
        elif self._mode == "calls":
            yield from self._calls()

    def _calls(self) -> Iterator[CallEvent]:
        text = self.text
        while True:
            if self._next == "head":
                first, later, _ = _patterns(self.tools.format)
                match = (later if self.calls else first).match(text, self._at)
                if match is None:
                    return  # not all here yet
                self._index += 1
                self._at, self._next = match.end(), "arguments"
                name = json.loads(match.group(1))
                id = call_id(self.request_id, self._index)
                self.calls.append(ToolCallTurn(id, name, ""))
                yield CallEvent(self._index, name=name, id=id, end=self._at)
            elif self._next == "arguments":
                start = self._at
                self._at = self._scan(text)
                if self._at > start:
                    part = text[start : self._at]
                    call = self.calls[self._index]
                    self.calls[self._index] = ToolCallTurn(
                        call.id, call.name, call.arguments + part
                    )
                    yield CallEvent(self._index, arguments=part, end=self._at)
                if self._next == "arguments":
                    return
            else:
                tail = _patterns(self.tools.format)[2].match(text, self._at)
                if tail is None:
                    return
                self._at, self._next = tail.end(), "head"
                self.whole += 1
                yield CallEvent(self._index, done=True, end=self._at)

    def _scan(self, text: str) -> int:
        """Past the arguments' characters here; at their end, the tail comes next."""
        i = self._at
        while i < len(text):
            c = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._next = "tail"
                    return i
        return i

    def skip(self, text: str) -> None:
        """Read the part of the reply a reader already has (a resumed stream), for nothing."""
        for _ in self.feed(text):
            pass


class CallWriter:
    """The inverse of :class:`CallReader`: calls that arrive as parts (another server's
    streamed ``delta.tool_calls``: a call's index, its name, its arguments' fragments) written
    as a reply in the generic format (:data:`HERMES`), so that the one reader of replies reads
    them."""

    def __init__(self) -> None:
        self.index: int | None = None  # the call being written
        self._arguments = False  # whether it has arguments yet
        self._space = ""  # whitespace held back: it may end the arguments (dropped then)

    def part(self, index: int, name: str | None, arguments: str | None) -> str:
        """The text of a part of call ``index`` (a new index: the call before it ends)."""
        text = ""
        if index != self.index:
            text = self.end()
            if not name:
                raise BadToolCall(f"tool call {index} has no name")
            self.index = index
            text += f'{_OPEN}{{"name":{_encode(name).decode()},"arguments":'
        if arguments and arguments.strip():
            if not self._arguments:
                arguments = arguments.lstrip()
            self._arguments = True
            kept = arguments.rstrip()
            text += self._space + kept
            self._space = arguments[len(kept) :]
        elif arguments and self._arguments:
            self._space += arguments
        return text

    def end(self) -> str:
        """The text that ends the call being written (none: none is)."""
        if self.index is None:
            return ""
        text = ("" if self._arguments else "{}") + "}" + _CLOSE
        self.index, self._arguments, self._space = None, False, ""
        return text
