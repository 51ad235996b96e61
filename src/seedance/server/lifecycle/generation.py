"""One admitted request's lifecycle, whatever API asked for it: admission to the last frame.

A :class:`Generation` owns each begin/end pair (usage, the session's busy mark, the admission
slot), runs the engine, and writes every frame to its stream log (:mod:`seedance.streams`):
``start``, the tokens by ``seq``, and ``done`` or ``error`` once the audit record is written.
It knows its :class:`~seedance.server.lifecycle.admit.Requester`, not a socket: transports are
readers of the log (:mod:`seedance.server.lifecycle.reader`), so a ``resumable`` generation
runs on for ``--resume-grace`` after its last reader left, and another connection can resume
it.

Cancelling the task aborts the generation: the engine's iterator is closed, which stops the
engine. A cancel that a client asked for (``cancel``, shutdown, the grace running out) ends
the log with a ``done`` that says ``cancelled``; the last reader of a request that is not
resumable leaving ends it with nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec
from msgspec import UNSET

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.observability.audit import kinds as audit
from seedance.observability.audit.records import json_text, text_sha256
from seedance.observability.logs import bind_request
from seedance.observability.metrics import RequestMeter
from seedance.observability.tracing import request_attributes
from seedance.protocol import tools
from seedance.protocol.codec import error_frame
from seedance.protocol.errors import (
    EngineError,
    InternalError,
    ModuleError,
    Overloaded,
    SeedanceError,
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
    ToolCallTurn,
    Usage,
    ms,
)
from seedance.protocol.qos import QoS
from seedance.protocol.schemas import output_schema
from seedance.server.lifecycle.request import Prompt, Requester, session_prompt
from seedance.sessions.session import Turn
from seedance.streams.log import StreamLog

if TYPE_CHECKING:
    from seedance.cluster.claims import Claim
    from seedance.cluster.node import ClusterNode
    from seedance.config import ServerConfig
    from seedance.observability.metrics import Metrics
    from seedance.server.lifecycle.audit import AuditGate
    from seedance.server.lifecycle.refusals import Arrival
    from seedance.server.modules import RequestModules
    from seedance.sessions.store import SessionStore
    from seedance.tenants.usage import Usage as TenantUsage

logger = logging.getLogger(__name__)


#: What a generation does when its last reader leaves: stop at once, run on for
#: ``--resume-grace`` (a resumable request), or run to its end (a background response).
WithoutReaders = Literal["abort", "grace", "finish"]


class Registry(Protocol):
    def ended(self, generation: Generation) -> None:
        """``generation`` is over (its log gets its last frame)."""


class Parts(Protocol):
    """What a generation uses of the server's parts (the
    :class:`~seedance.server.lifecycle.services.Services` it is handed)."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def sessions(self) -> SessionStore: ...
    @property
    def usage(self) -> TenantUsage: ...
    @property
    def audit(self) -> AuditGate: ...
    @property
    def cluster(self) -> ClusterNode | None: ...
    @property
    def generations(self) -> Registry: ...


