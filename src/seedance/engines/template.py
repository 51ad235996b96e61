"""A model's chat template (from GGUF metadata or a tokenizer), rendered with Jinja2 as Hugging
Face does.

A template is code shipped with the model, so it runs in Jinja2's immutable sandbox. Models
without a template get ChatML, the format most small instruct models use.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from seedance.config import ConfigError
from seedance.protocol.messages import ChatMessage

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

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos,
            eos_token=self._eos,
        )
