"""Quality of service in the Python SDK: a health score, a circuit breaker per endpoint, a retry
budget, and a chain of fallbacks tried only before a reply's first token.

::

    client = ResilientClient(
        ["ws://primary:8000", "ws://secondary:8000"],
        qos=QoS("high", slatag="api_payment_v2"),
        sla_ttft_s=0.8,
        cache=ResponseCache(),
        degraded_reply="The assistant is busy; please try again in a minute.",
        degrade=Degrade(max_tokens=64),
    )
    reply = client.generate("hello", max_tokens=128)
    async for chunk in reply:
        print(chunk.text, end="")
    print(reply.source, reply.reason)   # "endpoint", None / "cache", "ws://primary...: ..."

**Calls** are independent (each resets its session's context unless ``reset=False``; send a
conversation as ``messages``) and may run at once: a session runs one reply at a time, so each
call in flight takes an idle session of its endpoint or opens one.

**Health score** (:class:`HealthScore`): each of the last 10 calls scores 1 when its first
token came within the SLA (``sla_ttft_s``), ``sla / ttft`` when later, 0 when it failed; the
health is their mean weighted by recency (the newest call weighs 10, the oldest 1), 1.0 before
any call. It goes to the server with every request (``health_score`` of ``X-QoS-Priority``);
below 0.7 the client degrades as configured (:class:`Degrade`: fewer tokens, a smaller model, or
straight to the fallbacks).

**Circuit breaker** (:class:`CircuitBreaker`, one per endpoint): closed, it counts the outcomes
of the last 5 s (a call succeeds with its first token, fails with an error or no first token
within ``first_token_timeout_s``, or with an error later); once it holds at least 20 and half or
more failed, it opens: calls skip the endpoint without touching it. After
a cool-down (5 s) it is half-open: up to 3 probes go through; as many successes close it, one
failure opens it again. Every change is logged and passed to ``on_breaker``.

**Fallbacks**, in order, and only while no token of the reply has arrived (a reply is never
replayed as a new one): the next endpoint (spending the retry budget when the previous one was
tried: retries add at most 10% to the calls, saved up to a burst of 10), a reply from the
local cache of earlier replies to the same request, then the declared degraded reply. The
reply says which (``source``) and why (``reason``). An error after the first token is raised as
it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from seedance.client.session import ClientSession, Stream, TokenChunk, connect
from seedance.eventloop import timeout
from seedance.protocol.codec import DEFAULT_MAX_TOKENS
from seedance.protocol.errors import SeedanceError
from seedance.protocol.messages import DoneFrame
from seedance.protocol.qos import QoS

logger = logging.getLogger(__name__)

BreakerState = Literal["closed", "open", "half_open"]
Source = Literal["endpoint", "cache", "degraded"]


class HealthScore:
    """The client's view of the service from its last ``calls`` calls (see the module)."""

    def __init__(self, sla_ttft_s: float, calls: int = 10) -> None:
        self.sla_ttft_s = sla_ttft_s
        self._scores: deque[float] = deque(maxlen=calls)

    def record(self, ttft_s: float | None) -> None:
        """One call: the time to its first token, or None when it failed."""
        if ttft_s is None:
            score = 0.0
        elif ttft_s <= self.sla_ttft_s:
            score = 1.0
        else:
            score = self.sla_ttft_s / ttft_s
        self._scores.append(score)

    @property
    def value(self) -> float:
        if not self._scores:
            return 1.0
        weights = range(1, len(self._scores) + 1)  # oldest 1, newest len
        return sum(w * s for w, s in zip(weights, self._scores, strict=True)) / sum(weights)


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    window_s: float = 5.0
    min_samples: int = 20
    failure_rate: float = 0.5
    cooldown_s: float = 5.0
    probes: int = 3


