"""The cluster mode through a Redis failover, with real ``redis-server`` and
``redis-sentinel`` processes (:class:`~tests.support.redis.Sentinels`): nodes given
``--redis sentinel://...`` find the primary through the sentinels, ride through its loss (a
reply streams on from its node; new requests wait for the promotion instead of failing) and
never let two nodes write one generation's log."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from websockets.exceptions import ConnectionClosed

from seedance.cluster.local import SERVICE, acquainted, sentinel_url
from tests.support.redis import RedisPods, RedisServer, Sentinels
from tests.support.servers import ServerProcess
from tests.support.waits import wait_for
from tests.support.ws import generate, open_session
from tests.test_cluster import CHAT, chat_until, taken_over_then_fenced
from tests.test_resume import begin, read, read_whole, resume, undisturbed

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.timeout(240)]


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    group = Sentinels(tmp_path).start()
    yield group
    group.stop()


def two_nodes(
    server_process: Callable[..., ServerProcess], sentinels: Sentinels, tokens_per_s: int
) -> tuple[ServerProcess, ServerProcess]:
    args = ("--redis", sentinels.url, "--lease", "1")
    pace = ("--synthetic-tokens-per-s", str(tokens_per_s))
    first, second = (server_process(*args, *pace, "--node-id", f"n{i}") for i in (1, 2))
    return first, second


def end_of(frames: list[dict[str, Any]]) -> str:
    """How a reply ended: done, or its error's code."""
    end = frames[-1]
    return "done" if end["type"] == "done" else str(end.get("error", end))


async def test_a_primary_killed_under_load_loses_no_token_and_refuses_nothing(
    sentinels: Sentinels, server_process: Callable[..., ServerProcess]
) -> None:
    """kill -9 of Redis's primary while six replies stream (three per node) and new requests
    keep coming: each reply goes on from its node after the promotion, every token once and
    the text of an undisturbed run; no new request fails (they wait for the promotion); and
    the new primary holds each reply whole (what a client saw had reached the replica)."""
    nodes = two_nodes(server_process, sentinels, tokens_per_s=150)
    expected = await undisturbed(nodes[0], max_tokens=450)  # type: ignore[arg-type]
    replies = [await begin(nodes[i % 2].url, f"s{i}", 450, until_seq=20) for i in range(6)]
    short: list[tuple[str, float]] = []  # each new request's end, and how long it took
    stop = asyncio.Event()

    async def new_requests(node: ServerProcess) -> None:
        while not stop.is_set():
            began = time.monotonic()
            ws, _ = await open_session(node.url)
            async with ws:
                frames = await generate(ws, prompt="hi", max_tokens=3, resumable=True)
            short.append((end_of(frames), time.monotonic() - began))
            await asyncio.sleep(0.05)

    async def conversation(node: ServerProcess) -> None:
        """Requests that continue one session (neither resumable nor new: each saves the
        session's turns once it ends)."""
        ws, _ = await open_session(node.url)
        async with ws:
            while not stop.is_set():
                began = time.monotonic()
                frames = await generate(ws, prompt="hi", max_tokens=3)
                short.append((end_of(frames), time.monotonic() - began))
                await asyncio.sleep(0.02)

    talks = [asyncio.ensure_future(conversation(node)) for node in nodes]
    await asyncio.sleep(0.2)
    load = [*talks, *(asyncio.ensure_future(new_requests(node)) for node in nodes)]
    old = sentinels.primary()
    old.stop(kill=True)
    killed_at = time.monotonic()
    for ws, reading in replies:
        async with ws:
            await read(ws, reading)
    await asyncio.to_thread(sentinels.wait_failover, old)
    stop.set()
    await asyncio.gather(*load)
    for _, reading in replies:  # Reading.take checked every seq came once, in order
        assert reading.end is not None and reading.end["type"] == "done", reading.end
        assert reading.last_seq == 449 and reading.text == expected
    ends = [end for end, _ in short]
    assert ends and set(ends) == {"done"}, ends
    waited = max(took for _, took in short)
    assert waited > 1.0  # some waited for the promotion, within the time it took
    assert waited < time.monotonic() - killed_at
    for i in range(6):
        whole = await read_whole(nodes[(i + 1) % 2], f"s{i}")
        assert whole.text == expected and whole.end == replies[i][1].end
    for node in nodes:
        await node.logged("answers again (another server: a failover)")


