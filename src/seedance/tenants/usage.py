"""Tenants' live usage, checked against their quotas.

Every count is kept on the event loop's thread and changed in the same step that checks it,
so the limits are exact under any concurrency: concurrent connections and generations, requests
and tokens (prompt + completion) in the last 60 seconds, ``max_tokens`` per request. A request
over a limit gets ``quota_exceeded`` (retryable) with the seconds until it would pass, where
that is known (rates); for concurrency limits, one second.

Tokens count when they are known: a request's prompt when it starts, its reply when it ends. A
tenant's running replies may therefore take it over ``tokens_per_minute`` for a moment; its
next request then waits until the window has room.

In cluster mode (``shared``) concurrent generations and the per-minute rates are checked in
Redis for the whole cluster (:mod:`seedance.cluster.claims`); what is counted here is then this
node's share, for its figures, and only the limits of one connection or request are checked.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from seedance.protocol.errors import QuotaExceeded
from seedance.tenants.config import Quotas

WINDOW_S: Final = 60.0
#: What a client is told to wait when a concurrency limit refused it.
CONCURRENCY_RETRY_S: Final = 1.0


class SlidingWindow:
    """Amounts recorded over the last ``window_s`` seconds."""

    __slots__ = ("_events", "total", "window_s")

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self.total = 0

    def used(self, now: float) -> int:
        events, horizon = self._events, now - self.window_s
        while events and events[0][0] <= horizon:
            self.total -= events.popleft()[1]
        return self.total

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self._events.append((now, amount))
            self.total += amount
        self.used(now)  # drop what left the window: the deque stays one window long

    def wait_for(self, now: float, need: int, limit: int) -> float:
        """Seconds until ``need`` more fits under ``limit`` (0 if it fits now)."""
        room = limit - self.used(now)
        if need <= room:
            return 0.0
        freed = 0
        for at, amount in self._events:
            freed += amount
            if need <= room + freed:
                return max(0.0, at + self.window_s - now)
        return self.window_s


@dataclass
class TenantUsage:
    connections: int = 0
    generations: int = 0
    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)

    def snapshot(self, now: float) -> dict[str, int]:
        return {
            "connections": self.connections,
            "generations": self.generations,
            "requests_last_minute": self.requests.used(now),
            "tokens_last_minute": self.tokens.used(now),
        }


class Usage:
    """Every tenant's usage (a tenant appears at its first use)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, shared: bool = False
    ) -> None:
        self.clock = clock
        self.shared = shared
        self._tenants: dict[str, TenantUsage] = {}

    def of(self, tenant: str) -> TenantUsage:
        usage = self._tenants.get(tenant)
        if usage is None:
            usage = self._tenants[tenant] = TenantUsage()
        return usage

    def snapshot(self, tenant: str) -> dict[str, int]:
        return self.of(tenant).snapshot(self.clock())

    # ------------------------------------------------------------------ connections

    def open_connection(self, tenant: str, quotas: Quotas) -> None:
        usage = self.of(tenant)
        limit = quotas.connections
        if limit is not None and usage.connections >= limit:
            raise connections_refused(tenant, limit)
        usage.connections += 1

    def close_connection(self, tenant: str) -> None:
        self.of(tenant).connections -= 1

    # ------------------------------------------------------------------ requests

    def start_request(
        self, tenant: str, quotas: Quotas, prompt_tokens: int, max_tokens: int
    ) -> None:
        """Count a request that is about to start, or refuse it."""
        usage = self.of(tenant)
        now = self.clock()
        if quotas.max_tokens is not None and max_tokens > quotas.max_tokens:
            raise QuotaExceeded(
                f"max_tokens {max_tokens} is over tenant {tenant}'s limit of "
                f"{quotas.max_tokens} per request"
            )
        if not self.shared:  # else the cluster checks these, for every node
            self._check_rates(tenant, usage, quotas, now, prompt_tokens)
        usage.generations += 1
        usage.requests.add(now, 1)
        usage.tokens.add(now, prompt_tokens)

    @staticmethod
    def _check_rates(
        tenant: str, usage: TenantUsage, quotas: Quotas, now: float, prompt_tokens: int
    ) -> None:
        """Refuse a request over the tenant's concurrent generations or per-minute rates."""
        if quotas.generations is not None and usage.generations >= quotas.generations:
            raise QuotaExceeded(
                f"tenant {tenant} runs {quotas.generations} generations, its limit; retry when "
                "one ends",
                retry_after_s=CONCURRENCY_RETRY_S,
            )
        rpm = quotas.requests_per_minute
        if rpm is not None:
            wait = usage.requests.wait_for(now, 1, rpm)
            if wait > 0:
                raise rate_refusal(tenant, f"{rpm} requests per minute", wait)
        tpm = quotas.tokens_per_minute
        if tpm is not None:
            if prompt_tokens > tpm:
                raise QuotaExceeded(
                    f"the prompt's {prompt_tokens} tokens are over tenant {tenant}'s limit of "
                    f"{tpm} tokens per minute"
                )
            wait = usage.tokens.wait_for(now, prompt_tokens, tpm)
            if wait > 0:
                raise rate_refusal(tenant, f"{tpm} tokens per minute", wait)

    def end_request(self, tenant: str, completion_tokens: int) -> None:
        usage = self.of(tenant)
        usage.generations -= 1
        usage.tokens.add(self.clock(), completion_tokens)


def rate_refusal(tenant: str, limit: str, wait: float) -> QuotaExceeded:
    seconds = max(1, math.ceil(wait))
    return QuotaExceeded(
        f"tenant {tenant} is at its limit of {limit}; retry in {seconds} s",
        retry_after_s=float(seconds),
    )


def connections_refused(tenant: str, limit: int) -> QuotaExceeded:
    """A connection over its tenant's ``connections`` quota (on this node, or the cluster's)."""
    return QuotaExceeded(
        f"tenant {tenant} has {limit} connections open, its limit; close one or retry",
        retry_after_s=CONCURRENCY_RETRY_S,
    )