class CircuitBreaker:
    """One endpoint's breaker (see the module). ``on_change(old, new, why)`` is told of every
    change of state."""

    def __init__(
        self,
        name: str,
        policy: BreakerPolicy = BreakerPolicy(),
        on_change: Callable[[str, BreakerState, BreakerState, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.policy = policy
        self.state: BreakerState = "closed"
        self._on_change = on_change
        self._clock = clock
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._opened_at = 0.0
        self._probes_out = 0
        self._probes_ok = 0

    def allow(self) -> bool:
        """May a call go to the endpoint now? (A half-open breaker counts it as a probe.)"""
        if self.state == "open":
            if self._clock() - self._opened_at < self.policy.cooldown_s:
                return False
            self._move("half_open", f"{self.policy.cooldown_s:g} s cool-down over")
        if self.state == "half_open":
            if self._probes_out >= self.policy.probes:
                return False
            self._probes_out += 1
        return True

    def record(self, ok: bool) -> None:
        now = self._clock()
        policy = self.policy
        if self.state == "half_open":
            if not ok:
                self._open(now, "a probe failed")
                return
            self._probes_ok += 1
            if self._probes_ok >= policy.probes:
                self._outcomes.clear()
                self._move("closed", f"{policy.probes} probes succeeded")
            return
        if self.state == "open":
            return  # a call that started before it opened
        outcomes = self._outcomes
        outcomes.append((now, ok))
        while outcomes and outcomes[0][0] < now - policy.window_s:
            outcomes.popleft()
        if len(outcomes) >= policy.min_samples:
            failed = sum(1 for _, good in outcomes if not good)
            if failed / len(outcomes) >= policy.failure_rate:
                why = f"{failed} of the last {len(outcomes)} calls in {policy.window_s:g} s failed"
                self._open(now, why)

    def _open(self, now: float, why: str) -> None:
        self._opened_at = now
        self._move("open", why)

    def _move(self, state: BreakerState, why: str) -> None:
        old, self.state = self.state, state
        self._probes_out = self._probes_ok = 0
        logger.warning("circuit breaker %s: %s -> %s (%s)", self.name, old, state, why)
        if self._on_change is not None:
            self._on_change(self.name, old, state, why)


class RetryBudget:
    """Retries allowed: ``ratio`` of the calls made (each call adds ``ratio``, a retry spends
    1), saved up to ``burst`` retries, so that a burst of failures after a calm spell can retry
    that many in a row. Over any run, retries <= ``ratio`` x calls."""

    def __init__(self, ratio: float = 0.1, burst: float = 10.0) -> None:
        self.ratio = ratio
        self.burst = burst
        self._balance = 0.0
        self.calls = 0
        self.retries = 0

    def called(self) -> None:
        self.calls += 1
        self._balance = min(self._balance + self.ratio, self.burst)

    @property
    def available(self) -> bool:
        return self._balance >= 1.0 - 1e-9  # ten calls of 0.1 add up to 0.999...

    def spend(self) -> None:
        self._balance -= 1.0
        self.retries += 1


class ResponseCache:
    """Replies to earlier requests, by the request (LRU, ``max_entries``)."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._replies: OrderedDict[str, str] = OrderedDict()

    @staticmethod
    def key(prompt: str, fields: dict[str, Any]) -> str:
        return json.dumps([prompt, fields], sort_keys=True, default=str)

    def get(self, key: str) -> str | None:
        text = self._replies.get(key)
        if text is not None:
            self._replies.move_to_end(key)
        return text

    def put(self, key: str, text: str) -> None:
        self._replies[key] = text
        self._replies.move_to_end(key)
        while len(self._replies) > self.max_entries:
            self._replies.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Degrade:
    """What the client does while its health is below ``below``: ask for at most
    ``max_tokens``, use ``model`` instead, and/or go straight to the fallbacks."""

    below: float = 0.7
    max_tokens: int | None = None
    model: str | None = None
    fallback: bool = False


class Reply:
    """One call's reply: an async iterator of :class:`TokenChunk`, from an endpoint or a
    fallback (``source``, and ``reason``: why not the first endpoint)."""

    def __init__(self, client: ResilientClient, prompt: str, fields: dict[str, Any]) -> None:
        self._client = client
        self._prompt = prompt
        self._fields = fields
        self.source: Source | None = None
        self.endpoint: str | None = None
        self.reason: str | None = None
        self.done: DoneFrame | None = None
        self._stream: Stream | None = None
        self._parts: list[str] = []
        self._breaker: CircuitBreaker | None = None
        self._started = False
        self._finished = False

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def __aiter__(self) -> Reply:
        return self

    async def __anext__(self) -> TokenChunk:
        if not self._started:
            self._started = True
            first = await self._client._start(self)
            self._parts.append(first.text)
            return first
        if self._finished or self._stream is None:
            raise StopAsyncIteration
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            self._finish(ok=True)
            raise
        except BaseException:
            self._finish(ok=False)  # after the first token: raised as it is, never replayed
            raise
        self._parts.append(chunk.text)
        return chunk

    def _finish(self, *, ok: bool) -> None:
        self._finished = True
        stream = self._stream
        if stream is not None:
            self.done = stream.done
        if self._breaker is not None and not ok:
            self._breaker.record(False)  # its first token counted as a success already
        if ok and stream is not None and stream.done is not None:
            cache = self._client.cache
            if cache is not None and stream.done.finish_reason in ("stop", "length"):
                cache.put(ResponseCache.key(self._prompt, self._fields), self.text)

    async def collect(self) -> str:
        async for _ in self:
            pass
        return self.text


class ResilientClient:
    """Calls to ``endpoints`` (tried in order) with a QoS, a breaker per endpoint, a retry
    budget and fallbacks (see the module). ``connect_options`` go to :func:`connect`."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        qos: QoS | None = None,
        sla_ttft_s: float = 1.0,
        first_token_timeout_s: float = 10.0,
        breaker: BreakerPolicy = BreakerPolicy(),
        retry_ratio: float = 0.1,
        cache: ResponseCache | None = None,
        degraded_reply: str | None = None,
        degrade: Degrade | None = None,
        on_breaker: Callable[[str, BreakerState, BreakerState, str], None] | None = None,
        **connect_options: Any,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint")
        self.endpoints = list(endpoints)
        self.qos = qos or QoS()
        self.first_token_timeout_s = first_token_timeout_s
        self.health = HealthScore(sla_ttft_s)
        self.breakers = {url: CircuitBreaker(url, breaker, on_breaker) for url in endpoints}
        self.budget = RetryBudget(retry_ratio)
        self.cache = cache
        self.degraded_reply = degraded_reply
        self.degrade = degrade
        self._options = {"reconnect": None, **connect_options}
        # Sessions by (endpoint, model): a session runs one reply at a time, so concurrent
        # calls take an idle one or open another.
        self._sessions: dict[tuple[str, str | None], list[ClientSession]] = {}

    def generate(self, prompt: str, **fields: Any) -> Reply:
        """Ask for a reply (``fields`` as :meth:`ClientSession.generate`; replies stream).
        Calls are independent: each resets its session's context (any endpoint may answer it;
        send a conversation as ``messages``), unless ``reset=False`` is given."""
        if not fields.get("stream", True):
            raise ValueError("a ResilientClient's replies stream (stream=False is not offered)")
        fields.setdefault("reset", True)
        return Reply(self, prompt, fields)

    async def complete(self, prompt: str, **fields: Any) -> Reply:
        reply = self.generate(prompt, **fields)
        await reply.collect()
        return reply

    async def close(self) -> None:
        sessions = [s for pool in self._sessions.values() for s in pool]
        self._sessions = {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    # ------------------------------------------------------------------ a call

    async def _start(self, reply: Reply) -> TokenChunk:
        """Find the reply's first token: an endpoint's, or a fallback's."""
        self.budget.called()
        health = self.health.value
        fields = dict(reply._fields)
        model: str | None = None
        endpoints = self.endpoints
        reasons: list[str] = []
        degrade = self.degrade
        if degrade is not None and health < degrade.below:
            if degrade.max_tokens is not None:
                asked = fields.get("max_tokens", DEFAULT_MAX_TOKENS)
                fields["max_tokens"] = min(asked, degrade.max_tokens)
            model = degrade.model
            if degrade.fallback:
                endpoints = []
                reasons.append(f"health {health:.2f} below {degrade.below:g}")
        qos = QoS(self.qos.service_class, self.qos.slatag, round(health, 2))
        tried = False
        for url in endpoints:
            breaker = self.breakers[url]
            if tried and not self.budget.available:
                reasons.append(f"{url}: not tried (retry budget spent)")
                continue
            if not breaker.allow():  # (an endpoint it skips costs no retry)
                reasons.append(f"{url}: circuit open")
                continue
            if tried:
                self.budget.spend()
            tried = True
            started = time.monotonic()
            stream: Stream | None = None
            try:
                async with timeout(self.first_token_timeout_s):  # connecting included
                    session = await self._session(url, model)
                    stream = session.generate(reply._prompt, qos=qos, **fields)
                    first = await stream.__anext__()
            except StopAsyncIteration:  # a reply without a token: done at once
                first = TokenChunk("", 0, 0)
            except (SeedanceError, OSError, asyncio.TimeoutError) as exc:
                breaker.record(False)
                self.health.record(None)
                reasons.append(f"{url}: {_describe(exc)}")
                if stream is not None and isinstance(exc, asyncio.TimeoutError):
                    with contextlib.suppress(SeedanceError, OSError):
                        await stream.cancel()  # the server would generate it for nobody
                continue
            self.health.record(time.monotonic() - started)
            breaker.record(True)
            reply.source, reply.endpoint, reply._stream, reply._breaker = (
                "endpoint",
                url,
                stream,
                breaker,
            )
            reply.reason = "; ".join(reasons) or None
            return first
        reply.reason = "; ".join(reasons) or "no endpoint"
        key = ResponseCache.key(reply._prompt, reply._fields)
        cached = None if self.cache is None else self.cache.get(key)
        if cached is not None:
            reply.source = "cache"
        elif self.degraded_reply is not None:
            reply.source, cached = "degraded", self.degraded_reply
        else:
            raise NoReply(reply.reason)
        reply._finished = True
        return TokenChunk(cached, 0, 1)

    async def _session(self, url: str, model: str | None) -> ClientSession:
        """An idle session to ``url``, opened when there is none. (The caller's generate then
        claims it before anything else runs: no await between the two.)"""
        pool = self._sessions.setdefault((url, model), [])
        pool[:] = [s for s in pool if not s.closed]
        for session in pool:
            if not session.busy:
                return session
        session = await connect(url, model=model, qos=self.qos, **self._options)
        pool.append(session)
        return session


class NoReply(SeedanceError):
    """No endpoint answered and no fallback was declared; the message says why, for each."""

    code = "no_reply"
    retryable = True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no first token in time"
    return f"{type(exc).__name__}: {exc}"
