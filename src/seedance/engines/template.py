"""A model's chat template (from GGUF metadata, a tokenizer, or ``--chat-template FILE``),
rendered with Jinja2 as Hugging Face does.

A template is code shipped with the model, so it runs in Jinja2's immutable sandbox. Models
without a template get ChatML, the format most small instruct models use.

**Tools.** A template that writes a request's tools into the prompt itself is given the
tools and the history's calls and results as Hugging Face templates take them, and its replies
write calls the way it writes them in the history. That way is learnt once, by rendering a
probe call: Hermes's (``<tool_call>`` around ``{"name", "arguments"}``: Qwen 2.5's, Hermes',
and ``benchmarks/hermes_tools.jinja`` for SmolLM2), Llama 3.x's JSON (``{"name",
"parameters"}``) or Mistral's (``[TOOL_CALLS]`` and an array of calls)
(:class:`~seedance.protocol.tools.CallFormat`). Any other template (one without tools, or one
whose calls are none of these) gets the generic format (:mod:`seedance.protocol.tools`): the
tools described in a system message, calls and results written as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from seedance.config import ConfigError
from seedance.protocol.messages import ChatMessage
from seedance.protocol.tools import FORMATS, HERMES, CallFormat, Tools, plain

#: A tool a template is shown once, with a call of it and its result, to learn whether it
#: writes tools into the prompt and how it writes calls.
_PROBE: Final = {
    "type": "function",
    "function": {
        "name": "seedance_probe_tool",
        "description": "",
        "parameters": {"type": "object", "properties": {"probe": {"type": "integer"}}},
    },
}
_PROBE_TURNS: Final[list[dict[str, Any]]] = [
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_seedanceprobe",
                "type": "function",
                "function": {"name": "seedance_probe_tool", "arguments": {"probe": 17}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_seedanceprobe", "content": "18"},
]
#: The probe call as a template writes it: the text before it and the arguments' key.
_PROBE_CALL: Final = re.compile(
    r'\{\s*"name"\s*:\s*"seedance_probe_tool"\s*,\s*"(\w+)"\s*:\s*\{\s*"probe"\s*:\s*17\s*\}'
)

CHATML: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as Hugging Face's templates write it: keys in their order, nothing escaped for
    HTML (Jinja2's own filter sorts keys and escapes ``<``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """Renders a conversation into the prompt text the model was trained on."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str) -> None:
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the model's chat template does not parse: {exc}") from None
        self._bos = bos_token
        self._eos = eos_token
        format = self._call_format()
        #: Whether the template writes tools and calls itself (the module).
        self.tools = format is not None
        #: How its replies write calls (without tools of its own: the generic format).
        self.call_format = format or HERMES

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        tools: Tools | None = None,
    ) -> str:
        """The prompt text of ``messages`` (and of the ``tools`` a reply may call, where the
        template writes them itself)."""
        if not self.tools:
            wire = [{"role": m.role, "content": m.content} for m in plain(messages)]
            return self._render(wire, add_generation_prompt)
        offered = None if tools is None else tools.openai(callable_only=True)["tools"]
        return self._render([_hf(m) for m in messages], add_generation_prompt, offered)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        extra = {} if tools is None else {"tools": tools}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos,
            eos_token=self._eos,
            **extra,
        )

    def _call_format(self) -> CallFormat | None:
        """The format the template writes calls in (None: it writes no tools, or calls in
        none of the formats known)."""
        if "tool" not in self.source:
            return None
        try:
            text = self._render(list(_PROBE_TURNS), False, [_PROBE])
        except jinja2.TemplateError:
            return None
        call = _PROBE_CALL.search(text)
        if call is None:
            return None
        before = text[: call.start()].replace(" ", "").rstrip()  # what opens the call
        for format in FORMATS.values():
            if call.group(1) == format.key and before.endswith(
                format.tag + format.begin + format.open
            ):
                return format
        return None


def _hf(message: ChatMessage) -> dict[str, Any]:
    """A turn as Hugging Face chat templates take it: an assistant's calls with their
    arguments as objects, a tool's result with the call's id."""
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "tool":
        wire["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        wire["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments or "{}")},
            }
            for call in message.tool_calls
        ]
    return wire