async def test_a_frozen_node_cannot_write_after_a_failover_and_a_takeover(
    sentinels: Sentinels, server_process: Callable[..., ServerProcess]
) -> None:
    """SIGSTOP of the node running a reply, then kill -9 of the primary: after the promotion
    the other node takes the reply over (the client resumed there); SIGCONT: the frozen
    node's next write is refused (its fencing token is behind the new primary's counter, which
    the replica held before the claim went on), and the log holds exactly one reply."""
    owner, survivor = two_nodes(server_process, sentinels, tokens_per_s=300)
    expected = await undisturbed(survivor, max_tokens=600)  # type: ignore[arg-type]
    ws, reading = await begin(owner.url, "frozen", 600, until_seq=50)
    owner.signal(signal.SIGSTOP)
    try:
        old = sentinels.primary()
        old.stop(kill=True)
        await asyncio.to_thread(sentinels.wait_failover, old)
        await taken_over_then_fenced(owner, survivor, "frozen", reading)
        with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
            await ws.close()
    finally:
        owner.signal(signal.SIGCONT)
    assert reading.end is not None and reading.end["type"] == "done"
    assert reading.text == expected and reading.last_seq == 599
    whole = await read_whole(survivor, "frozen")
    assert whole.text == expected and whole.end == reading.end


async def test_a_reply_is_taken_over_through_a_failover(
    sentinels: Sentinels, server_process: Callable[..., ServerProcess]
) -> None:
    """kill -9 of the node running a reply and of the primary at once: the client resumes
    on the other node while the sentinels promote the replica; that node takes the reply over
    where the replica has it (everything the client saw), every seq once, the undisturbed
    text."""
    owner, survivor = two_nodes(server_process, sentinels, tokens_per_s=300)
    expected = await undisturbed(survivor, max_tokens=600)  # type: ignore[arg-type]
    ws, reading = await begin(owner.url, "doomed", 600, until_seq=80)
    old = sentinels.primary()
    owner.signal(signal.SIGKILL)
    old.stop(kill=True)
    with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
        await read(ws, reading)  # what was on its way before the socket went
    assert reading.end is None
    resumed, _ = await resume(survivor, "doomed", reading)  # type: ignore[arg-type]
    async with resumed:
        await read(resumed, reading)
    assert reading.end is not None and reading.end["type"] == "done", reading.end
    assert reading.last_seq == 599 and reading.text == expected
    await survivor.logged("request r1 taken over at seq")
    assert sentinels.primary() is not old


@pytest.mark.parametrize("password", ["", "0f1e2d3c4b5a"], ids=["no password", "a password"])
async def test_the_kubernetes_redis_pods_fail_over_and_a_primary_back_follows_the_new_one(
    tmp_path: Path, server_process: Callable[..., ServerProcess], password: str
) -> None:
    """The Kubernetes manifests' three Redis pods (deploy/k8s/redis.yaml's scripts, each pod a
    redis-server and a sentinel): the first starts as the primary, the others follow it; a
    node's session outlives the first pod's death (kill -9 of both its processes, the sentinel
    the node asks first among them); started again, the first pod asks the sentinels and comes
    back as a replica of the new primary, not as a second primary. With a password in the
    Secret, the servers and the sentinels ask for it (of each other too), and the node gives
    it in its URL as deployment.yaml does."""
    pods = RedisPods(tmp_path, password)
    try:
        for i in range(3):
            pods.start(i)
        wait_for(lambda: pods.role(0) == ("master", 2), "two replicas of the first pod")
        wait_for(
            lambda: acquainted(pods.sentinel_ports, password=password or None),
            "the sentinels knowing each other",
        )
        if password:
            with pytest.raises(redis.AuthenticationError):  # NOAUTH: no way in without it
                redis.Redis(port=pods.sentinel_ports[1]).ping()
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=pods.redis_ports[1]).ping()
        url = sentinel_url(pods.sentinel_ports).replace("sentinel://", f"sentinel://:{password}@")
        node = server_process("--redis", url, "--lease", "1")
        ws, hello = await open_session(node.url, "session_id=kept")
        async with ws:
            assert end_of(await generate(ws, prompt="one", max_tokens=3)) == "done"

        pods.kill(0)
        wait_for(lambda: pods.primary() not in (0, None), "the sentinels' failover", 30)
        new = pods.primary()
        assert new is not None
        # The pods' primaries take writes only with a replica in sync (min-replicas-to-write 1):
        # until the sentinels have the third pod follow the new one, a node answers a retryable
        # "overloaded" (the guarantee, not a fault), so the test waits as a client would retry.
        # The sentinels' reconfiguration of the third pod took over 30 s once on 2 busy cores
        # (make test-workers): the bound is a client's patience, not a figure of the pods.
        wait_for(lambda: pods.role(new) == ("master", 1), "the new primary's replica", 60)
        ws, hello = await open_session(node.url, "session_id=kept")
        async with ws:
            assert not hello["created"] and hello["context_turns"] == 2
            assert end_of(await generate(ws, prompt="two", max_tokens=3)) == "done"

        pods.start(0)
        wait_for(lambda: pods.role(0) == ("slave", 0), "the first pod following again")
        assert pods.follows(0) == pods.redis_ports[new] and pods.primary() == new
        wait_for(lambda: pods.role(new) == ("master", 2), "the new primary's two replicas")
    finally:
        pods.stop()


