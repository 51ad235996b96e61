"""The synthetic engine: deterministic text at a chosen pace, for tests and benchmarks.

The reply is a pure function of the conversation and the seed: the same request gives the same
text, token for token. Exactly ``max_tokens`` tokens are produced unless a stop string matches
(or the context window fills). ``ttft_ms`` delays the first token; ``tokens_per_s`` paces the
rest (0 = as fast as the event loop allows). With ``echo`` the reply is the last message's text,
token by token, and ends (``stop``) after it: what a test needs to put chosen text, hostile HTML
say, in a model's reply.

With :class:`Faults` it is a faulty upstream, per request: a share of the requests fail with
``engine_error`` (before the first token, where it was due, or, for ``error_midstream`` of
them, after a random token of the reply), a share have their first token late by ``spike_ms``,
and incidents come and go: the first ``incident_s`` of every ``incident_every_s``, counted from
the Unix time ``incident_at`` (so that processes on one machine agree when they are), fail at
``incident_error_rate`` instead of ``error_rate``. Every request draws the same four numbers
from one generator seeded with ``seed``, whatever happens to it: the n-th request the engine
serves meets the same dice in every run, and only the incidents depend on the time.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from seedance.engines.base import Engine, GenerationRequest, ModelInfo, TokenDelta
from seedance.engines.registry import EngineSpec
from seedance.engines.stops import StopMatcher
from seedance.protocol.errors import EngineError
from seedance.protocol.messages import FinishReason
from seedance.settings import Option, boolean, non_negative

if TYPE_CHECKING:
    from seedance.config import ServerConfig

# Tokens are a word with its leading space, or one punctuation mark.
_TOKEN_RE: Final = re.compile(r"\s*[\w']+|\s*[^\w\s]|\s+")

_WORDS: Final = (
    *"""
    the of and to in is that for it as was with on be by this are from at or an have not they
    which one you were all we when there can been has more if will their so what about out up
    into them some could time only new its these two may first then do any like my now over
    such our man me even most made after also did many before must through back years where
    much your way well down should because each just those people how too little state good
    very make world still own see men work long get here between both life being under never
    day same another know while last might us great old year off come since against go came
    right used take three token stream session model latency socket frame signal river light
    garden quantum market engine
    """.split(),
    # Multi-byte words, so that clients see UTF-8 beyond ASCII.
    "café",
    "naïve",
    "über",
    "日本",
    "数据",
    "🙂",
    "façade",
    "crème",
)


@dataclass(slots=True)
class SyntheticStats:
    """Counters the tests read to see what the engine really did."""

    tokens_generated: int = 0
    requests_started: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    active: int = 0
    faults_injected: int = 0  # requests failed on purpose (before or after the first token)
    spikes_injected: int = 0  # requests whose first token was made late on purpose


@dataclass(frozen=True, slots=True)
class Faults:
    """What goes wrong, per request (see the module): rates are shares of the requests."""

    error_rate: float = 0.0
    error_midstream: float = 0.0  # share of the failures that come after the first token
    spike_rate: float = 0.0
    spike_ms: float = 0.0
    incident_every_s: float = 0.0  # 0: no incidents
    incident_s: float = 0.0
    incident_error_rate: float = 0.0
    incident_at: float = 0.0  # Unix time an incident starts (the others: every incident_every_s)
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.error_rate or self.spike_rate or self.incident_error_rate)

    def error_rate_at(self, now: float) -> float:
        """The chance that a request started at ``now`` (Unix time) fails."""
        every = self.incident_every_s
        if every > 0 and (now - self.incident_at) % every < self.incident_s:
            return self.incident_error_rate
        return self.error_rate


class SyntheticEngine(Engine):
    message_overhead_tokens = 4
    reply_overhead_tokens = 3

    def __init__(
        self,
        *,
        name: str = "synthetic",
        ttft_ms: float = 0.0,
        tokens_per_s: float = 0.0,
        context_length: int = 32768,
        max_output_tokens: int = 16384,
        max_concurrency: int = 1024,
        echo: bool = False,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._info = ModelInfo(
            name=name,
            engine="synthetic",
            context_length=context_length,
            max_output_tokens=max_output_tokens,
        )
        self.ttft_s = max(0.0, ttft_ms) / 1000.0
        self.interval_s = 1.0 / tokens_per_s if tokens_per_s > 0 else 0.0
        self.max_concurrency = max_concurrency
        self.echo = echo
        self.faults = faults if faults is not None and faults.active else None
        self._clock = clock
        self._dice = random.Random(faults.seed if faults is not None else 0)
        self.stats = SyntheticStats()

    @property
    def info(self) -> ModelInfo:
        return self._info

    def count_tokens(self, text: str) -> int:
        return len(_TOKEN_RE.findall(text))

    def unfinished_requests(self) -> int:
        return self.stats.active

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        stats = self.stats
        stats.requests_started += 1
        stats.active += 1
        finished = False
        try:
            params = request.params
            rng = random.Random(_seed_of(request))
            room = self._info.context_length - request.prompt_tokens
            limit = max(0, min(params.max_tokens, room))
            matcher = StopMatcher(params.stop)
            loop = asyncio.get_running_loop()
            late, fail_at = self._roll(limit) if self.faults is not None else (0.0, -1)
            start = loop.time() + self.ttft_s + late
            words = _echo(request) if self.echo else _sentence(rng)
            for _ in range(request.continuation_tokens):  # the same reply, from where it was
                next(words, None)
            reason: FinishReason = "length"
            for i in range(limit):
                due = start + i * self.interval_s
                delay = due - loop.time()
                # Always yield to the loop: an unpaced stream must not starve the others.
                await asyncio.sleep(delay if delay > 0 else 0)
                if i == fail_at:
                    stats.faults_injected += 1
                    raise EngineError("the model failed (a fault injected on purpose); retry")
                piece = next(words, None)
                if piece is None:  # an echo ends with its text
                    reason = "stop"
                    break
                stats.tokens_generated += 1
                text, n = matcher.push(piece)
                if matcher.stopped:
                    finished = True
                    yield TokenDelta(text, n, "stop")
                    return
                if n:
                    yield TokenDelta(text, n)
            text, n = matcher.flush()
            finished = True
            yield TokenDelta(text, n, reason)
        finally:
            stats.active -= 1
            if finished:
                stats.requests_finished += 1
            else:
                stats.requests_aborted += 1

    def _roll(self, limit: int) -> tuple[float, int]:
        """This request's faults: extra seconds before its first token, and the index of the
        token it fails at instead of sending (-1: it does not fail)."""
        faults = self.faults
        assert faults is not None
        dice = self._dice
        fails, midstream, spike, where = (dice.random() for _ in range(4))
        late = 0.0
        if spike < faults.spike_rate:
            late = faults.spike_ms / 1000.0
            self.stats.spikes_injected += 1
        if fails >= faults.error_rate_at(self._clock()):
            return late, -1
        if midstream < faults.error_midstream and limit > 1:
            return late, 1 + int(where * (limit - 1))  # after token 1 .. limit - 1
        return late, 0


def _seed_of(request: GenerationRequest) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for message in request.messages:
        digest.update(message.role.encode())
        digest.update(b"\x00")
        digest.update(message.content.encode("utf-8", "surrogatepass"))
        digest.update(b"\x01")
    digest.update(str(request.params.seed or 0).encode())
    return int.from_bytes(digest.digest(), "big")


def _echo(request: GenerationRequest) -> Iterator[str]:
    """The last message's text, cut into tokens (whitespace included: the echo is exact)."""
    last = request.messages[-1].content if request.messages else ""
    yield from _TOKEN_RE.findall(last)


