"""What every in-process, continuously batched engine shares: the decode thread's frame.

An engine that runs a model in this process (``llamacpp``, ``transformers``) has one thread
that owns the model and runs decode steps; requests join and leave between steps. This module
holds the parts that do not depend on the model:

- :class:`BatchJob`, a request inside the thread: its sink, how many tokens it may sample, the
  text assembly (incremental UTF-8, stop strings, tokens held back), and the grammar of a
  reply bound to a schema (:mod:`~seedance.engines.grammar`);
- :class:`DecodeLoop`, the thread itself: submit and cancel from the event loop, the wait for
  work, the step's events handed to the event loop in one ``call_soon_threadsafe``, failure of
  one request or of the whole loop;
- :func:`run_job`, the engine's side: submit a job and relay its events as
  :class:`~seedance.engines.base.TokenDelta`, cancelling the job when the consumer goes away.

A subclass implements :meth:`DecodeLoop._admit` (place waiting jobs) and
:meth:`DecodeLoop._step` (one batched forward pass; for the jobs bound to a schema,
:meth:`DecodeLoop._masks` applied to their logits and :meth:`DecodeLoop._fits` for the token
sampled; then :meth:`DecodeLoop._take` for each sampled token), and may extend
:meth:`DecodeLoop._release`.
"""

from __future__ import annotations

import abc
import asyncio
import codecs
import contextlib
import logging
import secrets
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt

from seedance.engines.base import (
    EngineHealth,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenDelta,
)
from seedance.engines.grammar import Grammars, Masks, check_schema
from seedance.engines.prompts import PromptedEngine, Prompts
from seedance.engines.stops import StopMatcher
from seedance.eventloop import LightQueue
from seedance.protocol.errors import EngineError
from seedance.protocol.messages import FinishReason, RequestId, TokenLogprob
from seedance.protocol.schemas import OutputSchema

logger = logging.getLogger(__name__)

#: The longest a thread keeps the GIL while another waits (Python's default: 5 ms).
GIL_SWITCH_INTERVAL_S = 0.0005

#: What a job receives, in order: ``(text, tokens, finish_reason, error, logprobs, ids)``.
Event = tuple[
    str, int, FinishReason | None, str | None, list[TokenLogprob] | None, list[int] | None
]
#: Called on the event loop with every event of one decode step.
Deliver = Callable[[list[tuple[Any, Event]]], None]


def deliver_events(batch: list[tuple[Any, Event]]) -> None:
    """On the event loop: one decode step's events into their requests' queues."""
    for events, event in batch:
        events.put_nowait(event)


@dataclass(slots=True)
class SchedulerStats:
    """Counters of a decode loop (read by tests and reports)."""

    requests_started: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0  # prompt tokens of all requests
    prompt_tokens_prefilled: int = 0  # of those, computed (the rest came from cached cells)
    prompt_tokens_reused: int = 0
    tokens_generated: int = 0
    states_saved: int = 0
    states_restored: int = 0
    states_shared: int = 0  # another sequence's cells copied for a prompt that begins the same
    steps: int = 0
    running: int = 0
    waiting: int = 0


class BatchJob:
    """One request inside a decode thread: limits and text assembly."""

    __slots__ = (
        "cancelled",
        "done",
        "generated",
        "grammar",
        "held",
        "ids",
        "limit",
        "logprobs",
        "matcher",
        "prompt",
        "sink",
        "top",
        "utf8",
    )

    def __init__(self, prompt: list[int], params: SamplingParams, limit: int, sink: Any) -> None:
        self.prompt = prompt
        self.limit = limit  # most tokens to sample
        self.sink = sink  # the consumer's handle, passed back with each event
        self.matcher = StopMatcher(params.stop)
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.generated = 0  # tokens sampled
        self.held = 0  # sampled tokens whose text is not out yet (partial UTF-8)
        self.cancelled = False
        self.done = False
        #: The reply's schema, compiled (None: free text); it picks the tokens allowed next.
        self.grammar: llguidance.LLMatcher | None = None
        #: Alternatives per token's log probability (None: the request asked for none), and
        #: the entries of the tokens sampled but not yet emitted.
        self.top = params.logprobs
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        #: The ids of the tokens sampled but not yet emitted (None: the request asked for none).
        self.ids: list[int] | None = [] if params.token_ids else None

    def close(self) -> None:
        """Free what the job holds outside Python (a native sampler, say)."""


