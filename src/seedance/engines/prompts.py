"""Prompts of an engine that owns its tokenizer: the chat template rendered and tokenized.

A prompt is tokenized when admission counts it and again when generation starts; the tokens
are kept for a while (keyed by the messages) so the work is done once.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

import jinja2
import msgspec

from seedance.engines.base import Engine, ModelInfo, SamplingParams
from seedance.engines.template import ChatTemplate
from seedance.protocol.errors import ContextOverflow, InvalidRequest
from seedance.protocol.messages import ChatMessage
from seedance.protocol.tools import CallFormat, Tools

_encode = msgspec.json.Encoder().encode

_CACHE_SIZE: Final = 256

#: ``encode(text, special)``: the tokens of ``text``; with ``special``, as a whole prompt (BOS
#: added where the model wants it, special-token text such as ``<|im_start|>`` parsed).
Encode = Callable[[str, bool], list[int]]
#: ``decode(tokens)``: the text of ``tokens``, special tokens written as their text.
Decode = Callable[[Sequence[int]], str]


class Prompts:
    """Renders and tokenizes prompts, and checks that they fit ``context_length``; the
    model's tokenizer both ways (``/tokenize`` and ``/detokenize``)."""

    def __init__(
        self,
        template: ChatTemplate,
        encode: Encode,
        context_length: int,
        *,
        decode: Decode,
        vocab_size: int,
        tokenize: Encode | None = None,
    ) -> None:
        self.template = template
        self.encode = encode
        self.decode = decode
        #: ``tokenize(text, add_special)``: special-token text always read as those tokens
        #: (default ``encode``, for a tokenizer that always reads it, as transformers' does).
        self._tokenize = tokenize or encode
        self.vocab_size = vocab_size
        self.context_length = context_length
        self._cache: OrderedDict[tuple[bool, tuple[ChatMessage, ...], bytes], list[int]] = (
            OrderedDict()
        )

    def count(self, text: str) -> int:
        """Tokens of a piece of text (no BOS, no template)."""
        return len(self.encode(text, False))

    def tokens(
        self,
        messages: Sequence[ChatMessage],
        raw: bool,
        continuation: str = "",
        tools: Tools | None = None,
    ) -> list[int]:
        """The prompt's tokens: the chat template around ``messages`` (and the ``tools``,
        where it writes them itself), or with ``raw`` the content of the one message as it is;
        then the ``continuation`` of a reply taken over (not cached). Raises when it is empty
        or cannot fit."""
        if not self.template.tools:
            tools = None  # described in a system message already (the generic format)
        key = (raw, tuple(messages), b"" if tools is None else _encode(tools.openai()))
        cache = self._cache
        tokens = None if continuation else cache.get(key)
        if tokens is None:
            if raw:
                text = "".join(m.content for m in messages)
            else:
                text = self.render(messages, add_generation_prompt=True, tools=tools)
            if continuation:
                tokens = self.encode(text + continuation, True)
            else:
                tokens = cache[key] = self.encode(text, True)
                if len(cache) > _CACHE_SIZE:
                    cache.popitem(last=False)
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        if len(tokens) >= self.context_length:
            raise ContextOverflow(
                f"the prompt takes {len(tokens)} tokens and the model's context holds "
                f"{self.context_length}; shorten it"
            )
        return tokens

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """:class:`~seedance.engines.base.Tokenizer`'s: ``text`` as ``/tokenize`` reads it."""
        return self._tokenize(text, add_special)

    def chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> list[int]:
        """:class:`~seedance.engines.base.Tokenizer`'s: ``messages`` as a prompt, however long."""
        return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt), True)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        tools: Tools | None = None,
    ) -> str:
        """``messages`` in the chat template, as text (an :class:`InvalidRequest` where the
        template refuses them)."""
        try:
            return self.template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}") from None

    def overheads(self) -> tuple[int, int]:
        """Tokens the template adds per message, and around the whole prompt (the generation
        prompt and any default system message), measured by rendering."""

        def size(messages: list[ChatMessage]) -> int:
            text = self.template.render(messages, add_generation_prompt=True)
            return len(self.encode(text, True))

        one = [ChatMessage("user", "hello")]
        content = self.count("hello")
        per_message = size([*one, ChatMessage("assistant", "hello"), *one]) - size(one)
        per_message = max(0, per_message // 2 - content)
        reply = max(0, size(one) - per_message - content)
        return per_message, reply


class PromptedEngine(Engine, abc.ABC):
    """An engine that renders and tokenizes prompts itself, so its counts are exact."""

    prompts: Prompts
    _info: ModelInfo

    @property
    def info(self) -> ModelInfo:
        return self._info

    def _use_prompts(self, prompts: Prompts) -> None:
        self.prompts = prompts
        self.message_overhead_tokens, self.reply_overhead_tokens = prompts.overheads()

    def count_tokens(self, text: str) -> int:
        return self.prompts.count(text)

    def tokenizer(self) -> Prompts:
        return self.prompts

    @property
    def native_tools(self) -> bool:
        return self.prompts.template.tools

    @property
    def call_format(self) -> CallFormat:
        return self.prompts.template.call_format

    def prompt_tokens(
        self,
        messages: Sequence[ChatMessage],
        estimate: int | None = None,
        *,
        raw: bool = False,
        tools: Tools | None = None,
    ) -> int:
        return len(self.prompts.tokens(messages, raw, tools=tools))

    def reply_limit(self, prompt: list[int], params: SamplingParams) -> int:
        """Most tokens the reply may have: ``max_tokens``, or what the context has left."""
        return min(params.max_tokens, self._info.context_length - len(prompt))
