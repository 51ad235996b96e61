"""The one interface every inference backend implements.

The serving layer knows engines only through :class:`Engine`: it counts tokens to fit a
conversation into the context window, asks for a reply as an async iterator of
:class:`TokenDelta`, and aborts a request by closing that iterator (``aclose()``), which it does
on ``cancel``, on a client disconnect and on shutdown. An engine must stop the work behind a
closed iterator promptly and free what it held.

Engines are found by name through the ``seedance.engines`` entry point group (see
:mod:`seedance.engines.registry`); an entry point names a factory ``(ServerConfig) -> Engine``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import (
    ChatMessage,
    FinishReason,
    Generate,
    RequestId,
    TokenLogprob,
)
from seedance.protocol.schemas import OutputSchema, output_schema
from seedance.protocol.tools import HERMES, CallFormat, Tools, grammar, plain


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the serving layer needs to know about a served model."""

    name: str
    engine: str
    context_length: int
    max_output_tokens: int
    #: What exactly is served, for audit records: a model file's name, an upstream's model.
    version: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    #: Fields the client left out where its API lets the server choose (the OpenAI API's
    #: ``temperature`` and ``top_p``): an engine that knows the model's own defaults (vLLM's
    #: ``generation_config``) uses those instead of the values above, as ``vllm serve`` does.
    unset: frozenset[str] = frozenset()
    #: The JSON Schema the reply must be valid for: the engine samples only tokens that keep
    #: the text a prefix of a valid document, and ends the reply when the document is whole.
    schema: OutputSchema | None = None
    #: Log probabilities of the reply's tokens, with this many alternatives each (None: none).
    logprobs: int | None = None
    #: The tools the reply may call (``schema`` is then their grammar, for an engine that binds
    #: the reply itself); an engine that passes tools on (gateway mode) sends these.
    tools: Tools | None = None
    #: Never end at the model's end-of-text tokens: only ``max_tokens`` (or a stop) ends it.
    ignore_eos: bool = False
    #: Hand out the reply's token ids (:attr:`TokenDelta.ids`).
    token_ids: bool = False

    @classmethod
    def of(
        cls, message: Generate, unset: frozenset[str] = frozenset(), tools: Tools | None = None
    ) -> SamplingParams:
        """The sampling fields of a (validated) ``generate`` request (``tools``: those it
        offers, for the engine's call format)."""
        return cls(
            max_tokens=message.max_tokens,
            temperature=message.temperature,
            top_p=message.top_p,
            stop=message.stop_strings(),
            seed=message.seed,
            unset=unset,
            schema=bound_to(message, tools),
            logprobs=message.logprobs,
            tools=tools,
            ignore_eos=message.ignore_eos,
            token_ids="token_ids" in (message.tensors or ()),
        )


def bound_to(message: Generate, tools: Tools | None) -> OutputSchema | None:
    """What a (validated) request binds its reply to: its schema, or the grammar of a reply to
    the ``tools`` it offers (None: free text)."""
    if message.schema is not None:
        return output_schema(message.schema, "schema")
    return None if tools is None else OutputSchema(grammar(tools), kind="lark")


def estimated_tokens(text: str) -> int:
    """About four characters a token: the count of an engine whose model's tokenizer is
    elsewhere (gateway mode's upstreams, the relay's far gateway)."""
    return max(1, (len(text) + 3) // 4) if text else 0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One reply to generate: the whole (already trimmed) context and how to sample.

    With ``raw`` (the completions API), ``messages`` holds one message whose content is the
    whole prompt, to be continued as it is, without the chat template.
    """

    request_id: RequestId
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    prompt_tokens: int
    priority: int = 0
    #: The QoS class it was asked with (``X-QoS-Priority``; None: none asked): gateway mode
    #: routes by it.
    qos_class: str | None = None
    raw: bool = False
    #: The reply so far, when a node of the cluster takes over a generation whose node died:
    #: the prompt ends with it and the engine goes on after it (``continuation_tokens``
    #: tokens, already counted against ``max_tokens`` by the caller).
    continuation: str = ""
    continuation_tokens: int = 0
    #: The prompt as token ids, continued as they are (``messages`` then only describes it):
    #: an engine with :attr:`Engine.token_ids` takes them.
    prompt_ids: tuple[int, ...] | None = None
    #: The W3C trace context of the request's span (and the client's ``tracestate``): an
    #: engine that calls another service (gateway mode) sends them, so the trace goes on.
    traceparent: str | None = None
    tracestate: str | None = None
    #: Whose request it is: the tenant and the session (None: none), for an engine that passes
    #: the request on under their name (the relay binds them into its token).
    tenant: str = ""
    session_id: str | None = None

    def continued(self, text: str, tokens: int) -> GenerationRequest | None:
        """This request again, going on after ``text`` (``tokens`` of the reply made
        already, by a node that died or an engine process that did): it becomes the prompt's
        continuation and counts against ``max_tokens``. None: ``max_tokens`` is spent."""
        params = self.params
        if tokens >= params.max_tokens:
            return None
        return dataclasses.replace(
            self,
            params=dataclasses.replace(params, max_tokens=params.max_tokens - tokens),
            continuation=self.continuation + text,
            continuation_tokens=self.continuation_tokens + tokens,
        )


@dataclass(slots=True)
class TokenDelta:
    """Text that became final, and how many tokens it covers.

    ``tokens`` may be more than one when an engine had to hold text back (a partial UTF-8
    character, a possible stop string) and may be 0 on a last delta that only carries
    ``finish_reason``. The last delta of a reply has ``finish_reason`` set.
    """

    text: str
    tokens: int = 1
    finish_reason: FinishReason | None = None
    #: One per token, when the request asked for log probabilities.
    logprobs: list[TokenLogprob] | None = None
    #: The tokens' ids, when the request asked for them (an engine with :attr:`Engine.token_ids`).
    ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EngineHealth:
    ok: bool
    detail: str = ""


class Tokenizer(Protocol):
    """A model's own tokenizer and chat template (what ``/tokenize`` and ``/detokenize``
    answer with; :class:`~seedance.engines.prompts.Prompts` is one)."""

    vocab_size: int

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """The tokens of ``text``, special-token text such as ``<|im_start|>`` read as those
        tokens (as vLLM's and llama-server's ``/tokenize`` read it); ``add_special``: BOS
        too, where the model wants it."""
        ...

    def chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> list[int]:
        """The tokens of ``messages`` in the model's chat template, as a prompt is tokenized."""
        ...

    def decode(self, tokens: Sequence[int], /) -> str:
        """The text of ``tokens`` (ids within :attr:`vocab_size`)."""
        ...