class DecodeLoop(abc.ABC):
    """Runs the decode thread; :meth:`submit` and :meth:`cancel` are thread-safe."""

    thread_name = "decode"
    # The step hands the previous step's text to the event loop itself, just before its forward
    # pass releases the GIL (see _flush): the loop then handles it while the pass runs,
    # instead of holding the GIL while the next batch is built.
    flushes_in_step = False

    def __init__(self) -> None:
        self.stats = SchedulerStats()
        self.failure: str | None = None  # set when the decode loop died
        # The batch of the step under way, set by _step before its forward pass: sequences
        # decoding one token, sequences prefilling, tokens in all (for crash reports).
        self.batch_shape: tuple[int, int, int] = (0, 0, 0)
        self._cond = threading.Condition()
        self._incoming: list[BatchJob] = []
        self._cancelled: list[BatchJob] = []
        self._waiting: list[BatchJob] = []
        self._active: list[BatchJob] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None
        self._outbox: list[tuple[Any, Event]] = []
        self._mask_rows = Masks()

    # -- the event loop's side -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Deliver = deliver_events) -> None:
        self._loop, self._deliver = loop, deliver
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (blocks until the current step ends)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def thread_label(self) -> str:
        """The decode thread as crash reports name it (faulthandler prints its ident)."""
        thread = self._thread
        ident = thread.ident if thread is not None else None
        return f"{self.thread_name} (Thread 0x{ident or 0:016x} in a fatal error's stacks)"

    def describe(self) -> str:
        """What the thread is doing, for a crash report (read from any thread)."""
        decoding, prefilling, tokens = self.batch_shape
        stats = self.stats
        return (
            f"step {stats.steps + 1}: a batch of {tokens} token(s), {decoding} sequence(s) "
            f"decoding and {prefilling} prefilling; {stats.waiting} request(s) waiting, "
            f"{stats.requests_started} started since start"
        )

    def abort(self, reason: str, grace_s: float = 1.0) -> None:
        """The process is about to die (a native abort, from any thread): fail every request,
        report unhealthy, and give the event loop up to ``grace_s`` to tell the clients."""
        self._die(reason)
        loop = self._loop
        if loop is None or grace_s <= 0:
            return
        told = threading.Event()
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(told.set)  # after the failure events, in order
            told.wait(grace_s)
            time.sleep(min(grace_s, 0.5))  # their tasks write the clients' error frames

    def submit(self, job: BatchJob) -> None:
        with self._cond:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self._incoming.append(job)
            self._cond.notify()

    def cancel(self, job: BatchJob) -> None:
        with self._cond:
            job.cancelled = True
            self._cancelled.append(job)
            self._cond.notify()

    # -- the decode thread -----------------------------------------------------------------

    @abc.abstractmethod
    def _admit(self) -> None:
        """Move jobs from ``_waiting`` to ``_active`` while there is room (with nothing
        active, at least one: the thread waits for nothing else while a job waits)."""

    @abc.abstractmethod
    def _step(self) -> None:
        """One forward pass over the active jobs; :meth:`_accept` each sampled token."""

    def _release(self, job: BatchJob) -> None:
        """``job`` left the batch (finished, failed or cancelled): free what it held."""
        job.close()

    def _shutdown(self) -> None:  # noqa: B027 - an optional hook
        """The thread ends: free what the loop holds."""

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    # Jobs left waiting count: when the last running ones end in one step,
                    # the next round admits them (the workers that share an engine process
                    # may submit more jobs than it has rows).
                    while not (
                        self._incoming
                        or self._cancelled
                        or self._active
                        or self._waiting
                        or self._stopping
                    ):
                        self._cond.wait()
                    if self._stopping:
                        break
                    incoming, self._incoming = self._incoming, []
                    cancelled, self._cancelled = self._cancelled, []
                for job in cancelled:
                    self._cancel(job)
                self._waiting.extend(j for j in incoming if not j.cancelled)
                self._admit()
                if self._active:
                    self._step()
                if not (self._active and self.flushes_in_step):
                    self._flush()
        except BaseException as exc:  # the loop is gone: fail everything, report unhealthy
            logger.exception("the %s loop failed", self.thread_name)
            self._die(f"the decode loop failed: {exc!r}")
        finally:
            for job in [*self._active, *self._waiting]:
                job.close()
            self._shutdown()

    def _die(self, reason: str) -> None:
        with self._cond:
            self.failure = reason
            jobs = [*self._active, *self._waiting, *self._incoming]
            self._active, self._waiting, self._incoming = [], [], []
        for job in jobs:
            job.close()
            if not job.done:
                job.done = True
                self._outbox.append((job.sink, ("", 0, None, reason, None, None)))
        self._flush()

    def _flush(self) -> None:
        stats = self.stats
        stats.running, stats.waiting = len(self._active), len(self._waiting)
        if self._outbox and self._loop is not None and self._deliver is not None:
            outbox, self._outbox = self._outbox, []
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                self._loop.call_soon_threadsafe(self._deliver, outbox)

    def _cancel(self, job: BatchJob) -> None:
        if job.done:
            return
        job.done = True
        self.stats.requests_cancelled += 1
        if job in self._waiting:
            self._waiting.remove(job)
        if job in self._active:
            self._active.remove(job)
        self._release(job)

    # -- schemas -----------------------------------------------------------------------------

    def _masks(self, jobs: list[BatchJob], vocab_size: int) -> npt.NDArray[np.int32]:
        """The next-token masks of ``jobs`` (each bound to a schema), a row each, in order."""
        return self._mask_rows.fill([job.grammar for job in jobs if job.grammar], vocab_size)

    @staticmethod
    def _fits(job: BatchJob, token: int) -> bool:
        """Whether ``token`` may come next in ``job``'s reply; if so, its grammar (if any)
        moves past it. A token its schema forbids changes nothing (about 16 us to tell)."""
        grammar = job.grammar
        return grammar is None or grammar.try_consume_tokens([token]) == 1

    def _take(self, job: BatchJob, token: int, piece: bytes | None) -> bool:
        """A sampled token (its bytes; None: the end of generation), which :meth:`_fits`,
        joins the reply; true while ``job`` goes on. A reply bound to a schema ends when its
        document is whole."""
        if not self._accept(job, token, piece):
            return False
        grammar = job.grammar
        if grammar is not None and grammar.is_stopped():
            self._finish(job, "stop")
            return False
        return True

    # -- text out ----------------------------------------------------------------------------

    def _accept(self, job: BatchJob, token: int, piece: bytes | None) -> bool:
        """A sampled token and its bytes (``None``: end of generation); true while ``job``
        goes on."""
        if piece is None:
            self._finish(job, "stop")
            return False
        if job.ids is not None:
            job.ids.append(token)
        job.generated += 1
        self.stats.tokens_generated += 1
        job.held += 1
        text = job.utf8.decode(piece)
        if text:
            text, count = job.matcher.push(text, job.held)
            job.held = 0
            if job.matcher.stopped:
                self._emit(job, text, count, "stop")
                return False
            if count:
                self._emit(job, text, count, None)
        if job.generated >= job.limit:
            self._finish(job, "length")
            return False
        return True

    def _finish(self, job: BatchJob, reason: FinishReason) -> None:
        """End ``job``: release held text. A character the reply was cut inside (by
        ``max_tokens``) is left out: its tokens count, its bytes never reach the client (not
        even as U+FFFD)."""
        text, count = "", 0
        if job.held:  # the bytes of a cut character wait in job.utf8 and stay there
            text, count = job.matcher.push("", job.held)
            job.held = 0
        if job.matcher.stopped:
            reason = "stop"
        else:
            more, extra = job.matcher.flush()
            text, count = text + more, count + extra
        self._emit(job, text, count, reason)

    def _emit(self, job: BatchJob, text: str, tokens: int, finish: FinishReason | None) -> None:
        entries, ids = job.logprobs, job.ids
        if entries is not None:  # those of the tokens emitted (held ones stay)
            entries, job.logprobs = entries[:tokens], entries[tokens:]
        if ids is not None:
            ids, job.ids = ids[:tokens], ids[tokens:]
        self._outbox.append((job.sink, (text, tokens, finish, None, entries, ids)))
        if finish is not None:
            self._end(job)
            self.stats.requests_finished += 1

    def _fail(self, job: BatchJob, reason: str) -> None:
        self._outbox.append((job.sink, ("", 0, None, reason, None, None)))
        self._end(job)
        self.stats.requests_failed += 1

    def _end(self, job: BatchJob) -> None:
        job.done = True
        if job in self._active:
            self._active.remove(job)
        self._release(job)


