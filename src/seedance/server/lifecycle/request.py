"""A request as the lifecycle knows it: who asked (:class:`Requester`), and what the engine is
asked to continue (:class:`Prompt`): a session's history trimmed to fit (:func:`session_prompt`)
or a whole conversation counted (:func:`explicit_prompt`), within the model's window."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from seedance.protocol import tools
from seedance.protocol.errors import ContextOverflow
from seedance.protocol.messages import ChatMessage, Generate, RequestId
from seedance.protocol.qos import QoS
from seedance.sessions.context import fit_context
from seedance.sessions.session import Session, Turn
from seedance.tenants.auth import Principal

if TYPE_CHECKING:
    from seedance.observability.tracing import ConnectionTrace
    from seedance.server.lifecycle.models import ServedModel


def new_request_id() -> RequestId:
    return RequestId("r-" + secrets.token_hex(6))


@dataclass(slots=True)
class Requester:
    """Who asked for a generation: what its accounting, trace and audit record name."""

    principal: Principal
    model: ServedModel
    api: Literal["websocket", "http"]
    #: The session whose context the request continues (the WebSocket API).
    session: Session | None = None
    connection_id: str | None = None
    connection_trace: ConnectionTrace | None = None
    #: The quality of service its handshake or HTTP request asked for (``X-QoS-Priority``).
    qos: QoS | None = None
    #: Whether its stream is end-to-end encrypted (``--e2e-key``), for access policies.
    e2e: bool = False
    tenant: str = field(init=False)

    def __post_init__(self) -> None:
        self.tenant = self.principal.name

    def log_key(self, request_id: str) -> str:
        """Where its stream log is kept: the session's, or one of its own (no session)."""
        return self.session.session_id if self.session is not None else request_id


@dataclass(slots=True)
class Prompt:
    """What the engine is asked to continue, and what a successful reply adds to the session."""

    messages: tuple[ChatMessage, ...]
    tokens: int
    #: The turns appended to the session with the reply (none without a session).
    new_turns: Sequence[Turn] = ()
    #: The completions API: the one message is the whole prompt, continued as it is.
    raw: bool = False
    #: Sampling fields the client left out where its API lets the server choose.
    unset: frozenset[str] = frozenset()
    #: A session's prompt: the index in ``messages`` where its history begins (the request's
    #: own turns follow it), and the spans of the session's turns it holds, ``(start, stop)``
    #: counted from the end of the turns (negative; 0 for the end). A takeover rebuilds the
    #: prompt from them.
    history: tuple[int, tuple[tuple[int, int], ...]] | None = None


def explicit_prompt(
    model: ServedModel,
    messages: Sequence[ChatMessage],
    *,
    raw: bool,
    unset: frozenset[str],
    message: Generate | None = None,
) -> Prompt:
    """A whole conversation sent with the request (the OpenAI HTTP API), counted; the
    description of the request's tools (``message``'s) opens it."""
    described, offered = _tools(model, message)
    messages = (*described, *messages)
    tokens = model.engine.prompt_tokens(messages, raw=raw, tools=offered)
    return Prompt(messages, tokens, raw=raw, unset=unset)


def _tools(
    model: ServedModel, message: Generate | None
) -> tuple[list[ChatMessage], tools.Tools | None]:
    """How a request's tools reach the model: described in a system turn (the generic
    format), or, where the engine's chat template writes tools itself, given to the engine."""
    if message is None:
        return [], None
    if model.engine.native_tools:
        return [], tools.offered(message, model.engine.call_format)
    return tools.preamble(message), None


def token_prompt(
    model: ServedModel, ids: Sequence[int], unset: frozenset[str] = frozenset()
) -> Prompt:
    """A prompt of token ids (checked by the model), continued as they are: no chat template,
    no session history, and nothing of it kept in the session. Its one message is its text,
    for the audit record and the logs."""
    tokenizer = model.engine.tokenizer()
    text = tokenizer.decode(ids) if tokenizer is not None else ""
    check_fits(model, len(ids))
    return Prompt((ChatMessage("user", text),), len(ids), raw=True, unset=unset)


def check_fits(model: ServedModel, prompt_tokens: int) -> None:
    """A prompt must leave room for at least one token of reply; a reply that would run past
    the window ends with ``length`` when it is full."""
    engine = model.engine
    context_length = engine.info.context_length
    if prompt_tokens + engine.reply_overhead_tokens >= context_length:
        raise ContextOverflow(
            f"the prompt takes {prompt_tokens + engine.reply_overhead_tokens} tokens and the "
            f"model's context holds {context_length}; shorten it"
        )
    signed = model.context_refusal(prompt_tokens)
    if signed is not None:
        raise signed


def session_prompt(
    model: ServedModel,
    session: Session,
    message: Generate,
    preamble: Sequence[ChatMessage] = (),
) -> Prompt:
    """The session's history and the request's turns, trimmed so that the prompt leaves room
    for ``max_tokens``. ``preamble`` (the Responses API's ``instructions``), then the
    description of the request's tools, open the prompt and are never trimmed nor kept in the
    session.

    Turn counts are estimates (each message tokenized alone); an engine that counts the
    rendered prompt exactly may find more, and then the history is trimmed further.
    """
    engine, name = model.engine, model.name
    described, offered = _tools(model, message)
    preamble = [*preamble, *described]
    new_turns = [Turn(m, engine.count_message_tokens(m), name) for m in message.turns()]
    history = [] if message.reset else _history(model, session)
    max_tokens = message.max_tokens
    window = model.context_length  # the signed context_length, where it is lower
    fixed = sum(engine.count_message_tokens(m) for m in preamble)
    room = window - fixed
    for _ in range(4):
        try:
            context, estimate = fit_context(
                history,
                new_turns,
                context_length=room,
                reply_overhead=engine.reply_overhead_tokens,
                max_tokens=max_tokens,
            )
        except ContextOverflow:
            if window < engine.info.context_length:  # the signed limit is what refuses it
                need = sum(t.tokens for t in new_turns) + fixed
                refusal = model.context_refusal(need)
                if refusal is not None:
                    raise refusal from None
            raise
        messages = [*preamble, *(t.message for t in context)]
        exact = engine.prompt_tokens(messages, estimate + fixed, tools=offered)
        over = exact + max_tokens - window
        if exact <= estimate + fixed or over <= 0 or len(context) == len(new_turns):
            break
        room -= max(over, exact - estimate - fixed)
    kept = () if message.reset else _spans(history, context[: len(context) - len(new_turns)])
    return Prompt(tuple(messages), exact, new_turns, history=(len(preamble), kept))


def _spans(history: Sequence[Turn], kept: Sequence[Turn]) -> tuple[tuple[int, int], ...]:
    """Where the ``kept`` turns (in order, some dropped) lie in ``history``: spans counted
    from its end."""
    if len(kept) == len(history):
        return ((-len(history), 0),) if history else ()
    chosen = {id(turn) for turn in kept}
    spans: list[tuple[int, int]] = []
    end = len(history)
    for i, turn in enumerate(history):
        if id(turn) not in chosen:
            continue
        if spans and spans[-1][1] == i - end:
            spans[-1] = (spans[-1][0], i + 1 - end)
        else:
            spans.append((i - end, i + 1 - end))
    return tuple(spans)


def _history(model: ServedModel, session: Session) -> list[Turn]:
    """The session's turns, recounted if they were counted for another model."""
    engine, name = model.engine, model.name
    return [
        t if t.model == name else Turn(t.message, engine.count_message_tokens(t.message), name)
        for t in session.turns
    ]