async def test_a_strict_node_writes_nothing_that_no_replica_holds(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    """``--redis-wait-strict`` with one replica wanted, on a Redis that has none: the node
    refuses work (503, and /healthz says why) instead of writing what a failover would lose;
    once a replica follows that Redis, it serves."""
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(tmp_path / "replica", replica_of=primary.port)
    flags = ("--redis-wait-replicas", "1", "--redis-wait-strict")
    node = server_process("--redis", primary.url, *flags)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.port}") as client:
            refused = await client.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503
            assert "0 of 1 replica(s) acknowledged a write" in refused.text
            health = await client.get("/healthz")
            assert health.status_code == 503 and "--redis-wait-strict" in health.text
            replica.start()
            wait_for(lambda: Sentinels.replicas(primary) == 1, "the replica's link")
            await node.logged("answers again")  # by one worker: the others within a ping
            served = await chat_until(f"http://127.0.0.1:{node.port}", 200)
            assert served.status_code == 200, served.text
    finally:
        replica.stop(kill=True)
        primary.stop(kill=True)


def test_the_sentinel_url_names_the_service_behind_its_sentinels() -> None:
    from seedance.cluster.urls import SentinelUrl, valid

    url = SentinelUrl.parse(f"sentinel://:pw@10.0.0.1:26379,[::1]:26380/{SERVICE}/2")
    assert url.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (url.service, url.db, url.password, url.username) == (SERVICE, 2, "pw", None)
    assert SentinelUrl.parse("sentinel://h:1/s?sentinel_password=x").sentinel_password == "x"
    for bad, why in [
        ("sentinel://h:1", "name the service"),
        ("sentinel://h/s", "is not HOST:PORT"),
        ("sentinel://h:1/s/x", "not a number"),
        ("sentinel://h:1/s?db=2", "unknown parameter"),
    ]:
        assert not valid(bad)
        with pytest.raises(ValueError, match=why):
            SentinelUrl.parse(bad)


def test_the_logs_show_no_redis_password() -> None:
    from seedance.cluster.urls import redacted

    assert (
        redacted(f"sentinel://:pw@10.0.0.1:26379,[::1]:26380/{SERVICE}/2?sentinel_password=x")
        == f"sentinel://:***@10.0.0.1:26379,[::1]:26380/{SERVICE}/2?sentinel_password=***"
    )  # this raised ValueError (the sentinels' list is no port), and the node did not start
    assert redacted("rediss://app:pw@redis:6380/1") == "rediss://app:***@redis:6380/1"
    assert redacted("unix:///run/redis.sock?db=1&password=pw") == (
        "unix:///run/redis.sock?db=1&password=***"
    )
    for plain in ("redis://redis:6379", "redis://app@redis:6379", "unix:///run/redis.sock"):
        assert redacted(plain) == plain