def _sentence(rng: random.Random) -> Iterator[str]:
    """Endless sentence-like token texts: ``Word word word.`` with leading spaces."""
    first = True
    while True:
        length = rng.randint(6, 14)
        for j in range(length):
            word = rng.choice(_WORDS)
            if j == 0:
                word = word.capitalize()
            yield word if first else " " + word
            first = False
        yield "."


@dataclass(frozen=True)
class SyntheticOptions:
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    echo: bool = False
    error_rate: float = 0.0
    error_midstream: float = 0.0
    spike_rate: float = 0.0
    spike_ms: float = 0.0
    incident_every_s: float = 0.0
    incident_s: float = 0.0
    incident_error_rate: float = 0.0
    incident_at: float = 0.0
    fault_seed: int = 0


def _share(v: float) -> bool:
    return 0 <= v <= 1


OPTIONS = (
    Option(
        "ttft_ms",
        "--synthetic-ttft-ms",
        float,
        "delay before the first token, ms",
        non_negative,
        "0 or more",
    ),
    Option(
        "tokens_per_s",
        "--synthetic-tokens-per-s",
        float,
        "token rate (0: unlimited)",
        non_negative,
        "0 or more",
    ),
    Option("echo", "--synthetic-echo", boolean, "reply with the last message's text"),
    Option(
        "error_rate",
        "--synthetic-error-rate",
        float,
        "share of the requests that fail with engine_error",
        _share,
        "0 to 1",
    ),
    Option(
        "error_midstream",
        "--synthetic-error-midstream",
        float,
        "share of those failures that come after the first token",
        _share,
        "0 to 1",
    ),
    Option(
        "spike_rate",
        "--synthetic-spike-rate",
        float,
        "share of the requests whose first token is late",
        _share,
        "0 to 1",
    ),
    Option(
        "spike_ms",
        "--synthetic-spike-ms",
        float,
        "how late, ms",
        non_negative,
        "0 or more",
    ),
    Option(
        "incident_every_s",
        "--synthetic-incident-every-s",
        float,
        "an incident starts every so many seconds (0: none)",
        non_negative,
        "0 or more",
    ),
    Option(
        "incident_s",
        "--synthetic-incident-s",
        float,
        "how long each incident lasts, s",
        non_negative,
        "0 or more",
    ),
    Option(
        "incident_error_rate",
        "--synthetic-incident-error-rate",
        float,
        "share of the requests that fail during an incident",
        _share,
        "0 to 1",
    ),
    Option(
        "incident_at",
        "--synthetic-incident-at",
        float,
        "Unix time at which an incident starts (the others: before and after it, in step)",
    ),
    Option("fault_seed", "--synthetic-fault-seed", int, "seed of the fault draws"),
)


def create_engine(config: ServerConfig, options: SyntheticOptions) -> SyntheticEngine:
    return SyntheticEngine(
        name=config.model or "synthetic",
        ttft_ms=options.ttft_ms,
        tokens_per_s=options.tokens_per_s,
        echo=options.echo,
        faults=Faults(
            error_rate=options.error_rate,
            error_midstream=options.error_midstream,
            spike_rate=options.spike_rate,
            spike_ms=options.spike_ms,
            incident_every_s=options.incident_every_s,
            incident_s=options.incident_s,
            incident_error_rate=options.incident_error_rate,
            incident_at=options.incident_at,
            seed=options.fault_seed,
        ),
    )


ENGINE = EngineSpec(
    create_engine,
    SyntheticOptions,
    OPTIONS,
    "Deterministic text at a set rate, no model: for tests and load measurements.",
    # Its counts need no model: the engine itself is its front.
    front=lambda config, options, info: create_engine(config, options),
)
