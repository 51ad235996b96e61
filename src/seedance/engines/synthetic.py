"""The synthetic engine: deterministic text at a chosen pace, for tests and benchmarks.

The reply is a pure function of the conversation and the seed: the same request gives the same
text, token for token. Exactly ``max_tokens`` tokens are produced unless a stop string matches
(or the context window fills). ``ttft_ms`` delays the first token; ``tokens_per_s`` paces the
rest (0 = as fast as the event loop allows). With ``echo`` the reply is the last message's text,
token by token, and ends (``stop``) after it: what a test needs to put chosen text, hostile HTML
say, in a model's reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from seedance.config import Option, boolean, non_negative
from seedance.engines.base import Engine, GenerationRequest, ModelInfo, TokenDelta
from seedance.engines.registry import EngineSpec
from seedance.engines.stops import StopMatcher

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
        self.stats = SyntheticStats()

    @property
    def info(self) -> ModelInfo:
        return self._info

    def count_tokens(self, text: str) -> int:
        return len(_TOKEN_RE.findall(text))

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
            start = loop.time() + self.ttft_s
            words = _echo(request) if self.echo else _sentence(rng)
            for _ in range(request.continuation_tokens):  # the same reply, from where it was
                next(words, None)
            reason = "length"
            for i in range(limit):
                due = start + i * self.interval_s
                delay = due - loop.time()
                # Always yield to the loop: an unpaced stream must not starve the others.
                await asyncio.sleep(delay if delay > 0 else 0)
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
)


def create_engine(config: ServerConfig, options: SyntheticOptions) -> SyntheticEngine:
    return SyntheticEngine(
        name=config.model or "synthetic",
        ttft_ms=options.ttft_ms,
        tokens_per_s=options.tokens_per_s,
        echo=options.echo,
    )


ENGINE = EngineSpec(
    create_engine,
    SyntheticOptions,
    OPTIONS,
    "Deterministic text at a set rate, no model: for tests and load measurements.",
)
