"""A model's chat template (from GGUF metadata, a tokenizer, or ``--chat-template FILE``),
rendered with Jinja2 as Hugging Face does.

A template is code shipped with the model, so it runs in Jinja2's immutable sandbox. Models
without a template get ChatML, the format most small instruct models use.

**Tools.** A template that writes a request's tools into the prompt itself, with calls in the
Hermes way (``<tool_call>`` around ``{"name", "arguments"}``: Qwen 2.5's, Hermes', and
``benchmarks/hermes_tools.jinja`` for SmolLM2) is given the tools and the history's calls and
results as Hugging Face templates take them; its calls are the generic format's, newlines
aside, so they are read the same way. Any other template gets the generic format
(:mod:`seedance.protocol.tools`): the tools described in a system message, calls and results
written as text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from seedance.config import ConfigError
from seedance.protocol.messages import ChatMessage
from seedance.protocol.tools import OPEN, Tools, plain

#: A tool a template is shown once, to learn whether it writes tools into the prompt.
_PROBE: Final = {
    "type": "function",
    "function": {
        "name": "seedance_probe_tool",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    },
}

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


class ChatTemplate:
    """Renders a conversation into the prompt text the model was trained on."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str) -> None:
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the model's chat template does not parse: {exc}") from None
        self._bos = bos_token
        self._eos = eos_token
        #: Whether the template writes tools and calls itself, in the Hermes way (the module).
        self.tools = self._writes_tools()

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

    def _writes_tools(self) -> bool:
        if OPEN not in self.source:
            return False
        try:
            text = self._render([{"role": "user", "content": "x"}], True, [_PROBE])
        except jinja2.TemplateError:
            return False
        return "seedance_probe_tool" in text


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
