"""One ``generate`` request, from admission to its ``done`` (or ``error``) frame.

A :class:`Generation` runs in its own task and writes every frame to its stream log
(:mod:`seedance.streams`); the connections reading the log send them. It knows its
:class:`Requester` (tenant, session, model, the connection it came from), not the socket, so it
can outlive the connection: a ``resumable`` generation runs on for ``--resume-grace`` after its
last reader left. Cancelling the task aborts it: the engine's iterator is closed, which stops
the engine. When the cancel came from a client (``cancel``, shutdown, the grace running out)
the ``done`` frame says ``cancelled``; when it came from the last reader leaving a request that
is not resumable, nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.observability.audit import kinds as audit
from seedance.observability.audit.records import json_text, text_sha256
from seedance.observability.logs import bind_request
from seedance.observability.metrics import RequestMeter
from seedance.observability.tracing import Attributes, request_attributes
from seedance.protocol.codec import encode_error, encode_frame
from seedance.protocol.errors import EngineError, InternalError, Overloaded, SeedanceError
from seedance.protocol.messages import (
    ChatMessage,
    DoneFrame,
    FinishReason,
    Generate,
    RequestId,
    StartFrame,
    Timing,
    Usage,
    ms,
)
from seedance.sessions.session import Session, Turn
from seedance.streams.log import StreamLog
from seedance.tenants.auth import Principal

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from seedance.observability.tracing import ConnectionTrace
    from seedance.server.state import ServedModel, ServerState

logger = logging.getLogger(__name__)


def new_request_id() -> RequestId:
    return RequestId("r-" + secrets.token_hex(6))


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asked for a generation: what its accounting, trace and audit record name."""

    principal: Principal
    session: Session
    model: ServedModel
    connection_id: str
    connection_trace: ConnectionTrace

    @property
    def tenant(self) -> str:
        return self.principal.name