async def run_job(
    loop: DecodeLoop, job: BatchJob, events: LightQueue, request_id: RequestId
) -> AsyncGenerator[TokenDelta, None]:
    """Submit ``job`` (whose sink is ``events``) and stream its reply; closing the generator
    before the end cancels the job."""
    try:
        loop.submit(job)
    except RuntimeError as exc:
        job.close()
        raise EngineError(f"the model is not running ({exc}); retry later") from None
    finished = False
    try:
        while True:
            text, tokens, finish, error, logprobs, ids = await events.get()
            if error is not None:
                finished = True
                raise EngineError(f"request {request_id} failed: {error}; retry")
            if finish is not None:
                finished = True
                yield TokenDelta(text, tokens, finish, logprobs, ids)
                return
            yield TokenDelta(text, tokens, logprobs=logprobs, ids=ids)
    finally:
        if not finished:
            loop.cancel(job)


class BatchedEngine(PromptedEngine):
    """An engine whose requests run as jobs of a :class:`DecodeLoop` in this process."""

    loop: DecodeLoop
    #: Binds replies to schemas, where the engine set it up (:meth:`_use_grammars`).
    grammars: Grammars | None = None
    logprobs = True  # from the logits of the engine's own forward pass
    token_ids = True  # the ids it samples

    @abc.abstractmethod
    def _job(
        self, prompt: list[int], params: SamplingParams, limit: int, seed: int, sink: Any
    ) -> BatchJob:
        """The loop's job for one request."""

    @property
    def stats(self) -> SchedulerStats:
        return self.loop.stats

    async def start(self) -> None:
        # After each forward pass the decode thread needs the GIL back; a busy event loop
        # keeps it for up to the switch interval (5 ms by default, a fifth of a SmolLM2 step
        # at 8 streams). Measured: 4 streams went from 0.92x to 0.99x llama-server's tokens/s.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self.loop.start(asyncio.get_running_loop())

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)

    def health(self) -> EngineHealth:
        failure = self.loop.failure
        return EngineHealth(ok=failure is None, detail=failure or "")

    def unfinished_requests(self) -> int:
        stats = self.loop.stats  # as of the decode thread's last step
        return stats.running + stats.waiting

    def prompt_cache(self) -> tuple[int, int]:
        stats = self.loop.stats
        return stats.prompt_tokens, stats.prompt_tokens - stats.prompt_tokens_prefilled

    def _use_grammars(self, build: Callable[[], llguidance.LLTokenizer]) -> None:
        """Replies may be bound to schemas; ``build`` reads the vocabulary for llguidance."""
        self.grammars = Grammars(build)

    def check_schema(self, schema: OutputSchema, field: str) -> None:
        if self.grammars is None:
            super().check_schema(schema, field)
        check_schema(schema, field)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids)
            if request.continuation:
                prompt += self.prompts.encode(request.continuation, False)
        else:
            prompt = self.prompts.tokens(
                request.messages, request.raw, request.continuation, request.params.tools
            )
        params = request.params
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        events = LightQueue()  # filled a decode step at a time
        job = self._job(prompt, params, self.reply_limit(prompt, params), seed, events)
        if params.schema is not None:
            job.grammar = await self._grammar(params.schema, request.continuation)
        async for delta in run_job(self.loop, job, events, request.request_id):
            yield delta

    async def _grammar(self, schema: OutputSchema, continuation: str) -> llguidance.LLMatcher:
        """A matcher for one reply (``continuation``: the reply so far, which it has read)."""
        grammars = self.grammars
        if grammars is None:
            raise EngineError(f"the {self._info.engine} engine cannot bind replies to a schema")
        if not grammars.ready:  # the first schema: read the vocabulary off the event loop
            await asyncio.to_thread(grammars.tokenizer)
        matcher = grammars.matcher(schema)
        if continuation and not matcher.consume_tokens(self.prompts.encode(continuation, False)):
            raise EngineError(f"the reply so far does not fit its schema: {matcher.get_error()}")
        return matcher


class BatchedFront(PromptedEngine):
    """A :class:`BatchedEngine` as a server's process needs it when the model runs in the
    engine process (``EngineSpec.front``): its prompts and tokenizer alone. It generates
    nothing; the engine process binds replies to schemas, so it takes every valid one."""

    logprobs = BatchedEngine.logprobs
    token_ids = BatchedEngine.token_ids

    def __init__(self, info: ModelInfo, prompts: Prompts) -> None:
        self._info = info
        self._use_prompts(prompts)

    def check_schema(self, schema: OutputSchema, field: str) -> None:
        check_schema(schema, field)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        raise EngineError(f"the {self.info.engine} front does not generate: its process does")
        yield  # type: ignore[unreachable]  # an async generator
