"""Admission and a generation's lifecycle without sockets (``tests/support/fakes.py``): the
checks every API's request meets and their order, quotas on a fake clock, what a generation
records, and what its readers' leaving does. The same rules over real sockets, per API, are in
``tests/test_refusals.py`` and the APIs' own tests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.errors import SeedanceError
from seedance.protocol.messages import DoneFrame, Generate, RequestId, SessionId, TenantId
from seedance.server.lifecycle.admit import Requester, admit, explicit_prompt, prepare
from seedance.server.lifecycle.generation import Generation
from seedance.server.lifecycle.reader import Reading
from seedance.server.lifecycle.refusals import Arrival
from seedance.server.lifecycle.services import Services
from seedance.sessions.session import Session
from seedance.tenants.auth import Principal
from tests.support.fakes import fake_services, principal
from tests.support.waits import eventually

SCOPE = {"type": "websocket", "path": "/v2/infer", "client": ("127.0.0.1", 40000), "headers": []}


def arrival_of(services: Services, caller: Principal, request_id: str) -> Arrival:
    arrival = services.refusals.arrive("websocket", SCOPE, "chat", request_id=request_id)
    arrival.principal = caller
    return arrival


def ask(
    services: Services,
    caller: Principal,
    request_id: str,
    *,
    session: Session | None = None,
    **fields: Any,
) -> Generation:
    """A request as every API makes one: prepare (model, limits), then admit."""
    arrival = arrival_of(services, caller, request_id)
    message = Generate(**{"prompt": "hello there", "max_tokens": 8, **fields})
    model, message = prepare(services, arrival, None, None, message)
    requester = Requester(caller, model, "websocket", session=session)
    prompt = None if session is not None else explicit_prompt(
        model, message.turns(), raw=False, unset=frozenset()
    )  # fmt: skip
    try:
        return admit(services, arrival, requester, message, prompt=prompt)
    except SeedanceError as exc:
        services.refusals.refuse(arrival, exc)
        raise


async def read(generation: Generation) -> tuple[str, Any]:
    with Reading(generation.log, generation) as reading:
        text = "".join([piece async for piece, _ in reading])
    return text, reading.end


async def attach(services: Services, caller: Principal, session_id: str) -> Session:
    session, _ = await services.sessions.attach(TenantId(caller.name), SessionId(session_id))
    return session


async def test_a_generation_without_sockets_records_its_reply_and_gives_back_what_it_held() -> None:
    services, audit, _ = fake_services()
    caller = principal()
    session = await attach(services, caller, "s1")
    generation = ask(services, caller, "r1", session=session)
    assert session.busy and services.usage.snapshot("acme")["generations"] == 1
    text, end = await read(generation)
    assert isinstance(end, DoneFrame) and end.finish_reason == "length"
    assert end.usage.completion_tokens == 8 and text
    await eventually(lambda: len(services.generations) == 0)
    assert not session.busy and services.usage.snapshot("acme")["generations"] == 0
    assert [t.message.content for t in session.turns] == ["hello there", text]  # committed
    (record,) = audit.of_kind("request")
    assert record["outcome"] == "length" and record["request_id"] == "r1"
    assert record["session"] == "s1" and record["completion_tokens"] == 8


async def test_the_checks_come_in_one_order_for_every_request() -> None:
    """Draining, then the audit log, then the priority, then the session busy, then the
    context window, then the tenant's quotas: a request that fails several gets the first."""
    services, audit, _ = fake_services([SyntheticEngine(context_length=64, tokens_per_s=50)])
    caller = principal(generations=1)
    session = await attach(services, caller, "s1")
    running = ask(services, caller, "r0", session=session, max_tokens=40)
    other = await attach(services, caller, "s2")
    long = {"prompt": "word " * 80, "priority": 5}

    def refused(**fields: Any) -> str:
        with pytest.raises(SeedanceError) as refusal:
            ask(services, caller, "r1", session=fields.pop("on", session), **{**long, **fields})
        return f"{refusal.value.code}: {refusal.value.message}"

    services.shutdown.draining = True
    audit.down = "disk full"
    assert refused().startswith("overloaded: the server is shutting down")
    services.shutdown.draining = False
    assert refused().startswith("overloaded: the audit log cannot be written (disk full)")
    audit.down = None
    assert refused().startswith("forbidden:")  # priority 5 over the tenant's 0
    assert refused(priority=0).startswith("session_busy:")
    assert refused(priority=0, on=other).startswith("context_overflow:")
    assert refused(priority=0, on=other, prompt="short").startswith("quota_exceeded:")
    running.cancel(silent=False)
    await asyncio.gather(running.task, return_exceptions=True)  # type: ignore[arg-type]
    assert ask(services, caller, "r2", session=other).request_id == "r2"
    # Each refusal was reported once, in one shape.
    outcomes = [r["outcome"] for r in audit.of_kind("refused")]
    assert outcomes == [
        "overloaded", "overloaded", "forbidden", "session_busy", "context_overflow",
        "quota_exceeded",
    ]  # fmt: skip
    assert {r["path"] for r in audit.of_kind("refused")} == {"/v2/infer"}