class Generation:
    """The state of one request; :meth:`run` is its task."""

    def __init__(
        self,
        state: ServerState,
        requester: Requester,
        log: StreamLog,
        message: Generate,
        request_id: RequestId,
        new_turns: list[Turn],
        context: list[Turn],
        prompt_tokens: int,
        received: float,
        trace_parent: Context | None,
    ) -> None:
        self.state = state
        self.requester = requester
        self.log = log
        self.message = message
        self.request_id = request_id
        self.new_turns = new_turns
        self.context = context
        self.prompt_tokens = prompt_tokens
        self.received = received
        self.admitted_at: float | None = None
        self.completion_tokens = 0
        self.parts = log.texts  # the reply's text as logged
        self.cancel_requested = False
        self.ending = False  # past the engine: a cancel comes too late
        #: The done or error frame, logged once the audit record is written ("": none).
        self.terminal = ""
        self.task: asyncio.Task[None] | None = None
        self._grace: asyncio.TimerHandle | None = None
        model = requester.model
        self.trace = state.tracing.request(
            f"chat {model.name}",
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
        )
        self.error: SeedanceError | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"generate-{self.request_id}")

    def cancel(self, *, silent: bool) -> None:
        """Abort; unless ``silent``, the log (and every reader) gets a ``done`` saying
        ``cancelled``."""
        if self.task is not None and not self.task.done() and not self.ending:
            self.cancel_requested = not silent
            self.task.cancel()

    def reader_left(self) -> None:
        """A reader detached. With none left, a request that is not resumable is aborted at
        once; a resumable one runs on for the grace period, then ends ``cancelled``."""
        if self.log.readers or self.task is None or self.task.done():
            return
        if not self.log.resumable:
            self.cancel(silent=True)
        elif self._grace is None:
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
        try:
            await self._run()
        finally:
            self.state.generation_ended(self, self.terminal)

    async def _run(self) -> None:
        requester = self.requester
        state = self.state
        session = requester.session
        model = requester.model
        outcome = ""
        audited: Future[None] | None = None
        bind_request(self.request_id, self.trace_id)
        if state.config.log_prompts:
            logger.debug(
                "request %s prompt=%r", self.request_id, [t.message for t in self.new_turns]
            )
        try:
            tenant = requester.principal.tenant
            # Room for the new turns' history (a reset frees what the session held).
            growth = sum(t.size for t in self.new_turns)
            if self.message.reset:
                growth -= session.size
            if growth > 0:
                await state.sessions.reserve(session, growth, tenant.quotas.session_bytes)
            await model.admission.acquire(
                self.message.priority, tenant=tenant.name, weight=tenant.tier
            )
            self.admitted_at = time.monotonic()
            self.meter.admitted(self.admitted_at, self.prompt_tokens)
            self.log.open(
                encode_frame(
                    StartFrame(
                        request_id=self.request_id,
                        trace_id=self.trace_id,
                        model=model.name,
                        prompt_tokens=self.prompt_tokens,
                    )
                )
            )
            finish = await self._stream()
            reply = "".join(self.parts)
            answer = ChatMessage("assistant", reply)
            # The reply's tokens are known: no need to tokenize it again.
            reply_tokens = self.completion_tokens + model.engine.message_overhead_tokens
            turns = [*self.new_turns, Turn(answer, reply_tokens, model.name)]
            session.commit(
                turns, reset=self.message.reset, max_tokens=model.engine.info.context_length
            )
            await state.sessions.save(session)
            outcome, self.terminal = finish, self._done(finish)
        except asyncio.CancelledError:
            if not self.cancel_requested:
                outcome = "aborted"
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
                task.uncancel()  # the cancel was ours and is handled here
            outcome, self.terminal = "cancelled", self._done("cancelled")
        except SeedanceError as exc:
            outcome = exc.code
            self.error = exc
            self.terminal = encode_error(exc, self.request_id)
        except Exception:
            outcome = "internal_error"
            logger.exception("request %s failed", self.request_id)
            self.error = InternalError(f"internal error on request {self.request_id}")
            self.terminal = encode_error(self.error, self.request_id)
        finally:
            self.ending = True
            self.reader_joined()  # no grace timer past the end
            if self.admitted_at is not None:
                model.admission.release()
            state.usage.end_request(requester.tenant, self.completion_tokens)
            session.end(self.request_id)
            self.meter.ended(time.monotonic(), outcome or "aborted")
            self._end_trace(outcome or "aborted")
            self._log(outcome)
            audited = state.audit_submit(lambda: self._audit_record(outcome))
        try:  # the reply ends once its record is on disk
            await state.audit_wait(audited, f"request {self.request_id}")
        except Overloaded as unaudited:
            if self.error is None:  # a reply that cannot be audited is not confirmed
                self.terminal = encode_error(unaudited, self.request_id)

    async def _stream(self) -> FinishReason:
        """Run the engine and log its tokens; returns the finish reason."""
        log = self.log
        message = self.message
        clock = time.monotonic
        request = GenerationRequest(
            request_id=self.request_id,
            messages=tuple(t.message for t in self.context),
            params=SamplingParams.of(message),
            prompt_tokens=self.prompt_tokens,
            priority=message.priority,
        )
        stream = self.requester.model.engine.generate(request)
        meter = self.meter
        try:
            async for delta in stream:
                if delta.tokens:
                    meter.tokens(clock(), delta.tokens)
                    log.append(delta.text, delta.tokens)
                    if log.congested:
                        await log.wait_writable()
                    self.completion_tokens += delta.tokens
                if delta.finish_reason is not None:
                    return delta.finish_reason
            return "stop"
        except (asyncio.CancelledError, SeedanceError):
            raise
        except Exception as exc:
            logger.exception("engine failed on request %s", self.request_id)
            raise EngineError(f"the model failed on request {self.request_id}; retry") from exc
        finally:
            await stream.aclose()

    def _audit_record(self, outcome: str) -> audit.Request:
        requester = self.requester
        model = requester.model
        messages = [{"role": t.message.role, "content": t.message.content} for t in self.context]
        timing = self._timing()
        return audit.Request(
            api="websocket",
            tenant=requester.tenant,
            credential=requester.principal.credential,
            connection=requester.connection_id,
            session=requester.session.session_id,
            request_id=self.request_id,
            trace_id=self.trace_id,
            model=model.name,
            model_version=model.engine.info.version,
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
        return {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": requester.model.name,
            **request_attributes(message),
            "seedance.engine": requester.model.engine.info.engine,
            "seedance.request_id": self.request_id,
            "seedance.tenant": requester.tenant,
            "seedance.session_id": requester.session.session_id,
            "seedance.connection_id": requester.connection_id,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
        }

    def _end_trace(self, outcome: str) -> None:
        if self.trace.span is None:
            return
        error = self.error
        self.trace.end(
            received=self.received,
            admitted=self.admitted_at,
            first_token=self.first_token_at,
            last_token=self.meter.last_token,
            outcome=outcome,
            error=None if error is None else (error.code, error.message),
            attributes={
                "gen_ai.response.id": self.request_id,
                "gen_ai.response.model": self.requester.model.name,
                "gen_ai.usage.output_tokens": self.completion_tokens,
            },
        )

    @property
    def first_token_at(self) -> float | None:
        return self.meter.first_token

    def _timing(self) -> Timing:
        """Milliseconds from the moment the frame was read: queued, first token, total."""
        now = time.monotonic()
        return Timing(
            queue_ms=ms((self.admitted_at or now) - self.received),
            ttft_ms=None
            if self.first_token_at is None
            else ms(self.first_token_at - self.received),
            total_ms=ms(now - self.received),
        )

    def _done(self, finish: FinishReason) -> str:
        text = None if self.message.stream else "".join(self.parts)
        return encode_frame(
            DoneFrame(
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
            )
        )

    def _log(self, outcome: str) -> None:
        requester = self.requester
        if not logger.isEnabledFor(logging.INFO):  # the line's figures cost more than the check
            return
        timing = self._timing()
        logger.info(
            "request %s conn=%s tenant=%s session=%s model=%s outcome=%s prompt_tokens=%d "
            "completion_tokens=%d queue_ms=%.1f ttft_ms=%s total_ms=%.1f",
            self.request_id,
            requester.connection_id,
            requester.tenant,
            requester.session.session_id,
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