class Engine(abc.ABC):
    """Base class of inference backends."""

    #: What the model does: ``generate`` text (every API but embeddings), or ``embed`` inputs
    #: (``/v1/embeddings``: an engine with an ``embed`` method).
    task: str = "generate"
    #: How many generations the engine runs well at once; the admission cap defaults to it.
    max_concurrency: int = 64
    #: True in the engine process (``--engine-process``): when the engine fails fatally the
    #: process ends, and the server goes on with its requests in the next one, so the engine
    #: need not fail them first.
    own_process: bool = False
    #: Tokens a chat template adds around each message and before the reply.
    message_overhead_tokens: int = 0
    reply_overhead_tokens: int = 0

    @property
    @abc.abstractmethod
    def info(self) -> ModelInfo: ...

    async def start(self) -> None:  # noqa: B027 - an optional hook
        """Load what the engine needs; called once before serving."""

    async def close(self) -> None:  # noqa: B027 - an optional hook
        """Release everything; called once at shutdown after requests ended."""

    @abc.abstractmethod
    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` under the model's tokenizer."""

    def count_message_tokens(self, message: ChatMessage) -> int:
        """Tokens one message takes in a prompt, template included (its calls, or its call's
        result, as the prompt writes them)."""
        if message.tool_calls or message.role == "tool":
            (message,) = plain([message])
        return self.count_tokens(message.content) + self.message_overhead_tokens

    def count_prompt_tokens(self, messages: Sequence[ChatMessage]) -> int:
        """Tokens of the whole prompt built from ``messages``."""
        return self.reply_overhead_tokens + sum(self.count_message_tokens(m) for m in messages)

    @property
    def native_tools(self) -> bool:
        """Whether the engine's chat template writes a request's tools into the prompt itself
        (:mod:`seedance.engines.template`): they are then passed to :meth:`prompt_tokens`
        and in :attr:`SamplingParams.tools`, not described in a system message."""
        return False

    @property
    def call_format(self) -> CallFormat:
        """How the engine's replies write tool calls: its chat template's way where it writes
        tools itself, else the generic format."""
        return HERMES

    def prompt_tokens(
        self,
        messages: Sequence[ChatMessage],
        estimate: int | None = None,
        *,
        raw: bool = False,
        tools: Tools | None = None,
    ) -> int:
        """The exact token count of the prompt built from ``messages`` (``raw``: the content of
        the one message, without the template; ``tools``: where the template writes them),
        where the engine can tell; otherwise ``estimate``, or the per-message sum when the
        caller has none.

        May raise :class:`~seedance.protocol.errors.ContextOverflow`.
        """
        return self.count_prompt_tokens(messages) if estimate is None else estimate

    #: Whether replies can carry their tokens' log probabilities (``logprobs``).
    logprobs: bool = False
    #: Whether the engine speaks token ids: replies carry their tokens' ids (a ``token_ids``
    #: tensor) and prompts may be token ids (``prompt_ids``).
    token_ids: bool = False

    def check_schema(self, schema: OutputSchema, field: str) -> None:
        """Refuse (:class:`InvalidRequest` naming ``field``) a schema this engine cannot bind
        its replies to, before any token; by default every schema: the engine cannot."""
        what = "call tools" if schema.kind == "lark" else "bind its replies to a schema"
        raise InvalidRequest(
            f"{field}: the {self.info.engine} engine of model {self.info.name} cannot {what}",
            param=field,
        )

    def tokenizer(self) -> Tokenizer | None:
        """The model's own tokenizer and chat template, where the engine has them (None: it
        counts tokens by estimate, or an upstream does; ``/tokenize`` refuses it)."""
        return None

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Stream the reply. Closing the generator aborts the request."""

    def health(self) -> EngineHealth:
        return EngineHealth(ok=True)

    def unfinished_requests(self) -> int | None:
        """Requests the engine itself holds, running or queued inside it, where it can tell
        (for /metrics: a cancelled request must leave it)."""
        return None

    def kv_cache_usage(self) -> float | None:
        """Share of the KV cache in use (0 to 1), where the engine knows it (for /metrics)."""
        return None

    def prompt_cache(self) -> tuple[int, int] | None:
        """Prompt tokens the engine was given since it started, and how many of them came from
        its cache instead of a prefill, where it can tell (for /metrics: a gateway in front
        reads them, vLLM's prefix cache queries and hits alike)."""
        return None
