"""One request on a connection, from admission to its ``done`` (or ``error``) frame.

A :class:`Generation` runs in its own task. Cancelling the task aborts it: the engine's iterator
is closed, which stops the engine. When the cancel came from the client (``cancel``, shutdown),
the ``done`` frame says ``cancelled``; on a disconnect nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import Future
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
from seedance.server.outbound import TokenStream
from seedance.sessions.session import Turn

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from seedance.server.connection import Connection

logger = logging.getLogger(__name__)


def new_request_id() -> RequestId:
    return RequestId("r-" + secrets.token_hex(6))


class Generation:
    """The state of one request; :meth:`run` is its task."""

    def __init__(
        self,
        connection: Connection,
        message: Generate,
        request_id: RequestId,
        new_turns: list[Turn],
        context: list[Turn],
        prompt_tokens: int,
        received: float,
        trace_parent: Context | None,
    ) -> None:
        self.connection = connection
        self.message = message
        self.request_id = request_id
        self.new_turns = new_turns
        self.context = context
        self.prompt_tokens = prompt_tokens
        self.received = received
        self.admitted_at: float | None = None
        self.completion_tokens = 0
        self.parts: list[str] = []
        self.cancel_requested = False
        self.task: asyncio.Task[None] | None = None
        model = connection.model
        self.trace = connection.state.tracing.request(
            f"chat {model.name}", trace_parent, received, self._span_attributes, connection.trace
        )
        self.trace_id = self.trace.trace_id
        self.meter = RequestMeter(
            connection.state.metrics,
            model.name,
            model.engine.info.engine,
            connection.tenant,
            received,
            self.trace.token_times,
        )
        self.error: SeedanceError | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"generate-{self.request_id}")

    def cancel(self, *, silent: bool) -> None:
        """Abort; unless ``silent``, the client gets a ``done`` saying ``cancelled``."""
        if self.task is not None and not self.task.done():
            self.cancel_requested = not silent
            self.task.cancel()

    async def run(self) -> None:
        connection = self.connection
        out = connection.out
        model = connection.model
        outcome = ""
        terminal = ""  # the done or error frame, sent once the audit record is written
        audited: Future[None] | None = None
        bind_request(self.request_id, self.trace_id)
        if connection.config.log_prompts:
            logger.debug(
                "request %s prompt=%r", self.request_id, [t.message for t in self.new_turns]
            )
        try:
            tenant = connection.principal.tenant
            # Room for the new turns' history (a reset frees what the session held).
            growth = sum(t.size for t in self.new_turns)
            if self.message.reset:
                growth -= connection.session.size
            if growth > 0:
                await connection.state.sessions.reserve(
                    connection.session, growth, tenant.quotas.session_bytes
                )
            await model.admission.acquire(
                self.message.priority, tenant=tenant.name, weight=tenant.tier
            )
            self.admitted_at = time.monotonic()
            self.meter.admitted(self.admitted_at, self.prompt_tokens)
            out.put_soon(  # shares a write with the first token when that comes at once
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
            connection.session.commit(
                turns, reset=self.message.reset, max_tokens=model.engine.info.context_length
            )
            await connection.state.sessions.save(connection.session)
            outcome, terminal = finish, self._done(finish)
        except asyncio.CancelledError:
            if not self.cancel_requested:
                outcome = "aborted"
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11
                task.uncancel()  # the cancel was ours and is handled here
            outcome, terminal = "cancelled", self._done("cancelled")
        except SeedanceError as exc:
            outcome = exc.code
            self.error = exc
            terminal = encode_error(exc, self.request_id)
        except Exception:
            outcome = "internal_error"
            logger.exception("request %s failed", self.request_id)
            self.error = InternalError(f"internal error on request {self.request_id}")
            terminal = encode_error(self.error, self.request_id)
        finally:
            if self.admitted_at is not None:
                model.admission.release()
            connection.state.usage.end_request(connection.tenant, self.completion_tokens)
            connection.generation_ended(self)
            self.meter.ended(time.monotonic(), outcome or "aborted")
            self._end_trace(outcome or "aborted")
            self._log(outcome)
            audited = connection.state.audit_submit(lambda: self._audit_record(outcome))
        try:  # the reply ends once its record is on disk
            await connection.state.audit_wait(audited, f"request {self.request_id}")
        except Overloaded as unaudited:
            if self.error is None:  # a reply that cannot be audited is not confirmed
                terminal = encode_error(unaudited, self.request_id)
        out.put(terminal)

    async def _stream(self) -> FinishReason:
        """Run the engine and send its tokens; returns the finish reason."""
        connection = self.connection
        out = connection.out
        message = self.message
        clock = time.monotonic
        request = GenerationRequest(
            request_id=self.request_id,
            messages=tuple(t.message for t in self.context),
            params=SamplingParams.of(message),
            prompt_tokens=self.prompt_tokens,
            priority=message.priority,
        )
        merger = connection.state.merger
        tokens = TokenStream(self.request_id, merger) if message.stream else None
        stream = connection.model.engine.generate(request)
        meter = self.meter
        try:
            async for delta in stream:
                if delta.tokens:
                    meter.tokens(clock(), delta.tokens)
                    self.parts.append(delta.text)
                    if tokens is not None:
                        out.put_token(tokens, delta.text, delta.tokens)
                        if out.congested:
                            await out.wait_writable()
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
        connection = self.connection
        model = connection.model
        messages = [{"role": t.message.role, "content": t.message.content} for t in self.context]
        timing = self._timing()
        return audit.Request(
            api="websocket",
            tenant=connection.tenant,
            credential=connection.principal.credential,
            connection=connection.id,
            session=connection.session.session_id,
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
        connection, message = self.connection, self.message
        return {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": connection.model.name,
            **request_attributes(message),
            "seedance.engine": connection.model.engine.info.engine,
            "seedance.request_id": self.request_id,
            "seedance.tenant": connection.tenant,
            "seedance.session_id": connection.session.session_id,
            "seedance.connection_id": connection.id,
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
                "gen_ai.response.model": self.connection.model.name,
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
        connection = self.connection
        if not logger.isEnabledFor(logging.INFO):  # the line's figures cost more than the check
            return
        timing = self._timing()
        logger.info(
            "request %s conn=%s tenant=%s session=%s model=%s outcome=%s prompt_tokens=%d "
            "completion_tokens=%d queue_ms=%.1f ttft_ms=%s total_ms=%.1f",
            self.request_id,
            connection.id,
            connection.tenant,
            connection.session.session_id,
            connection.model.name,
            outcome,
            self.prompt_tokens,
            self.completion_tokens,
            timing.queue_ms,
            "-" if timing.ttft_ms is None else f"{timing.ttft_ms:.1f}",
            timing.total_ms,
        )
        if connection.config.log_prompts and self.parts:
            logger.debug("request %s completion=%r", self.request_id, "".join(self.parts))
