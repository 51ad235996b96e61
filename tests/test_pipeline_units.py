"""Admission, context fitting and the session store, without sockets."""

from __future__ import annotations

import asyncio

import pytest

from seedance.protocol.errors import ContextOverflow, Overloaded
from seedance.protocol.messages import ChatMessage, SessionId, TenantId
from seedance.server.admission import Admission
from seedance.sessions.context import fit_context
from seedance.sessions.session import Turn
from seedance.sessions.store import MemorySessionStore

T = TenantId("t")


async def test_admission_caps_running_and_queues_by_priority() -> None:
    admission = Admission(max_running=1, max_waiting=2)
    await admission.acquire()
    order: list[str] = []

    async def waiter(name: str, priority: int) -> None:
        await admission.acquire(priority)
        order.append(name)

    low = asyncio.create_task(waiter("low", 0))
    await asyncio.sleep(0)
    high = asyncio.create_task(waiter("high", 5))
    await asyncio.sleep(0)
    assert admission.waiting == 2
    with pytest.raises(Overloaded, match="2 requests waiting"):
        await admission.acquire()
    admission.release()
    await asyncio.sleep(0)
    admission.release()
    await asyncio.gather(low, high)
    assert order == ["high", "low"]
    assert admission.running == 1 and admission.waiting == 0
    admission.release()
    assert admission.running == 0


async def test_admission_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(max_running=1, max_waiting=5)
    await admission.acquire()
    task = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert admission.waiting == 0
    admission.release()
    assert admission.running == 0
    await admission.acquire()  # the slot was not lost
    assert admission.running == 1


def turns(*spec: tuple[str, int]) -> list[Turn]:
    return [Turn(ChatMessage(role, f"{role}{i}"), n, "m") for i, (role, n) in enumerate(spec)]  # type: ignore[arg-type]


def test_fit_context_trims_oldest_and_system_last() -> None:
    history = turns(
        ("system", 10), ("user", 30), ("assistant", 30), ("user", 30), ("assistant", 30)
    )
    new = turns(("user", 10))
    kept, tokens = fit_context(history, new, context_length=100, reply_overhead=2, max_tokens=20)
    # 100 - 12 (new) - 20 (reply room) = 68 for history: the system turn and the last turn.
    assert [t.message.content for t in kept] == ["system0", "assistant4", "user0"]
    assert tokens == 2 + 10 + 10 + 30
    kept, _ = fit_context(history, new, context_length=100, reply_overhead=2, max_tokens=80)
    assert [t.message.content for t in kept] == ["user0"]
    with pytest.raises(ContextOverflow, match="takes 102 tokens"):
        fit_context([], turns(("user", 100)), context_length=100, reply_overhead=2, max_tokens=1)


async def test_store_ttl_and_lru_with_a_fake_clock() -> None:
    now = [0.0]
    store = MemorySessionStore(ttl_s=10, max_sessions=2, clock=lambda: now[0])
    a, created = await store.attach(T, SessionId("a"))
    assert created
    await store.detach(a)
    now[0] = 5
    b, _ = await store.attach(T, SessionId("b"))
    await store.detach(b)
    now[0] = 12
    assert store.sweep() == 1  # a expired; b is 7 s old
    assert store.get(T, SessionId("a")) is None and len(store) == 1
    again, created = await store.attach(T, SessionId("b"))
    assert again is b and not created
    now[0] = 100
    assert store.sweep() == 0  # attached sessions never expire
    await store.detach(b)
    c, _ = await store.attach(T, SessionId("c"))
    d, _ = await store.attach(T, SessionId("d"))  # full: b (idle) is evicted, c is attached
    assert store.get(T, SessionId("b")) is None and store.evicted_total == 1
    with pytest.raises(Overloaded):
        await store.attach(T, SessionId("e"))
    assert {c.session_id, d.session_id} == {"c", "d"}


