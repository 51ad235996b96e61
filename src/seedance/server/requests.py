"""One request's lifecycle, whatever transport asked for it: admission to the last frame.

:func:`admit` runs the checks every request meets, in one order for every transport (the
server draining, the audit log, the priority, the session busy, the context window, the
tenant's quotas), and starts a :class:`Generation`. The generation owns each begin/end pair
(usage, the session's busy mark, the admission slot), runs the engine, and writes every frame
to its stream log (:mod:`seedance.streams`): ``start``, the tokens by ``seq``, and ``done`` or
``error`` once the audit record is written. It knows its :class:`Requester`, not a socket:
transports are readers of the log (a WebSocket connection, an OpenAI SSE response), so a
``resumable`` generation runs on for ``--resume-grace`` after its last reader left, and
another connection can resume it.

Cancelling the task aborts the generation: the engine's iterator is closed, which stops the
engine. A cancel that a client asked for (``cancel``, shutdown, the grace running out) ends
the log with a ``done`` that says ``cancelled``; the last reader of a request that is not
resumable leaving ends it with nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from msgspec import UNSET, structs

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.observability.audit import kinds as audit
from seedance.observability.audit.records import json_text, text_sha256
from seedance.observability.logs import bind_request
from seedance.observability.metrics import RequestMeter
from seedance.observability.tracing import Attributes, request_attributes
from seedance.protocol.codec import error_frame
from seedance.protocol.errors import (
    ContextOverflow,
    EngineError,
    InternalError,
    Overloaded,
    SeedanceError,
    SessionBusy,
)
from seedance.protocol.messages import (
    ChatMessage,
    DoneFrame,
    ErrorFrame,
    FinishReason,
    Generate,
    RequestId,
    StartFrame,
    Timing,
    Usage,
    ms,
)
from seedance.protocol.qos import QoS, parse_qos
from seedance.sessions.context import fit_context
from seedance.sessions.session import Session, Turn
from seedance.streams.log import StreamLog
from seedance.tenants.auth import Principal
from seedance.tenants.policy import check_priority

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from seedance.cluster.claims import Claim
    from seedance.observability.tracing import ConnectionTrace, RequestTrace
    from seedance.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)


#: What a generation does when its last reader leaves: stop at once, run on for
#: ``--resume-grace`` (a resumable request), or run to its end (a background response).
WithoutReaders = Literal["abort", "grace", "finish"]


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


def admit(
    state: ServerState,
    requester: Requester,
    message: Generate,
    request_id: RequestId,
    received: float,
    *,
    prompt: Prompt | None = None,
    operation: str = "chat",
    trace_parent: Context | None = None,
    trace: RequestTrace | None = None,
    without_readers: WithoutReaders | None = None,
) -> Generation:
    """Check a request and start its generation; raises the :class:`SeedanceError` that
    refuses it. The same checks, in the same order, for every transport. Without ``prompt``
    the request continues ``requester.session`` (its history trimmed to fit).
    ``without_readers``: what the generation does when its last reader leaves (by default
    ``grace`` for a resumable request, else ``abort``)."""
    if state.draining:
        raise Overloaded("the server is shutting down; retry on another server")
    state.check_cluster()
    state.check_audit()
    qos = parse_qos(message.qos) if message.qos is not None else requester.qos
    if qos is not None and message.priority == 0:
        # The class's priority, lowered to the tenant's highest (never refused for it).
        highest = requester.principal.tenant.max_priority
        message = structs.replace(message, priority=qos.priority_within(highest))
    check_priority(requester.principal, message.priority)
    session = requester.session
    if session is not None and session.active_request is not None:
        raise SessionBusy(
            f"request {session.active_request} is still running on this session; "
            "cancel it or wait for its done frame"
        )
    if prompt is None:
        assert session is not None
        prompt = session_prompt(requester.model, session, message)
    else:
        check_fits(requester.model, prompt.tokens)
    usage = state.usage
    tenant = requester.tenant
    usage.start_request(
        tenant, requester.principal.tenant.quotas, prompt.tokens, message.max_tokens
    )
    try:
        log = state.streams.open(
            tenant,
            requester.log_key(request_id),
            request_id,
            resumable=message.resumable,
            stream=message.stream,
        )
        generation = Generation(
            state,
            requester,
            log,
            message,
            request_id,
            prompt,
            received,
            operation=operation,
            trace_parent=trace_parent,
            trace=trace,
            qos=qos,
            without_readers=without_readers,
        )
    except BaseException:
        usage.end_request(tenant, 0)
        raise
    if session is not None:
        session.begin(request_id)
    state.generation_started(generation)
    return generation


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


def session_prompt(
    model: ServedModel,
    session: Session,
    message: Generate,
    preamble: Sequence[ChatMessage] = (),
) -> Prompt:
    """The session's history and the request's turns, trimmed so that the prompt leaves room
    for ``max_tokens``. ``preamble`` (the Responses API's ``instructions``) opens the prompt
    and is never trimmed nor kept in the session.

    Turn counts are estimates (each message tokenized alone); an engine that counts the
    rendered prompt exactly may find more, and then the history is trimmed further.
    """
    engine, name = model.engine, model.name
    new_turns = [Turn(m, engine.count_message_tokens(m), name) for m in message.turns()]
    history = [] if message.reset else _history(model, session)
    max_tokens = message.max_tokens
    fixed = sum(engine.count_message_tokens(m) for m in preamble)
    room = engine.info.context_length - fixed
    for _ in range(4):
        context, estimate = fit_context(
            history,
            new_turns,
            context_length=room,
            reply_overhead=engine.reply_overhead_tokens,
            max_tokens=max_tokens,
        )
        messages = [*preamble, *(t.message for t in context)]
        exact = engine.prompt_tokens(messages, estimate + fixed)
        over = exact + max_tokens - engine.info.context_length
        if exact <= estimate + fixed or over <= 0 or len(context) == len(new_turns):
            break
        room -= max(over, exact - estimate - fixed)
    return Prompt(tuple(messages), exact, new_turns)


def _history(model: ServedModel, session: Session) -> list[Turn]:
    """The session's turns, recounted if they were counted for another model."""
    engine, name = model.engine, model.name
    return [
        t if t.model == name else Turn(t.message, engine.count_message_tokens(t.message), name)
        for t in session.turns
    ]


class Generation:
    """The state of one admitted request; :meth:`run` is its task."""

    def __init__(
        self,
        state: ServerState,
        requester: Requester,
        log: StreamLog,
        message: Generate,
        request_id: RequestId,
        prompt: Prompt,
        received: float,
        *,
        operation: str = "chat",
        trace_parent: Context | None = None,
        trace: RequestTrace | None = None,
        qos: QoS | None = None,
        without_readers: WithoutReaders | None = None,
    ) -> None:
        self.state = state
        self.without_readers: WithoutReaders = without_readers or (
            "grace" if log.resumable else "abort"
        )
        self.requester = requester
        self.log = log
        self.message = message
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_tokens = prompt.tokens
        self.received = received
        self.operation = operation
        self.qos = qos  # the quality of service it was admitted with (X-QoS-Priority)
        self.admitted_at: float | None = None
        self.completion_tokens = 0
        self.parts = log.texts  # the reply's text as logged
        self.cancel_requested = False
        self.handed_off = False  # stopped unfinished for another node to take over
        self.ending = False  # past the engine: a cancel comes too late
        #: The done or error frame, logged once the audit record is written (None: none).
        self.end: DoneFrame | ErrorFrame | None = None
        self.outcome = ""
        self.task: asyncio.Task[None] | None = None
        self._grace: asyncio.TimerHandle | None = None
        model = requester.model
        self.trace = trace or state.tracing.request(
            f"{operation} {model.name}",
            trace_parent,
            received,
            self._span_attributes,
            requester.connection_trace,
        )
        self.trace_id = self.trace.trace_id
        self.meter = RequestMeter(
            state.metrics,
            model.name,
            model.engine.info.engine,
            requester.tenant,
            received,
            self.trace.token_times,
            qos,
            model.version,
        )
        self.error: SeedanceError | None = None
        #: Its hold on the session and the tenant's quotas in the cluster (cluster mode).
        self.claim: Claim | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"generate-{self.request_id}")

    def cancel(self, *, silent: bool) -> None:
        """Abort; unless ``silent``, the log (and every reader) gets a ``done`` saying
        ``cancelled``."""
        if self.task is not None and not self.task.done() and not self.ending:
            self.cancel_requested = not silent
            self.task.cancel()

    def hand_off(self) -> None:
        """Cluster mode, this node stopping: stop without an end, and release the lock, so
        that another node takes the generation over where it stopped."""
        self.handed_off = True
        self.cancel(silent=True)

    def reader_left(self) -> None:
        """A reader detached. With none left, a request that is not resumable is aborted at
        once; a resumable one runs on for the grace period, then ends ``cancelled``; one in
        the background (the Responses API's ``background``) runs to its end."""
        if self.log.readers or self.task is None or self.task.done():
            return
        policy = self.without_readers
        if policy == "abort":
            self.cancel(silent=True)
        elif policy == "grace" and self._grace is None:
            grace_s = self.state.config.resume_grace_s
            self._grace = asyncio.get_running_loop().call_later(grace_s, self._abandon)

    def reader_joined(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _abandon(self) -> None:
        self._grace = None
        if not self.log.readers:
            logger.info(
                "request %s: no reader for %g s, cancelling",
                self.request_id,
                self.state.config.resume_grace_s,
            )
            self.cancel(silent=False)

    async def run(self) -> None:
        """The task: the generation, then its log's last frame, whatever happened."""
        requester = self.requester
        state = self.state
        session = requester.session
        model = requester.model
        audited: Future[None] | None = None
        bind_request(self.request_id, self.trace_id)
        if state.config.log_prompts:
            logger.debug("request %s prompt=%r", self.request_id, self.prompt.new_turns)
        try:
            try:
                tenant = requester.principal.tenant
                if state.cluster is not None:
                    await self._claim()
                if session is not None:
                    # Room for the new turns' history (a reset frees what the session held).
                    growth = sum(t.size for t in self.prompt.new_turns)
                    if self.message.reset:
                        growth -= session.size
                    if growth > 0:
                        await state.sessions.reserve(session, growth, tenant.quotas.session_bytes)
                await model.admission.acquire(
                    self.message.priority, tenant=tenant.name, weight=tenant.tier
                )
                self.admitted_at = time.monotonic()
                self.meter.admitted(self.admitted_at, self.prompt_tokens)
                if self.log.start is None:  # else a generation taken over: it has begun
                    self.log.open(
                        StartFrame(
                            request_id=self.request_id,
                            trace_id=self.trace_id,
                            model=model.name,
                            prompt_tokens=self.prompt_tokens,
                        )
                    )
                finish = await self._stream()
                if session is not None:
                    reply = ChatMessage("assistant", "".join(self.parts))
                    # The reply's tokens are known: no need to tokenize it again.
                    reply_tokens = self.completion_tokens + model.engine.message_overhead_tokens
                    turns = [*self.prompt.new_turns, Turn(reply, reply_tokens, model.name)]
                    session.commit(
                        turns, reset=self.message.reset, max_tokens=model.engine.info.context_length
                    )
                    await state.sessions.save(session)
                self.outcome, self.end = finish, self._done(finish)
            except asyncio.CancelledError:
                if not self.cancel_requested:
                    self.outcome = "aborted"
                    raise
                task = asyncio.current_task()
                if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
                    task.uncancel()  # the cancel was ours and is handled here
                self.outcome, self.end = "cancelled", self._done("cancelled")
            except SeedanceError as exc:
                self.outcome = exc.code
                self.error = exc
                self.end = error_frame(exc, self.request_id)
            except Exception:
                self.outcome = "internal_error"
                logger.exception("request %s failed", self.request_id)
                self.error = InternalError(f"internal error on request {self.request_id}")
                self.end = error_frame(self.error, self.request_id)
            finally:
                self.ending = True
                self.reader_joined()  # no grace timer past the end
                if self.admitted_at is not None:
                    model.admission.release()
                state.usage.end_request(requester.tenant, self.completion_tokens)
                if session is not None:
                    session.end(self.request_id)
                outcome = self.outcome or "aborted"
                self.meter.ended(time.monotonic(), outcome)
                self._end_trace(outcome)
                self._log(outcome)
                audited = state.audit_submit(lambda: self._audit_record(outcome))
            try:  # the reply ends once its record is on disk
                await state.audit_wait(audited, f"request {self.request_id}")
            except Overloaded as unaudited:
                if self.error is None:  # a reply that cannot be audited is not confirmed
                    self.end = error_frame(unaudited, self.request_id)
        finally:
            if self.claim is not None:
                await self._release()
            state.generation_ended(self, self.end)

    async def _claim(self) -> None:
        """Cluster mode: lock the session (or the request's own log) and reserve the
        tenant's quotas; the log is written to Redis under that lock from now on."""
        from seedance.cluster.streams import ReplicatedLog
        from seedance.cluster.takeover import header_of

        cluster = self.state.cluster
        assert cluster is not None
        requester = self.requester
        session = requester.session
        if self.claim is None:  # else a generation taken over: its claim is made
            tenant = requester.principal.tenant
            self.claim = await cluster.claims.claim(
                self.request_id,
                tenant.name,
                requester.log_key(self.request_id),
                tenant.quotas,
                self.prompt_tokens + self.message.max_tokens,
                peek=None if session is None else cluster.sessions.hash_key(session),
            )
            version = self.claim.session_version
            if session is not None and await cluster.sessions.refresh(session, version):
                # Another node saved a newer context: continue that one.
                self.prompt = session_prompt(requester.model, session, self.message)
                self.prompt_tokens = self.prompt.tokens
        log = self.log
        if isinstance(log, ReplicatedLog) and self.claim.lock is not None:
            log.own(self.claim.lock[1], header_of(self))
            log.on_lost = lambda: self.cancel(silent=True)

    async def _release(self) -> None:
        """Cluster mode: the end is in Redis before any reader sees it (None: this node may
        not write it: another node has the stream), then the claim is given back."""
        from seedance.cluster.streams import ReplicatedLog

        cluster = self.state.cluster
        assert cluster is not None and self.claim is not None
        log = self.log
        self.claim.ending = True
        if isinstance(log, ReplicatedLog):
            log.on_lost = None  # too late to stop, and a cycle (log -> self -> log) undone
        if self.handed_off:
            self.end = None  # no end: the lock goes, and another node goes on
            logger.info("request %s handed over to the cluster", self.request_id)
        elif isinstance(log, ReplicatedLog) and log.owned:
            try:
                written = await asyncio.wait_for(log.write_end(self.end), 2 * cluster.link.lease_s)
            except asyncio.TimeoutError:
                written = False
            if written:
                self.claim.lock = None  # the end's script released it
            else:
                log.lost = True
                self.end = None
        await cluster.claims.release(self.claim, self.prompt_tokens, self.completion_tokens)

    async def _stream(self) -> FinishReason:
        """Run the engine and log its tokens; returns the finish reason."""
        log = self.log
        message = self.message
        prompt = self.prompt
        clock = time.monotonic
        params = SamplingParams.of(message, prompt.unset)
        already = self.completion_tokens  # a generation taken over: the reply so far
        if already:
            if already >= params.max_tokens:
                return "length"
            params = dataclasses.replace(params, max_tokens=params.max_tokens - already)
        request = GenerationRequest(
            request_id=self.request_id,
            messages=prompt.messages,
            params=params,
            prompt_tokens=self.prompt_tokens,
            priority=message.priority,
            qos_class=self.qos.service_class if self.qos is not None else None,
            raw=prompt.raw,
            continuation="".join(log.texts) if already else "",
            continuation_tokens=already,
        )
        stream = self.requester.model.engine.generate(request)
        tokens_at = self.meter.tokens
        # StreamLog.append, inline: the token path costs no more than before the log.
        texts = log.texts.append
        produced = already  # self.completion_tokens, kept in a local while the engine runs
        try:
            async for delta in stream:
                n = delta.tokens
                if n:
                    text = delta.text
                    tokens_at(clock(), n)
                    texts(text)
                    if n != 1:
                        log.counted(n)
                    produced += n
                    push = log.push  # readers may join or leave between tokens
                    if push is not None:
                        push(text, n)
                    if log.behind:  # a reader's socket is behind: wait for it
                        await log.wait_writable()
                if delta.finish_reason is not None:
                    return delta.finish_reason
            return "stop"
        except (asyncio.CancelledError, SeedanceError):
            raise
        except Exception as exc:
            logger.exception("engine failed on request %s", self.request_id)
            raise EngineError(f"the model failed on request {self.request_id}; retry") from exc
        finally:
            self.completion_tokens = produced
            await stream.aclose()

    def _audit_record(self, outcome: str) -> audit.Request:
        requester = self.requester
        model = requester.model
        messages = [{"role": m.role, "content": m.content} for m in self.prompt.messages]
        timing = self._timing()
        session = requester.session
        return audit.Request(
            api=requester.api,
            tenant=requester.tenant,
            credential=requester.principal.credential,
            connection=requester.connection_id or UNSET,
            session=session.session_id if session is not None else UNSET,
            request_id=self.request_id,
            trace_id=self.trace_id,
            model=model.name,
            model_version=model.version or model.engine.info.version,
            engine=model.engine.info.engine,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            prompt_sha256=text_sha256(json_text(messages)),
            completion_sha256=text_sha256("".join(self.parts)),
            outcome=outcome,
            queue_ms=timing.queue_ms,
            ttft_ms=timing.ttft_ms,
            total_ms=timing.total_ms,
        )

    def _span_attributes(self) -> Attributes:
        """The request span's attributes when it opens (OpenTelemetry's GenAI names)."""
        requester, message = self.requester, self.message
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": requester.model.name,
            "seedance.engine": requester.model.engine.info.engine,
            "seedance.request_id": self.request_id,
            "seedance.tenant": requester.tenant,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
        }
        if requester.session is not None:
            attributes["seedance.session_id"] = requester.session.session_id
        if requester.connection_id is not None:
            attributes["seedance.connection_id"] = requester.connection_id
        return {**attributes, **request_attributes(message)}

    def _end_trace(self, outcome: str) -> None:
        trace = self.trace
        if trace.span is None:
            return
        error = self.error
        model = self.requester.model
        attributes: dict[str, str | int | float] = {
            "gen_ai.response.id": self.request_id,
            "gen_ai.request.model": model.name,
            "gen_ai.response.model": model.name,
            "seedance.engine": model.engine.info.engine,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
        }
        attributes.update(request_attributes(self.message))
        trace.span.update_name(f"{self.operation} {model.name}")
        trace.end(
            received=self.received,
            admitted=self.admitted_at,
            first_token=self.first_token_at,
            last_token=self.meter.last_token,
            outcome=outcome,
            error=None if error is None else (error.code, error.message),
            attributes=attributes,
        )

    @property
    def first_token_at(self) -> float | None:
        return self.meter.first_token

    def _timing(self) -> Timing:
        """Milliseconds from the moment the request was read: queued, first token, total."""
        now = time.monotonic()
        return Timing(
            queue_ms=ms((self.admitted_at or now) - self.received),
            ttft_ms=None
            if self.first_token_at is None
            else ms(self.first_token_at - self.received),
            total_ms=ms(now - self.received),
        )

    def _done(self, finish: FinishReason) -> DoneFrame:
        text = None if self.message.stream else "".join(self.parts)
        return DoneFrame(
            done=True,
            request_id=self.request_id,
            trace_id=self.trace_id,
            finish_reason=finish,
            usage=Usage(
                self.prompt_tokens,
                self.completion_tokens,
                self.prompt_tokens + self.completion_tokens,
            ),
            timing=self._timing(),
            text=text,
            model_version=self.requester.model.version or None,
        )

    def _log(self, outcome: str) -> None:
        if not logger.isEnabledFor(logging.INFO):  # the line's figures cost more than the check
            return
        requester = self.requester
        timing = self._timing()
        if requester.session is not None:
            where = f"conn={requester.connection_id} tenant={requester.tenant} "
            where += f"session={requester.session.session_id}"
        else:
            where = f"http={self.operation} tenant={requester.tenant}"
        logger.info(
            "request %s %s model=%s outcome=%s prompt_tokens=%d completion_tokens=%d "
            "queue_ms=%.1f ttft_ms=%s total_ms=%.1f",
            self.request_id,
            where,
            requester.model.name,
            outcome,
            self.prompt_tokens,
            self.completion_tokens,
            timing.queue_ms,
            "-" if timing.ttft_ms is None else f"{timing.ttft_ms:.1f}",
            timing.total_ms,
        )
        if self.state.config.log_prompts and self.parts:
            logger.debug("request %s completion=%r", self.request_id, "".join(self.parts))