class Generation:
    """The state of one admitted request; :meth:`run` is its task."""

    def __init__(
        self,
        services: Parts,
        arrival: Arrival,
        requester: Requester,
        log: StreamLog,
        message: Generate,
        prompt: Prompt,
        *,
        qos: QoS | None = None,
        without_readers: WithoutReaders | None = None,
        modules: RequestModules | None = None,
    ) -> None:
        self.services = services
        self.without_readers: WithoutReaders = without_readers or (
            "grace" if log.resumable else "abort"
        )
        self.requester = requester
        self.log = log
        self.message = message
        self.request_id = RequestId(log.request_id)
        self.prompt = prompt
        self.prompt_tokens = prompt.tokens
        self.received = arrival.received
        self.operation = arrival.operation
        self.policies = arrival.policies  # the access policies that allowed it
        self.qos = qos  # the quality of service it was admitted with (X-QoS-Priority)
        self.admitted_at: float | None = None
        self.completion_tokens = 0
        self.parts = log.texts  # the reply's text as logged
        self.cancel_requested = False
        self.handed_off = False  # stopped unfinished for another node to take over
        self.ending = False  # past the engine: a cancel comes too late
        #: The done or error frame, logged once the audit record is written (None: none).
        self.end: DoneFrame | ErrorFrame | None = None
        #: The tools the request offers, for the engine's call format (None: none).
        self.tools = tools.offered(message, requester.model.engine.call_format)
        #: The calls the reply made, when the request offered tools (None: it offered none).
        self.tool_calls: list[ToolCallTurn] | None = None
        self.outcome = ""
        self.task: asyncio.Task[None] | None = None
        self._running = False  # the task has begun
        self._cancel_first = False  # cancelled before it began: it stops at its first step
        self._grace: asyncio.TimerHandle | None = None
        model = requester.model
        self.trace = arrival.trace  # opened when the request was read
        self.trace_id = self.trace.trace_id
        self.meter = RequestMeter(
            services.metrics,
            model.name,
            model.engine.info.engine,
            requester.tenant,
            self.received,
            self.trace.token_times,
            qos,
            model.version,
        )
        self.error: SeedanceError | None = None
        #: Its hold on the session and the tenant's quotas in the cluster (cluster mode).
        self.claim: Claim | None = None
        #: The tenant's WebAssembly modules it runs through (None: none), and the reply as the
        #: post-processors left it (None: none ran).
        self.modules = modules
        self.post_text: str | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"generate-{self.request_id}")

    def cancel(self, *, silent: bool) -> None:
        """Abort; unless ``silent``, the log (and every reader) gets a ``done`` saying
        ``cancelled``."""
        if self.task is not None and not self.task.done() and not self.ending:
            self.cancel_requested = not silent
            if self._running:
                self.task.cancel()
            else:  # a task cancelled before its first step never runs: no end, nothing freed
                self._cancel_first = True

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
            grace_s = self.services.config.resume.grace_s
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
                self.services.config.resume.grace_s,
            )
            self.cancel(silent=False)

    async def run(self) -> None:
        """The task: the generation, then its log's last frame, whatever happened."""
        requester = self.requester
        services = self.services
        session = requester.session
        model = requester.model
        audited: Future[int] | None = None
        self._running = True
        bind_request(self.request_id, self.trace_id)
        if services.config.log_prompts:
            logger.debug("request %s prompt=%r", self.request_id, self.prompt.new_turns)
        try:
            try:
                if self._cancel_first:
                    raise asyncio.CancelledError
                tenant = requester.principal.tenant
                if services.cluster is not None:
                    await self._claim()
                if session is not None:
                    # Room for the new turns' history (a reset frees what the session held).
                    growth = sum(t.size for t in self.prompt.new_turns)
                    if self.message.reset:
                        growth -= session.size
                    if growth > 0:
                        await services.sessions.reserve(
                            session, growth, tenant.quotas.session_bytes
                        )
                if self.modules is not None and self.modules.pre:
                    self.prompt = await self.modules.preprocess(self.prompt, model)
                    self.prompt_tokens = self.prompt.tokens
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
                text = "".join(self.parts)
                self.tool_calls = self._calls(text)  # an unparsable call fails the request
                if self.modules is not None and self.modules.post:
                    text = self.post_text = await self.modules.postprocess(text)
                if session is not None and self.message.prompt_ids is None:
                    reply = ChatMessage("assistant", text)
                    if self.tool_calls:  # kept as calls: a prompt writes them its own way
                        reply = ChatMessage("assistant", "", tool_calls=tuple(self.tool_calls))
                    # The reply's tokens are known: no need to tokenize it again.
                    reply_tokens = self.completion_tokens + model.engine.message_overhead_tokens
                    turns = [*self.prompt.new_turns, Turn(reply, reply_tokens, model.name)]
                    session.commit(turns, reset=self.message.reset, max_tokens=model.context_length)
                    await services.sessions.save(session, with_end=self.log)
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
                services.usage.end_request(requester.tenant, self.completion_tokens)
                if session is not None:
                    session.end(self.request_id)
                outcome = self.outcome or "aborted"
                self.meter.ended(time.monotonic(), outcome, len(self.tool_calls or ()))
                self._end_trace(outcome)
                self._log(outcome)
                audited = services.audit.submit(lambda: self._audit_record(outcome))
            try:  # the reply ends once its record is on disk
                seq = await services.audit.wait(audited, f"request {self.request_id}")
                if isinstance(self.end, DoneFrame):
                    self.end.audit_seq = seq
            except Overloaded as unaudited:
                if self.error is None:  # a reply that cannot be audited is not confirmed
                    self.end = error_frame(unaudited, self.request_id)
        finally:
            if self.claim is not None:
                await self._release()
            services.generations.ended(self)

    async def _claim(self) -> None:
        """Cluster mode: lock the session (or the request's own log, when it is in Redis) and
        reserve the tenant's quotas; the log is written to Redis under that lock from now
        on."""
        from seedance.cluster.streams import ReplicatedLog

        cluster = self.services.cluster
        assert cluster is not None
        requester = self.requester
        session = requester.session
        log = self.log
        if self.claim is None:  # else a generation taken over: its claim is made
            tenant = requester.principal.tenant
            shared = isinstance(log, ReplicatedLog)
            self.claim = await cluster.claims.claim(
                self.request_id,
                tenant.name,
                requester.log_key(self.request_id) if shared else None,
                tenant.quotas,
                self.prompt_tokens + self.message.max_tokens,
                peek=None if session is None else cluster.sessions.hash_key(session),
            )
            version = self.claim.session_version
            if session is not None and await cluster.sessions.refresh(session, version):
                # Another node saved a newer context: continue that one.
                self.prompt = session_prompt(requester.model, session, self.message)
                self.prompt_tokens = self.prompt.tokens
        if isinstance(log, ReplicatedLog) and self.claim.lock is not None:
            log.own(self.claim.lock[1], self.header())
            log.on_lost = lambda: self.cancel(silent=True)
            self.claim.on_lost = log.lose  # cut off from Redis past the lease

    async def _release(self) -> None:
        """Cluster mode: the end is in Redis before any reader sees it (None: this node may
        not write it: another node has the stream), then the claim is given back."""
        from seedance.cluster.streams import ReplicatedLog

        cluster = self.services.cluster
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
                # Past a failover too (the claims' cut-off, which gives the end up sooner
                # when Redis stays away).
                written = await asyncio.wait_for(
                    log.write_end(self.end), 2 * cluster.claims.cut_off_s
                )
            except asyncio.TimeoutError:
                written = False
            if written:
                self.claim.lock = None  # the end's script released it
                self.claim.on_lost = None
            else:
                log.lost = True
                self.end = None
        release = cluster.claims.release(self.claim, self.prompt_tokens, self.completion_tokens)
        if isinstance(log, ReplicatedLog) and log.lost:
            # This node may not write here any more (cut off from Redis, or fenced out): its
            # readers move now, and the claim is given back meanwhile (or expires).
            cluster.link.spawn(release, f"release-{self.request_id}")
        else:
            await release

    def header(self) -> bytes:
        """What a node taking this generation over needs (cluster mode), as Redis keeps it
        with the ``start`` frame: the request, its prompt as the engine saw it, who asked,
        and the trace it belongs to (:mod:`seedance.server.lifecycle.takeover`)."""
        requester = self.requester
        principal = requester.principal
        prompt = self.prompt
        log = self.log
        session = requester.session
        qos = self.qos  # its class and tag (the health it reported is counted where it began)
        return msgspec.json.encode(
            {
                "tenant": requester.tenant,
                "credential": principal.credential,
                "role": principal.role,
                "session": None if session is None else session.session_id,
                "log_key": requester.log_key(self.request_id),
                "model": requester.model.name,
                "api": requester.api,
                "operation": self.operation,
                "qos": None if qos is None else QoS(qos.service_class, qos.slatag).header(),
                "request": {  # what was left out comes back as the default (None)
                    k: v for k, v in msgspec.to_builtins(self.message).items() if v is not None
                },
                **self._prompt_header(),
                "prompt_tokens": prompt.tokens,
                "raw": prompt.raw,
                "unset": sorted(prompt.unset),
                "resumable": log.resumable,
                "stream": log.stream,
                "meta": log.meta,
                "traceparent": self.trace.traceparent,
                "tracestate": self.trace.tracestate,
            }
        )

    def _prompt_header(self) -> dict[str, Any]:
        """The prompt as a takeover rebuilds it: its messages; or, continuing a session, those
        before its history (a description of tools, instructions), and where the session's
        saved turns it holds lie (a long conversation's takeover header stays as small as its
        first exchange's), the request's own turns following them."""
        prompt, session = self.prompt, self.requester.session
        messages = prompt.messages
        cluster = self.services.cluster
        if (
            prompt.history is None
            or session is None
            or session.unsaved
            or session.cleared
            or cluster is None
        ):
            return {"messages": [[m.role, m.content] for m in messages]}
        at, spans = prompt.history
        return {
            "messages": [[m.role, m.content] for m in messages[:at]],
            "history": [spans, cluster.sessions.version(session)],
        }

    async def _stream(self) -> FinishReason:
        """Run the engine and log its tokens; returns the finish reason."""
        log = self.log
        message = self.message
        prompt = self.prompt
        clock = time.monotonic
        params = SamplingParams.of(message, prompt.unset, self.tools)
        requester = self.requester
        request = GenerationRequest(
            request_id=self.request_id,
            messages=prompt.messages,
            params=params,
            prompt_tokens=self.prompt_tokens,
            priority=message.priority,
            qos_class=self.qos.service_class if self.qos is not None else None,
            raw=prompt.raw,
            prompt_ids=None if message.prompt_ids is None else tuple(message.prompt_ids),
            traceparent=self.trace.traceparent,
            tracestate=self.trace.tracestate,
            tenant=requester.tenant,
            session_id=None if requester.session is None else requester.session.session_id,
        )
        already = self.completion_tokens  # a generation taken over: the reply so far
        if already:
            continued = request.continued("".join(log.texts), already)
            if continued is None:
                return "length"
            request = continued
        stream = requester.model.engine.generate(request)
        if self.modules is not None and self.modules.filters:
            stream = self.modules.filter(stream)
        tokens_at = self.meter.tokens
        # StreamLog.append, inline: the token path costs no more than before the log.
        texts = log.texts.append
        logprobs = log.logprobs  # None unless the request asked for them
        token_ids = log.token_ids  # likewise
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
                    if logprobs is not None and delta.logprobs:
                        logprobs.extend(delta.logprobs)
                    if token_ids is not None and delta.ids:
                        token_ids.extend(delta.ids)
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
        message = self.message
        schema = message.schema
        schema_sha256 = UNSET if schema is None else text_sha256(output_schema(schema, "").text)
        reply = "".join(self.parts)
        calls = self.tool_calls
        tool_calls = UNSET if calls is None else len(calls)
        error = self.error
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
            completion_sha256=text_sha256(reply),
            schema_sha256=schema_sha256,
            tool_calls=tool_calls,
            modules=UNSET if self.modules is None else self.modules.labels,
            module_error=error.reason if isinstance(error, ModuleError) and error.reason else UNSET,
            policies=UNSET if self.policies is None else list(self.policies),
            priority=message.priority,
            qos=UNSET if self.qos is None else self.qos.service_class,
            slatag=UNSET if self.qos is None or self.qos.slatag is None else self.qos.slatag,
            outcome=outcome,
            queue_ms=timing.queue_ms,
            ttft_ms=timing.ttft_ms,
            total_ms=timing.total_ms,
        )

    def _end_trace(self, outcome: str) -> None:
        trace = self.trace
        if trace.span is None:
            return
        error = self.error
        model = self.requester.model
        requester = self.requester
        attributes: dict[str, str | int | float] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.response.id": self.request_id,
            "gen_ai.request.model": model.name,
            "gen_ai.response.model": model.name,
            "seedance.engine": model.engine.info.engine,
            "seedance.request_id": self.request_id,
            "seedance.tenant": requester.tenant,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
        }
        if requester.session is not None:
            attributes["seedance.session_id"] = requester.session.session_id
        if requester.connection_id is not None:
            attributes["seedance.connection_id"] = requester.connection_id
        attributes.update(request_attributes(self.message))
        if self.tool_calls is not None:
            attributes["seedance.response.tool_calls"] = len(self.tool_calls)
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

    def _calls(self, text: str) -> list[ToolCallTurn] | None:
        """The calls ``text``, the whole reply, makes, checked against the request's tools
        (None: it offered none); a call it began and did not make whole raises."""
        if self.tools is None:
            return None
        try:
            return tools.parse_calls(text, self.tools, self.request_id) or []
        except tools.BadToolCall as exc:
            exc.request_id = self.request_id
            raise

    def _done(self, finish: FinishReason) -> DoneFrame:
        text = logprobs = None
        if not self.message.stream:
            text, logprobs = "".join(self.parts), self.log.logprobs
            if self.post_text is not None:
                text = self.post_text
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
            logprobs=logprobs,
            tool_calls=self.tool_calls or None,
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
        if self.services.config.log_prompts and self.parts:
            logger.debug("request %s completion=%r", self.request_id, "".join(self.parts))
