"""The Python SDK's quality of service (``seedance.client.qos``): its health score, circuit
breaker, retry budget and fallbacks, against real servers behind the fault proxy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from seedance.client import (
    BreakerPolicy,
    CircuitBreaker,
    ConnectionClosed,
    Degrade,
    HealthScore,
    NoReply,
    QoS,
    ResilientClient,
    ResponseCache,
)
from seedance.testing.faults import FaultProxy
from tests.support.servers import RunningServer, slow_engine
from tests.test_fault_proxy import target
from tests.test_metrics import scrape, value

DEGRADED = "The assistant is busy; please try again in a minute."


def requests_served(server: RunningServer) -> float:
    samples, _ = scrape(server)
    return sum(v for (name, _), v in samples.items() if name == "seedance_requests_total")


def test_the_health_score_weighs_recent_calls_more() -> None:
    health = HealthScore(sla_ttft_s=0.5)
    assert health.value == 1.0
    health.record(0.2)  # within the SLA: 1
    health.record(1.0)  # twice the SLA: 0.5
    health.record(None)  # failed: 0
    assert health.value == pytest.approx((1 * 1 + 2 * 0.5 + 3 * 0) / 6)
    for _ in range(10):
        health.record(0.1)
    assert health.value == 1.0  # only the last 10 calls count


def test_the_breaker_opens_on_the_failure_rate_of_its_window_and_probes() -> None:
    now = [0.0]
    events: list[tuple[str, str]] = []
    breaker = CircuitBreaker(
        "x", BreakerPolicy(), lambda _, old, new, why: events.append((new, why)), lambda: now[0]
    )
    for _ in range(19):
        breaker.record(False)  # 19 failures: fewer than 20 samples, still closed
    assert breaker.state == "closed"
    now[0] = 6.0  # those left the 5 s window
    for i in range(20):
        breaker.record(i % 2 == 0)  # 50% of 20
    assert breaker.state == "open" and "10 of the last 20 calls" in events[-1][1]
    assert not breaker.allow()
    now[0] = 11.5  # cool-down over: three probes, no more
    assert [breaker.allow() for _ in range(4)] == [True, True, True, False]
    assert breaker.state == "half_open"
    breaker.record(True)
    breaker.record(False)  # one probe fails: open again
    assert breaker.state == "open"
    now[0] = 17.0
    for _ in range(3):
        assert breaker.allow()
        breaker.record(True)
    assert breaker.state == "closed"
    assert [e[0] for e in events] == ["open", "half_open", "open", "half_open", "closed"]


async def test_the_breaker_opens_within_its_window_then_recovers(server: RunningServer) -> None:
    events: list[str] = []
    async with FaultProxy(target(server)) as proxy:
        client = ResilientClient(
            [proxy.url],
            breaker=BreakerPolicy(cooldown_s=0.5),
            degraded_reply=DEGRADED,
            on_breaker=lambda _, old, new, why: events.append(new),
        )
        try:
            proxy.reset_rate = 1.0  # every connection is reset: every call fails at once
            replies = [await client.complete("x", max_tokens=2) for _ in range(20)]
            assert events == ["open"] and all(r.source == "degraded" for r in replies)
            touched = proxy.accepted
            skipped = [await client.complete("x", max_tokens=2) for _ in range(5)]
            assert proxy.accepted == touched  # open: the endpoint is not even tried
            assert all("circuit open" in (r.reason or "") for r in skipped)

            proxy.reset_rate = 0.0
            await asyncio.sleep(0.6)
            healed = [await client.complete("x", max_tokens=2) for _ in range(3)]
            assert all(r.source == "endpoint" for r in healed)
            assert events == ["open", "half_open", "closed"]
        finally:
            await client.close()


async def test_fallbacks_only_before_the_first_token(
    make_server: Callable[..., RunningServer],
) -> None:
    primary = make_server([slow_engine(tokens_per_s=100)])
    secondary = make_server()
    async with FaultProxy(target(primary)) as proxy:
        client = ResilientClient(
            [proxy.url, secondary.url], first_token_timeout_s=0.3, retry_ratio=1.0
        )
        try:
            # Before the first token: the primary is silent, the secondary answers.
            proxy.blackhole = True
            reply = await client.complete("x", max_tokens=3)
            assert reply.source == "endpoint" and reply.endpoint == secondary.url
            assert f"{proxy.url}: no first token in time" in (reply.reason or "")
            proxy.blackhole = False
            proxy.drop()
            assert requests_served(secondary) == 1

            # After it: the reply fails as it is, and nothing is asked of the secondary.
            reply = client.generate("x", max_tokens=50)
            first = await reply.__anext__()
            assert reply.endpoint == proxy.url and first.text
            proxy.reset()
            with pytest.raises(ConnectionClosed):
                async for _ in reply:
                    pass
            assert requests_served(secondary) == 1
        finally:
            await client.close()


async def test_retries_add_at_most_a_tenth_then_the_cache_and_the_degraded_reply(
    make_server: Callable[..., RunningServer],
) -> None:
    primary, secondary = make_server(), make_server()
    async with FaultProxy(target(primary)) as proxy:
        cache = ResponseCache()
        client = ResilientClient(
            [proxy.url, secondary.url],
            breaker=BreakerPolicy(min_samples=1000),  # never opens: the budget alone decides
            cache=cache,
            degraded_reply=DEGRADED,
        )
        try:
            warm = await client.complete("cached question", max_tokens=4, seed=1)
            assert warm.source == "endpoint" and warm.endpoint == proxy.url
            proxy.reset_rate = 1.0
            proxy.drop()
            calls = 60
            replies = [await client.complete("x", max_tokens=2) for _ in range(calls)]
            by_source = {s: sum(r.source == s for r in replies) for s in ("endpoint", "degraded")}
            # Each call tried the primary; a tenth of them, at most, went on to the secondary.
            assert 1 <= by_source["endpoint"] <= calls // 10 + 1
            assert requests_served(secondary) == by_source["endpoint"]
            assert client.budget.retries <= 0.1 * client.budget.calls
            degraded = next(r for r in replies if r.source == "degraded")
            assert degraded.text == DEGRADED and "retry budget spent" in (degraded.reason or "")

            again = await client.complete("cached question", max_tokens=4, seed=1)
            assert again.source in ("cache", "endpoint")
            if again.source == "cache":
                assert again.text == warm.text
        finally:
            await client.close()

    lonely = ResilientClient(["ws://127.0.0.1:9"], reconnect=None)
    with pytest.raises(NoReply, match=r"127\.0\.0\.1:9"):
        await lonely.complete("x")


async def test_the_health_score_reaches_the_server_and_degrades_the_client(
    server: RunningServer,
) -> None:
    async with FaultProxy(target(server)) as proxy:
        client = ResilientClient(
            [proxy.url],
            qos=QoS("high", "sdk_health"),
            sla_ttft_s=0.02,
            degrade=Degrade(max_tokens=3),
        )
        try:
            proxy.delay_s = 0.05  # a first token in 100 ms or more: 0.2 of the SLA at best
            replies = [await client.complete("x", max_tokens=40) for _ in range(4)]
            assert client.health.value < 0.7
            assert replies[0].done is not None and replies[0].done.usage.completion_tokens == 40
            assert replies[-1].done is not None and replies[-1].done.usage.completion_tokens == 3
        finally:
            await client.close()
    samples, _ = scrape(server)
    count = value(samples, "seedance_slo_client_health_score_count", slatag="sdk_health")
    total = value(samples, "seedance_slo_client_health_score_sum", slatag="sdk_health")
    assert count == 4 and total < 4 * 0.8  # 1.0 first, then lower


async def test_calls_at_once_take_sessions_of_their_own_and_start_afresh(
    make_server: Callable[..., RunningServer],
) -> None:
    """A session runs one reply at a time: concurrent calls through one client each take an
    idle session or open one (none meets session_busy), and each call resets its context."""
    server = make_server([slow_engine(tokens_per_s=200)])
    client = ResilientClient([server.url])
    try:
        replies = await asyncio.gather(*(client.complete(f"q{i}", max_tokens=20) for i in range(6)))
        assert all(r.source == "endpoint" and r.reason is None for r in replies)
        sessions = client._sessions[(server.url, None)]
        assert len(sessions) == 6
        again = await asyncio.gather(*(client.complete("x", max_tokens=3) for _ in range(3)))
        assert len(sessions) == 6 and all(r.source == "endpoint" for r in again)  # reused
        assert all(r.done is not None and r.done.usage.prompt_tokens < 30 for r in again)
    finally:
        await client.close()
