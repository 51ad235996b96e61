"""What one benchmark request measured, and the summary of many.

Definitions follow vLLM's benchmark, so that figures compare with published ones:

- TTFT: from just before the request is sent (before the connection is opened, when the
  request opens one) to the arrival of the first token;
- ITL: the gaps between consecutive chunks (frames or SSE events) that carry tokens;
- TPOT: ``(E2EL - TTFT) / (tokens - 1)`` per request;
- E2EL: from before the request is sent to the end of its reply.

Every chunk's arrival time and token count is kept, so the arrival time of every token is known
and merging tokens into fewer frames cannot hide a delay.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(slots=True)
class Sample:
    """One request. Times are seconds on the run's clock (0 = the start of the run)."""

    index: int
    user: int
    warmup: bool
    sent: float = 0.0
    first_token: float | None = None
    end: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    # What a Seedance server reports in ``done.timing`` (from the moment it read the frame).
    server_ttft_ms: float | None = None
    server_queue_ms: float | None = None
    chunk_at: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    def add_chunk(self, at: float, tokens: int) -> None:
        if self.first_token is None:
            self.first_token = at
        self.chunk_at.append(at)
        self.chunk_tokens.append(tokens)
        self.tokens += tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def tpot(self) -> float | None:
        if self.end is None or self.first_token is None or self.tokens < 2:
            return None
        return (self.end - self.first_token) / (self.tokens - 1)

    def itls(self) -> list[float]:
        at = self.chunk_at
        return [at[i] - at[i - 1] for i in range(1, len(at))]

    def token_arrivals(self) -> list[float]:
        """The arrival time of every token, in order (the tokens of a chunk share its time)."""
        times: list[float] = []
        for at, n in zip(self.chunk_at, self.chunk_tokens, strict=True):
            times.extend([at] * n)
        return times

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "user": self.user,
            "warmup": self.warmup,
            "sent": round(self.sent, 6),
            "ttft_ms": _ms_or_none(self.ttft),
            "e2el_ms": _ms_or_none(self.e2el),
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "chunks": len(self.chunk_at),
            "server_ttft_ms": self.server_ttft_ms,
            "server_queue_ms": self.server_queue_ms,
            # Arrival of each token, ms after the request was sent.
            "token_ms": [round((t - self.sent) * 1000.0, 3) for t in self.token_arrivals()],
        }


@dataclass(slots=True, frozen=True)
class Distribution:
    """Mean, percentiles and max of a set of durations, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan)
        ordered = sorted(values)
        p50, p90, p99 = (percentile(ordered, p) * 1000.0 for p in PERCENTILES)
        return cls(
            len(ordered),
            sum(ordered) / len(ordered) * 1000.0,
            p50,
            p90,
            p99,
            ordered[-1] * 1000.0,
        )

    def to_json(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {"count": self.count}
        for name in ("mean", "p50", "p90", "p99", "max"):
            value = getattr(self, name)
            out[f"{name}_ms"] = None if math.isnan(value) else round(value, 3)
        return out


def percentile(ordered: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of sorted values, interpolated linearly (numpy's default)."""
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True, frozen=True)
class Summary:
    requests: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    delivered_tokens_per_s: float
    chunks: int
    first_chunk_alone: int  # completed requests whose first frame carried exactly one token
    #: Completed requests by how their reply ended (``stop``, ``length``, ``tool_calls``...).
    finish_reasons: dict[str, int]
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2el: Distribution

    @property
    def tokens_per_chunk(self) -> float:
        return self.output_tokens / self.chunks if self.chunks else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "duration_s": round(self.duration_s, 4),
            "requests_per_s": round(self.requests_per_s, 2),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "delivered_tokens_per_s": round(self.delivered_tokens_per_s, 1),
            "chunks": self.chunks,
            "first_chunk_alone": self.first_chunk_alone,
            "finish_reasons": self.finish_reasons,
            "ttft": self.ttft.to_json(),
            "itl": self.itl.to_json(),
            "tpot": self.tpot.to_json(),
            "e2el": self.e2el.to_json(),
        }


def summarize(samples: Iterable[Sample]) -> Summary:
    """Figures over the measured (not warm-up) requests."""
    measured = [s for s in samples if not s.warmup]
    done = [s for s in measured if s.ok]
    errors = Counter(s.error or "incomplete" for s in measured if not s.ok)
    if measured:
        begin = min(s.sent for s in measured)
        finish = max((s.end for s in done if s.end is not None), default=begin)
        duration = max(finish - begin, 1e-9)
    else:
        duration = 0.0
    tokens = sum(s.tokens for s in done)
    # Every token received, finished request or not, over the time from the first request
    # sent to the last token received: what the server delivered.
    arrivals = [s.chunk_at[-1] for s in measured if s.chunk_at]
    span = max(arrivals) - min(s.sent for s in measured) if arrivals else 0.0
    delivered = sum(s.tokens for s in measured) / span if span > 0 else 0.0
    itls: list[float] = []
    for s in done:
        itls.extend(s.itls())
    return Summary(
        requests=len(measured),
        completed=len(done),
        errors=dict(errors),
        duration_s=duration,
        requests_per_s=len(done) / duration if duration else 0.0,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration if duration else 0.0,
        delivered_tokens_per_s=delivered,
        chunks=sum(len(s.chunk_at) for s in done),
        first_chunk_alone=sum(1 for s in done if s.chunk_tokens and s.chunk_tokens[0] == 1),
        finish_reasons=dict(Counter(s.finish_reason or "none" for s in done)),
        ttft=Distribution.of_seconds([t for s in done if (t := s.ttft) is not None]),
        itl=Distribution.of_seconds(itls),
        tpot=Distribution.of_seconds([t for s in done if (t := s.tpot) is not None]),
        e2el=Distribution.of_seconds([t for s in done if (t := s.e2el) is not None]),
    )


def _ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