async def test_store_keys_sessions_by_tenant() -> None:
    store = MemorySessionStore(ttl_s=10, max_sessions=10)
    mine, _ = await store.attach(TenantId("a"), SessionId("same"))
    mine.turns.append(Turn(ChatMessage("user", "secret"), 3, "m"))
    theirs, created = await store.attach(TenantId("b"), SessionId("same"))
    assert created and theirs is not mine and theirs.turns == []


async def _served_order(admission: Admission, waiters: list[tuple[str, int]]) -> list[str]:
    """Queue ``waiters`` (tenant, tier) behind a held slot; release one at a time."""
    await admission.acquire()
    order: list[str] = []

    async def waiter(tenant: str, tier: int) -> None:
        await admission.acquire(tenant=tenant, weight=tier)
        order.append(tenant)

    tasks = []
    for tenant, tier in waiters:
        tasks.append(asyncio.create_task(waiter(tenant, tier)))
        await asyncio.sleep(0)
    for _ in waiters:
        admission.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


async def test_admission_serves_tenants_in_turn_weighted_by_tier() -> None:
    flood = [("a", 1)] * 6 + [("b", 1)] * 2
    order = await _served_order(Admission(max_running=1, max_waiting=100), flood)
    assert order[:4] == ["a", "b", "a", "b"]  # b's requests, queued last, are not last
    tiers = [("a", 1)] * 6 + [("b", 2)] * 6
    order = await _served_order(Admission(max_running=1, max_waiting=100), tiers)
    assert order[:9].count("b") == 6  # two turns for b's one, from the start


async def test_a_full_queue_pushes_out_the_busiest_tenants_newest() -> None:
    admission = Admission(max_running=1, max_waiting=3)
    await admission.acquire()
    flood = [asyncio.create_task(admission.acquire(tenant="a")) for _ in range(3)]
    await asyncio.sleep(0)
    assert admission.waiting == 3
    with pytest.raises(Overloaded):  # a is the busiest: its own newcomer is refused
        await admission.acquire(tenant="a")
    other = asyncio.create_task(admission.acquire(tenant="b"))
    for _ in range(2):
        await asyncio.sleep(0)
    assert flood[2].done() and isinstance(flood[2].exception(), Overloaded)
    assert admission.waiting == 3 and admission.waiting_of("b") == 1
    admission.release()  # b and a alternate: b joined at the current turn
    await asyncio.sleep(0)
    assert other.done() or flood[0].done()
    for _ in range(2):
        admission.release()
        await asyncio.sleep(0)
    assert other.done() and flood[0].done() and flood[1].done()


def test_usage_windows_and_failure_limiter_recover_with_time() -> None:
    from seedance.protocol.errors import QuotaExceeded
    from seedance.tenants.auth import FailureLimiter
    from seedance.tenants.config import Quotas
    from seedance.tenants.usage import Usage

    now = [1000.0]
    usage = Usage(clock=lambda: now[0])
    quotas = Quotas(requests_per_minute=2, tokens_per_minute=100)
    for _ in range(2):
        usage.start_request("t", quotas, 10, 5)
        usage.end_request("t", 5)
    with pytest.raises(QuotaExceeded) as refused:
        usage.start_request("t", quotas, 10, 5)
    assert refused.value.retry_after_s == 60
    now[0] += 30
    with pytest.raises(QuotaExceeded):
        usage.start_request("t", quotas, 10, 5)
    now[0] += 30.5  # the first request left the window
    usage.start_request("t", quotas, 80, 5)
    usage.end_request("t", 5)  # 85 tokens in the window
    now[0] += 1
    with pytest.raises(QuotaExceeded, match="100 tokens per minute"):
        usage.start_request("t", Quotas(tokens_per_minute=100), 20, 5)
    assert usage.snapshot("t")["generations"] == 0

    limiter = FailureLimiter(burst=2, window_s=10.0, clock=lambda: now[0])
    limiter.record("1.2.3.4")
    limiter.record("1.2.3.4")
    with pytest.raises(QuotaExceeded) as limited:
        limiter.check("1.2.3.4")
    assert limited.value.retry_after_s == 5
    limiter.check("5.6.7.8")  # another address is not held back
    now[0] += 5
    limiter.check("1.2.3.4")