async def test_a_rate_quota_refuses_with_retry_after_and_recovers_on_the_clock() -> None:
    services, _, clock = fake_services()
    caller = principal(requests_per_minute=2)
    for request_id in ("r1", "r2"):
        await read(ask(services, caller, request_id))
    with pytest.raises(SeedanceError) as refusal:
        ask(services, caller, "r3")
    assert refusal.value.code == "quota_exceeded"
    assert refusal.value.retry_after_s is not None and 0 < refusal.value.retry_after_s <= 60
    clock.advance(61)
    text, end = await read(ask(services, caller, "r4"))
    assert isinstance(end, DoneFrame) and text


async def test_a_reader_leaving_aborts_a_request_and_a_resumable_one_runs_on() -> None:
    services, audit, _ = fake_services([SyntheticEngine(tokens_per_s=200)], resume_grace_s=0.3)
    caller = principal()
    plain = ask(services, caller, "r1", max_tokens=1000)
    with Reading(plain.log, plain) as reading:
        async for _ in reading:
            break  # the reader leaves after its first text
    await asyncio.gather(plain.task, return_exceptions=True)  # type: ignore[arg-type]
    assert plain.outcome == "aborted" and plain.log.end is None
    resumable = ask(services, caller, "r2", max_tokens=1000, resumable=True)
    with Reading(resumable.log, resumable) as reading:
        async for _ in reading:
            break
    await asyncio.sleep(0.1)
    assert resumable.task is not None and not resumable.task.done()  # within its grace
    later = Reading(resumable.log, resumable, resumable.log.next_seq - 1)
    with later:  # a reader comes back within the grace: it runs on to its end
        async for _ in later:
            pass
    assert isinstance(later.end, DoneFrame) and later.end.finish_reason == "length"
    assert [r["outcome"] for r in audit.of_kind("request")] == ["aborted", "length"]


async def test_a_refusal_is_counted_traced_and_recorded_in_one_shape() -> None:
    services, audit, _ = fake_services()
    caller = principal(max_priority=0)
    with pytest.raises(SeedanceError):
        ask(services, caller, "r-9", priority=3)
    (record,) = audit.of_kind("refused")
    assert record["outcome"] == "forbidden" and record["request_id"] == "r-9"
    assert record["tenant"] == "acme" and record["model"] == "synthetic"
    assert record["api"] == "websocket" and record["peer"] == "127.0.0.1:40000"
    metrics = services.metrics.render().decode()
    assert 'seedance_refused_total{api="websocket",code="forbidden"} 1.0' in metrics
    assert 'outcome="forbidden"' in metrics  # seedance_requests_total, by its code


@pytest.mark.parametrize("request_id", [RequestId("r1")])
async def test_two_sessions_may_run_one_request_id_and_each_finds_its_own(
    request_id: RequestId,
) -> None:
    services, _, _ = fake_services([SyntheticEngine(tokens_per_s=100)])
    caller = principal()
    one, two = await attach(services, caller, "one"), await attach(services, caller, "two")
    first = ask(services, caller, request_id, session=one, max_tokens=200)
    second = ask(services, caller, request_id, session=two, max_tokens=200)
    assert services.generations.running_on(one) is first
    assert services.generations.running_on(two) is second
    first.cancel(silent=False)
    await asyncio.gather(first.task, return_exceptions=True)  # type: ignore[arg-type]
    assert second.task is not None and not second.task.done()
    second.cancel(silent=True)
    await asyncio.gather(second.task, return_exceptions=True)


async def test_a_generation_cancelled_before_its_task_first_runs_still_ends_and_frees_all() -> None:
    """A cancel in the same loop iteration as the admission (a ``generate`` and a ``cancel``
    handled as they are parsed, a drain): asyncio never runs the body of a task cancelled
    before its first step, so the generation stops at its first step instead, and its end,
    its session and its tenant's count are given back as after any cancel."""
    services, audit, _ = fake_services()
    caller = principal()
    session = await attach(services, caller, "s1")
    generation = ask(services, caller, "r1", session=session)
    generation.cancel(silent=False)  # before the loop ran its task
    text, end = await read(generation)
    assert isinstance(end, DoneFrame) and end.finish_reason == "cancelled" and text == ""
    await eventually(lambda: len(services.generations) == 0)
    assert not session.busy and services.usage.snapshot("acme")["generations"] == 0
    assert [r["outcome"] for r in audit.of_kind("request")] == ["cancelled"]
