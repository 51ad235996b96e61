"""The cluster mode (``--redis``) with a real ``redis-server``: nodes that share one Redis hold
one tenant's limits exactly, run one generation per session, and refuse at once (retryable)
while Redis is gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from websockets.exceptions import ConnectionClosed

from seedance.client import Reconnect, connect
from seedance.cluster.link import PING_INTERVAL_S, TIMEOUT_S
from seedance.config import ConfigError
from seedance.config_loader import load_access, load_config
from seedance.engines.synthetic import SyntheticEngine
from seedance.netutil import free_port
from seedance.tenants.keys import add_key
from seedance.testing.faults import FaultProxy
from tests.support.otlp import http_receiver
from tests.support.redis import RedisServer
from tests.support.servers import (
    SEEDANCE,
    RunningServer,
    ServerProcess,
    one_process_only,
    slow_engine,
)
from tests.support.tools import tool
from tests.support.waits import eventually
from tests.support.ws import (
    collect,
    generate,
    open_session,
    recv_json,
    tokens_text,
    wait_closed,
)
from tests.support.ws import raw_connect as raw
from tests.test_balancer import haproxy
from tests.test_lifecycle import BODY, content, dropped_at, sse
from tests.test_resume import PROMPT, Reading, begin, read, read_whole, resume, undisturbed
from tests.test_tensor_frames import PROMPT as TENSOR_PROMPT
from tests.test_tensor_frames import begin_and_drop, check_pairs, detokenize, read_frames

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
#: How soon every process of a node sees Redis go or come back: its next ping, and that ping's
#: timeout (each worker of ``--workers N`` pings for itself, so one may log it before another
#: sees it).
NOTICED_S = PING_INTERVAL_S + TIMEOUT_S


async def chat_until(base_url: str, status: int, seconds: float = NOTICED_S) -> httpx.Response:
    """The answer to a new chat request once it has ``status``, or the last answer after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url) as client:
        while True:
            answer = await client.post("/v1/chat/completions", json=CHAT)
            if answer.status_code == status or time.monotonic() > deadline:
                return answer
            await asyncio.sleep(0.1)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def nodes(
    make_server: Callable[..., RunningServer],
    count: int,
    redis: RedisServer,
    config: Path | None = None,
    engines: Callable[[], Any] | None = None,
    **fields: Any,
) -> list[RunningServer]:
    """``count`` servers on one Redis (and the tenants of ``config``)."""
    if config is not None:
        fields.update(config_file=str(config), access=load_access(config))
    return [
        make_server(
            None if engines is None else [engines()],
            redis_url=redis.url,
            node_id=f"node{i}",
            **fields,
        )
        for i in range(1, count + 1)
    ]


async def redis_answers(*servers: RunningServer) -> None:
    """Wait until every node sees Redis answer (after a restart)."""

    def answers() -> bool:
        return all(s.state.cluster and s.state.cluster.link.error is None for s in servers)

    await eventually(answers, 5, "the nodes to see Redis answer")


def test_the_cluster_settings_come_from_flags_and_the_cluster_table(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[cluster]\nredis = "redis://db:6379/2"\nnode_id = "a"\nlease = 3\n')
    config = load_config({"config": str(path)})
    cluster = config.cluster
    assert (cluster.redis_url, cluster.node_id, cluster.lease_s) == ("redis://db:6379/2", "a", 3.0)
    assert load_config({"config": str(path), "redis_url": "unix:///r.sock"}).cluster.redis_url == (
        "unix:///r.sock"
    )
    with pytest.raises(ConfigError, match="redis://, rediss:// or unix://"):
        load_config({"redis_url": "http://db"})
    with pytest.raises(ConfigError, match=r"0\.5 or more"):
        load_config({"lease_s": "0.1"})


async def test_three_nodes_admit_exactly_a_tenants_limits(
    tmp_path: Path, redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """300 attempts at once, spread over three nodes: exactly the tenant's 100 requests a
    minute pass; tokens per minute hold too (reserved up front: never over the limit)."""
    path = tmp_path / "s.toml"
    path.write_text(
        "[tenants.acme.quotas]\nrequests_per_minute = 100\n"
        "[tenants.globex.quotas]\ntokens_per_minute = 400\n"
    )
    acme, globex = add_key(path, "acme").key, add_key(path, "globex").key
    servers = nodes(make_server, 3, redis_server, path)

    async def attempt(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> httpx.Response:
        return await client.post("/v1/chat/completions", json=body, headers=auth(key))

    clients = [httpx.AsyncClient(base_url=s.http_url, timeout=30) for s in servers]
    try:
        replies = await asyncio.gather(*(attempt(clients[i % 3], acme, CHAT) for i in range(300)))
        codes = [r.status_code for r in replies]
        assert codes.count(200) == 100 and codes.count(429) == 200, codes
        refusal = next(r for r in replies if r.status_code == 429)
        assert "100 requests per minute (across the cluster)" in refusal.text
        assert 1 <= int(refusal.headers["retry-after"]) <= 60

        body = {**CHAT, "max_tokens": 10}
        replies = await asyncio.gather(*(attempt(clients[i % 3], globex, body) for i in range(60)))
        done = [r.json()["usage"] for r in replies if r.status_code == 200]
        assert {r.status_code for r in replies} == {200, 429}
        used = sum(u["total_tokens"] for u in done)
        reply_size = done[0]["prompt_tokens"] + 10
        assert used <= 400 < used + reply_size, (used, reply_size)
    finally:
        for client in clients:
            await client.aclose()


async def test_a_tenants_connections_are_counted_across_nodes(
    tmp_path: Path, redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """A tenant of two connections holds one on each node: a third is refused on either,
    and a closed one makes room on the other node."""
    path = tmp_path / "s.toml"
    path.write_text("[tenants.acme.quotas]\nconnections = 2\n")
    headers = auth(add_key(path, "acme").key)
    one, two = nodes(make_server, 2, redis_server, path)
    first, _ = await open_session(one.url, additional_headers=headers)
    second, _ = await open_session(two.url, additional_headers=headers)
    async with second:
        for node in (one, two):
            async with raw(node.url, additional_headers=headers) as ws:
                code, frames = await wait_closed(ws)
            error = frames[0]["error"]
            assert code == 4429 and error["code"] == "quota_exceeded"
            assert "2 connections open" in error["message"] and error["retry_after"] == 1
        await first.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while True:  # the first connection's count goes once its node sees it close
            async with raw(two.url, additional_headers=headers) as ws:
                frame = await recv_json(ws)
            if frame["type"] == "session":
                break
            assert loop.time() < deadline, frame
            await asyncio.sleep(0.05)


async def test_the_admin_endpoints_speak_for_every_node(
    tmp_path: Path, redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """Asked on one node, the tenants' usage and the runtime add up both nodes, and a session
    whose connection is on the other node ends there (its reply cancelled, its connection
    closed); one that no connection holds any more ends too, from the store."""
    path = tmp_path / "s.toml"
    admin = auth(add_key(path, "ops", role="admin").key)
    user = auth(add_key(path, "acme").key)
    one, two = nodes(make_server, 2, redis_server, path, engines=lambda: slow_engine(50))
    elsewhere, _ = await open_session(two.url, "session_id=s1", additional_headers=user)
    idle, _ = await open_session(two.url, "session_id=s2", additional_headers=user)
    await idle.close()
    async with httpx.AsyncClient(base_url=one.http_url, headers=admin) as http:
        tenants = (await http.get("/admin/tenants")).json()["tenants"]
        usage = next(t for t in tenants if t["name"] == "acme")["usage"]
        assert usage["sessions"] == 2

        deadline = asyncio.get_running_loop().time() + 5
        while (runtime := (await http.get("/admin/runtime")).json())["connections"] != 1:
            assert asyncio.get_running_loop().time() < deadline, runtime  # the idle one closes
            await asyncio.sleep(0.05)
        assert {p["node"] for p in runtime["processes"]} == {"node1", "node2"}
        tenants = (await http.get("/admin/tenants")).json()["tenants"]
        assert next(t for t in tenants if t["name"] == "acme")["usage"]["connections"] == 1

        await elsewhere.send(json.dumps({"prompt": "long", "max_tokens": 200}))
        assert (await recv_json(elsewhere))["type"] == "start"
        ended = await http.delete("/admin/sessions/acme/s1")
        assert ended.status_code == 200 and ended.json()["connections"] == 1
        code, frames = await wait_closed(elsewhere)
        assert code == 1000
        assert [f for f in frames if isinstance(f, dict)][-1]["finish_reason"] == "cancelled"
        ended = await http.delete("/admin/sessions/acme/s2")
        assert ended.status_code == 200 and ended.json()["connections"] == 0
        for session in ("s1", "s2"):
            assert (await http.delete(f"/admin/sessions/acme/{session}")).status_code == 404
        tenants = (await http.get("/admin/tenants")).json()["tenants"]
        assert next(t for t in tenants if t["name"] == "acme")["usage"]["sessions"] == 0


async def test_one_generation_per_session_across_nodes(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    first, second = nodes(
        make_server, 2, redis_server, engines=lambda: slow_engine(tokens_per_s=100)
    )
    a, _ = await open_session(first.url, "session_id=shared")
    b, _ = await open_session(second.url, "session_id=shared")
    async with a, b:
        await a.send(json.dumps({"prompt": "long", "max_tokens": 40}))
        assert (await recv_json(a))["type"] == "start"
        busy = await generate(b, prompt="x", max_tokens=2)
        error = busy[-1]["error"]
        assert error["code"] == "session_busy" and error["retryable"], error
        assert "another node" in error["message"]
        assert (await collect(a))[-1]["finish_reason"] == "length"
        # The lock went with the done frame: the other node runs the session now.
        assert (await generate(b, prompt="x", max_tokens=2))[-1]["type"] == "done"
        assert (await generate(a, prompt="x", max_tokens=2))[-1]["type"] == "done"


@one_process_only("reads the node's state in its process")
async def test_redis_down_refuses_at_once_and_healthz_says_why(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    (node,) = nodes(make_server, 1, redis_server)
    async with httpx.AsyncClient(base_url=node.http_url, timeout=10) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        redis_server.stop(kill=True)
        await eventually(
            lambda: node.state.cluster is not None and node.state.cluster.link.error is not None,
            5,
            "the node to see Redis gone",
        )
        health = await client.get("/healthz")
        assert health.status_code == 503 and "Redis at redis://127.0.0.1" in health.text
        started = time.monotonic()
        async with raw(node.url) as ws:  # sessions live in Redis: refused at the door
            code, frames = await wait_closed(ws)
        assert time.monotonic() - started < 0.5
        assert code == 1013, code
        error = frames[0]["error"]
        assert error["code"] == "overloaded" and error["retryable"], error
        assert "does not answer" in error["message"]
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503 and "retry" in reply.text

        redis_server.start()  # back: the node sees it within a ping
        await eventually(
            lambda: node.state.cluster is not None and node.state.cluster.link.error is None,
            5,
            "the node to see Redis back",
        )
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_any_node_serves_any_session(
    tmp_path: Path, redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """A conversation goes on from node to node, always from its latest turn; a tenant's live
    sessions are counted across the cluster."""
    path = tmp_path / "s.toml"
    path.write_text("[tenants.acme.quotas]\nsessions = 2\n")
    key = add_key(path, "acme").key
    first, second, third = nodes(make_server, 3, redis_server, path)
    headers = {"additional_headers": auth(key)}
    a, hello = await open_session(first.url, "session_id=talk", **headers)
    assert hello["created"]
    async with a:
        one = (await generate(a, prompt="the first turn", max_tokens=3))[-1]["usage"]
        b, hello = await open_session(second.url, "session_id=talk", **headers)
        assert not hello["created"] and hello["context_turns"] == 2
        async with b:
            two = (await generate(b, prompt="the second turn", max_tokens=3))[-1]["usage"]
            assert two["prompt_tokens"] > one["prompt_tokens"] + one["completion_tokens"]
        # Back on the first node, whose copy is one exchange behind: it continues the latest.
        three = (await generate(a, prompt="the third", max_tokens=3))[-1]["usage"]
        assert three["prompt_tokens"] > two["prompt_tokens"] + two["completion_tokens"]

        # Two live sessions (talk, other) across the nodes: a third is refused on any node.
        other, _ = await open_session(third.url, "session_id=other", **headers)
        await other.close()
        async with raw(second.url, "session_id=third", **headers) as refused:
            error = await recv_json(refused)
        assert error["error"]["code"] == "quota_exceeded"
        assert "2 live sessions" in error["error"]["message"]

        await a.send(json.dumps({"type": "end_session"}))
        code, _ = await wait_closed(a)  # the server closes once the session is deleted
        assert code == 1000
    again, hello = await open_session(third.url, "session_id=talk", **headers)
    await again.close()
    assert hello["created"] and hello["context_turns"] == 0  # ended on every node


async def test_a_long_conversation_saves_only_what_changed(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """A session outgrows the model's window: Redis and every node's copy drop the same oldest
    turns; what an exchange sends Redis does not grow with the conversation (the turns it
    added, and a takeover header that names the saved ones); a reset starts afresh."""
    import redis as redis_py

    first, second = nodes(
        make_server, 2, redis_server, engines=lambda: SyntheticEngine(context_length=400)
    )
    client = redis_py.Redis.from_url(redis_server.url)
    key = "sd:{s:default:long}:turns"
    turn = {"prompt": "a question of about ten words on the cluster and its sessions"}
    sent: list[int] = []
    try:
        ws, _ = await open_session(first.url, "session_id=long")
        async with ws:
            for _ in range(20):
                before = client.info("stats")["total_net_input_bytes"]
                assert (await generate(ws, **turn, max_tokens=8))[-1]["type"] == "done"
                sent.append(client.info("stats")["total_net_input_bytes"] - before)
        assert max(sent[1:]) < 1.3 * min(sent[1:]), sent
        kept = client.lrange(key, 0, -1)
        assert 2 < len(kept) < 40  # the oldest went

        ws, hello = await open_session(second.url, "session_id=long")
        async with ws:
            assert hello["context_turns"] == len(kept)
            frames = await generate(ws, prompt="from scratch", max_tokens=3, reset=True)
            assert frames[-1]["type"] == "done"
        assert len(client.lrange(key, 0, -1)) == 2
        ws, hello = await open_session(first.url, "session_id=long")
        async with ws:
            assert (await generate(ws, **turn, max_tokens=3))[-1]["usage"]["prompt_tokens"] < 60
        assert len(client.lrange(key, 0, -1)) == 4  # the first node's copy followed the reset
    finally:
        client.close()


async def test_a_stateless_call_stays_on_its_node(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """A reply that no other node can be asked for (not resumable, no session, no quota to
    count) costs no Redis command; a resumable one is logged there."""
    import redis as redis_py

    (node,) = nodes(make_server, 1, redis_server)
    client = redis_py.Redis.from_url(redis_server.url)

    def written() -> int:
        stats = client.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("xadd", "evalsha"))

    try:
        async with httpx.AsyncClient(base_url=node.http_url, timeout=10) as http:
            before = written()
            for _ in range(3):
                reply = await http.post("/v1/chat/completions", json=CHAT)
                assert reply.status_code == 200
            assert written() == before
            resumable = {**CHAT, "seedance": {"resumable": True}}
            assert (await http.post("/v1/chat/completions", json=resumable)).status_code == 200
            assert written() > before
    finally:
        client.close()


async def test_a_reply_is_logged_whole_and_every_key_expires(
    tmp_path: Path, redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """What a resumable reply leaves in Redis: its stream log holds every token once, in
    order (the entries sent between the first and the end carry tokens only), and every key
    that a request, a session and its quotas wrote has a TTL: nothing stays for ever."""
    import redis as redis_py

    path = tmp_path / "s.toml"
    path.write_text(
        "[tenants.acme.quotas]\nrequests_per_minute = 100\ntokens_per_minute = 10000\n"
        "generations = 4\nsessions = 4\n"
    )
    key = add_key(path, "acme").key
    (node,) = nodes(make_server, 1, redis_server, path, lambda: slow_engine(tokens_per_s=400))
    ws, _ = await open_session(node.url, "session_id=kept", additional_headers=auth(key))
    async with ws:
        request = {"prompt": PROMPT, "max_tokens": 80, "resumable": True, "request_id": "r"}
        frames = await generate(ws, **request)
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 80

    client = redis_py.Redis.from_url(redis_server.url)
    try:
        (log,) = [k for k in client.scan_iter("sd:*") if k.endswith(b":log:r")]
        entries = client.xrange(log)
        kinds = [int(entry_id.split(b"-")[1]) for entry_id, _ in entries]
        assert kinds[0] == 1 and kinds[-1] == 3 and set(kinds[1:-1]) == {2}
        assert len(entries) > 4  # the tokens went in several exchanges
        seqs = [int(entry_id.split(b"-")[0]) for entry_id, _ in entries[1:]]
        counts = [int(fields[b"n"]) for _, fields in entries[1:-1]]
        assert seqs == [sum(counts[:i]) for i in range(len(seqs))] and sum(counts) == 80
        text = "".join(fields[b"t"].decode() for _, fields in entries[1:-1])
        assert text == tokens_text(frames)
        # Everything expires (revoked keys, none here, are the one set kept for ever).
        forever = [k for k in client.scan_iter("sd:*") if client.pttl(k) < 0]
        assert forever == [], forever
    finally:
        client.close()


async def test_a_resume_on_another_node_carries_log_probabilities_and_token_ids(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """The tokens' log probabilities and ids travel through Redis with their text: a reader
    that resumes on another node gets them for every token, as from the node that runs it."""
    one, two = nodes(make_server, 2, redis_server, engine="llamacpp", n_ctx=1024)
    request = {
        "prompt": TENSOR_PROMPT, "max_tokens": 48, "temperature": 0, "request_id": "t1",
        "resumable": True, "tensors": ["token_ids"], "logprobs": 2,
    }  # fmt: skip
    seen = await begin_and_drop(one.url, "typed", request)  # it runs on, on node one
    first_ids = check_pairs(seen)
    async with (await open_session(two.url, "session_id=typed"))[0] as again:
        after = len(first_ids) - 1
        await again.send(json.dumps({"type": "resume", "request_id": "t1", "after_seq": after}))
        rest = await read_frames(again)
    ids = first_ids + check_pairs(rest, first_seq=after + 1)
    tokens = [f for f in [*seen, *rest] if isinstance(f, dict) and f["type"] == "token"]
    assert rest[-1]["type"] == "done" and len(ids) == 48
    assert detokenize(two, ids) == "".join(f["token"] for f in tokens)
    for frame in tokens:
        logprobs = frame["logprobs"]
        assert len(logprobs) == frame.get("n", 1)
        assert all(len(entry["top_logprobs"]) == 2 for entry in logprobs)
    assert "".join(e["token"] for f in tokens for e in f["logprobs"]) == "".join(
        f["token"] for f in tokens
    )


async def test_a_key_revoked_on_one_node_is_refused_on_every_node_within_a_second(
    tmp_path: Path, redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """Each node has its own copy of the tenants file (as on separate machines): the
    revocation reaches the others through Redis, and a node started later refuses it too."""
    first_file, second_file, later_file = (tmp_path / f"{n}.toml" for n in ("a", "b", "c"))
    admin = add_key(first_file, "ops", role="admin").key
    user = add_key(first_file, "acme")
    second_file.write_text(first_file.read_text())
    later_file.write_text(first_file.read_text())
    (first,) = nodes(make_server, 1, redis_server, first_file)
    (second,) = nodes(make_server, 1, redis_server, second_file)
    ws, _ = await open_session(second.url, additional_headers=auth(user.key))
    async with httpx.AsyncClient(base_url=first.http_url) as client:
        revoked = await client.post(f"/admin/keys/{user.id}/revoke", headers=auth(admin))
        assert revoked.status_code == 200
    started = time.monotonic()
    code, frames = await wait_closed(ws, timeout=5)
    assert code == 4401 and time.monotonic() - started < 1.0
    assert "revoked" in frames[0]["error"]["message"]
    assert "revoked = true" not in second_file.read_text()  # only the first node's file
    (later,) = nodes(make_server, 1, redis_server, later_file)
    for node in (second, later):
        async with raw(node.url, additional_headers=auth(user.key)) as refused:
            code, frames = await wait_closed(refused)
        assert code == 4401, (node.url, frames)


# --------------------------------------------------------------------------- stream logs


async def test_a_stream_resumes_on_another_node(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """The client drops mid-reply and comes back through another node: it gets every token
    after its cursor once, live, then the done; later, the whole reply again from a third."""
    first, second, third = nodes(
        make_server, 3, redis_server, engines=lambda: slow_engine(tokens_per_s=200)
    )
    expected = await undisturbed(first, max_tokens=120)
    ws, hello = await open_session(first.url, "session_id=trip")
    request = {"prompt": PROMPT, "seed": 7, "max_tokens": 120, "resumable": True}
    await ws.send(json.dumps({**request, "request_id": "r1"}))
    reading = Reading("r1")
    await read(ws, reading, until_seq=30)
    ws.transport.abort()
    ws, hello = await resume(second, "trip", reading)
    assert hello["active"]["request_id"] == "r1" and hello["active"]["state"] == "running"
    async with ws:
        await read(ws, reading)
    assert reading.end is not None and reading.end["type"] == "done", reading.end
    assert reading.end["usage"]["completion_tokens"] == 120 and reading.last_seq == 119
    assert reading.text == expected and reading.starts == 2

    again = await read_whole(third, "trip")
    assert again.text == expected and again.end == reading.end


async def test_entries_whose_replies_were_lost_go_again_as_they_were(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """Redis carries out a reply's exchanges but its answers are lost for a while (a proxy
    swallows them): the node sends the same entries again, with the same ids and bounds, and
    Redis keeps every token once: the reply, and a resume of it from the start on another
    node, read the undisturbed text. (Sent again cut anew, an entry whose id Redis had
    already taken was skipped, and the tokens it carried beyond the first cut were lost.)"""
    async with FaultProxy(f"127.0.0.1:{redis_server.port}") as proxy:
        engine = lambda: slow_engine(tokens_per_s=200)  # noqa: E731
        first = make_server(
            [engine()], redis_url=f"redis://127.0.0.1:{proxy.port}/0", node_id="deaf"
        )
        (second,) = nodes(make_server, 1, redis_server, engines=engine)
        expected = await undisturbed(second, max_tokens=400)
        ws, reading = await begin(first.url, "lost-replies", 400, until_seq=30)
        proxy.deaf = True
        await asyncio.sleep(1.5)  # past the exchange's timeout: sent again, and again
        proxy.deaf = False
        async with ws:
            await read(ws, reading)
        assert reading.end is not None and reading.end["type"] == "done", reading.end
        assert reading.text == expected and reading.last_seq == 399
        again = await read_whole(second, "lost-replies")
        assert again.text == expected and again.end == reading.end


@pytest.mark.parametrize("aof", [True, False], ids=["aof-always", "no-persistence"])
@one_process_only("reads the node's state in its process")
async def test_a_redis_restart_keeps_the_logs_or_says_they_are_lost(
    tmp_path: Path, make_server: Callable[..., RunningServer], aof: bool
) -> None:
    """With AOF ``always`` an acknowledged log survives Redis restarting; without persistence
    a resume is told ``history_lost`` ``epoch_changed``, never given a gap."""
    redis = RedisServer(tmp_path, aof=aof).start()
    try:
        first, second = nodes(make_server, 2, redis)
        ws, hello = await open_session(first.url, "session_id=kept")
        async with ws:
            frames = await generate(ws, prompt=PROMPT, max_tokens=40, resumable=True)
        assert frames[-1]["type"] == "done"
        redis.restart()
        await redis_answers(first, second)
        reading = Reading(frames[0]["request_id"])
        ws, _ = await resume(second, "kept", reading, epoch=hello["epoch"])
        async with ws:
            if aof:
                await read(ws, reading)
                assert reading.text == tokens_text(frames) and reading.end == frames[-1]
            else:
                error = (await recv_json(ws))["error"]
                assert error["code"] == "history_lost" and error["reason"] == "epoch_changed"
    finally:
        redis.stop(kill=True)


# --------------------------------------------------------------------------- takeover


async def begin_reply(
    redis_server: RedisServer,
    server_process: Callable[..., ServerProcess],
    session: str,
    *,
    max_tokens: int,
    until_seq: int,
    extra: tuple[str, ...] = (),
    traceparent: str | None = None,
) -> tuple[ServerProcess, ServerProcess, str, Any, Reading]:
    """Two nodes (``--lease 1``, and ``extra`` flags): the owner and the survivor; the
    undisturbed text of the reply; and the reply ``r1`` begun resumable on the owner, read up
    to ``until_seq``."""
    args = ("--redis", redis_server.url, "--lease", "1", "--synthetic-tokens-per-s", "300", *extra)
    owner = server_process(*args, "--node-id", "n1")
    survivor = server_process(*args, "--node-id", "n2")
    expected = await undisturbed(survivor, max_tokens=max_tokens)  # type: ignore[arg-type]
    ws, _ = await open_session(owner.url, f"session_id={session}")
    request = {"prompt": PROMPT, "seed": 7, "max_tokens": max_tokens, "resumable": True}
    if traceparent is not None:
        request["traceparent"] = traceparent
    await ws.send(json.dumps({**request, "request_id": "r1", "qos": "high; slatag=moved"}))
    reading = Reading("r1")
    await read(ws, reading, until_seq=until_seq)
    return owner, survivor, expected, ws, reading


@pytest.mark.subprocess
async def test_a_dead_nodes_stream_is_taken_over_where_it_stopped(
    redis_server: RedisServer, server_process: Callable[..., ServerProcess]
) -> None:
    """kill -9 of the node running a reply: the client resumes on another node, which takes
    the generation over after the lease and goes on at the next seq; every seq once, and
    (the synthetic model being deterministic) the very text of an undisturbed run; and the
    survivor's span is in the client's trace (a real OTLP receiver gets it)."""
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with http_receiver() as (otlp, received):
        owner, survivor, expected, ws, reading = await begin_reply(
            redis_server,
            server_process,
            "doomed",
            max_tokens=400,
            until_seq=100,
            extra=("--otlp-endpoint", otlp),
            traceparent=f"00-{trace}-00f067aa0ba902b7-01",
        )
        await took_over(owner, survivor, ws, reading, expected)
        survivor.signal(signal.SIGTERM)  # its spans are exported as it stops
        await asyncio.to_thread(survivor.wait)
        spans = received.wait_for(lambda found: any(s.trace_id == trace for s in found))
    (taken,) = [s for s in spans if s.name == "chat synthetic" and s.trace_id == trace]
    # A child of the dead node's request span (which never ended, so never came).
    assert taken.parent_span_id not in ("", "00f067aa0ba902b7")
    assert taken.attributes["seedance.request_id"] == "r1"


@pytest.mark.subprocess
async def test_a_taken_over_reply_continues_its_conversation(
    redis_server: RedisServer, server_process: Callable[..., ServerProcess]
) -> None:
    """A reply that continues a conversation (earlier turns in the session, a system one among
    them), its node killed: the survivor rebuilds its prompt from the session's saved turns
    (the takeover header names them instead of carrying them), so the reply goes on as in an
    undisturbed conversation; and the conversation continues on the survivor from it."""
    earlier = [
        {"messages": [{"role": "system", "content": "Answer briefly."}], "max_tokens": 4},
        {"prompt": "the first question of a long talk", "max_tokens": 6, "seed": 3},
        {"prompt": "and a second one, about the weather", "max_tokens": 5, "seed": 4},
    ]
    args = ("--redis", redis_server.url, "--lease", "1", "--synthetic-tokens-per-s", "300")
    owner = server_process(*args, "--node-id", "n1")
    survivor = server_process(*args, "--node-id", "n2")
    request = {"prompt": PROMPT, "seed": 7, "max_tokens": 400}

    async def talk(url: str, session: str) -> Any:
        ws, _ = await open_session(url, f"session_id={session}")
        for turn in earlier:
            assert (await generate(ws, **turn))[-1]["type"] == "done"
        return ws

    calm = await talk(survivor.url, "calm")
    async with calm:
        frames = await generate(calm, **request)
    assert frames[-1]["type"] == "done"
    expected = tokens_text(frames)

    ws = await talk(owner.url, "doomed")
    await ws.send(json.dumps({**request, "resumable": True, "request_id": "r1"}))
    reading = Reading("r1")
    await read(ws, reading, until_seq=100)
    await took_over(owner, survivor, ws, reading, expected, qos=False)
    ws, hello = await open_session(survivor.url, "session_id=doomed")
    async with ws:
        assert hello["context_turns"] == 2 * len(earlier) + 2  # every turn, the reply's too
        assert (await generate(ws, prompt="and then?", max_tokens=3))[-1]["type"] == "done"


async def took_over(
    owner: ServerProcess,
    survivor: ServerProcess,
    ws: Any,
    reading: Reading,
    expected: str,
    *,
    qos: bool = True,
) -> None:
    owner.signal(signal.SIGKILL)
    with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
        await read(ws, reading)  # what was on its way before the socket went
    assert reading.end is None
    killed_at = time.monotonic()
    ws, _ = await resume(survivor, "doomed", reading)  # type: ignore[arg-type]
    async with ws:
        await read(ws, reading, until_seq=reading.last_seq + 1)
        resumed_s = time.monotonic() - killed_at
        await read(ws, reading)
    assert reading.end is not None and reading.end["type"] == "done", reading.end
    assert reading.last_seq == 399 and reading.text == expected
    assert resumed_s < 1.0 + 1.0 + 1.0, resumed_s  # the lease, a follower's wait, slack
    await survivor.logged("request r1 taken over at seq")
    if not qos:
        return
    # The generation kept its quality of service on the survivor (its SLA tag's metrics).
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(survivor.url.replace("ws:", "http:") + "/metrics")).text
    assert (
        'seedance_slo_requests_total{outcome="length",qos_class="high",slatag="moved"} 1.0'
        in metrics
    )


@pytest.mark.subprocess
async def test_a_frozen_node_cannot_write_after_the_takeover(
    redis_server: RedisServer, server_process: Callable[..., ServerProcess]
) -> None:
    """SIGSTOP of the node running a reply, past its lease: another node takes the reply
    over; SIGCONT: the frozen node's next write is refused (fencing), its generation stops,
    and the log holds exactly one reply."""
    owner, survivor, expected, ws, reading = await begin_reply(
        redis_server, server_process, "frozen", max_tokens=600, until_seq=50
    )
    owner.signal(signal.SIGSTOP)
    try:
        await taken_over_then_fenced(owner, survivor, "frozen", reading)
        await ws.close()
    finally:
        owner.signal(signal.SIGCONT)
    whole = Reading("r1")
    await eventually_done(survivor, "frozen", whole)
    assert whole.text == expected and whole.last_seq == 599
    assert whole.end is not None and whole.end["usage"]["completion_tokens"] == 600


async def taken_over_then_fenced(
    owner: ServerProcess, survivor: ServerProcess, session: str, reading: Reading
) -> None:
    """The frozen ``owner``'s reply, resumed on ``survivor``, goes on there past a takeover;
    SIGCONT: the owner stops its generation (its next write is refused, or, when an exchange
    that was in flight across the freeze times out first, it gives the reply up as cut off
    from Redis past its lease: either way it writes nothing more); the reply is read to its
    end."""
    resumed, _ = await resume(survivor, session, reading)  # type: ignore[arg-type]
    async with resumed:
        await read(resumed, reading, until_seq=reading.last_seq + 20)
        await survivor.logged("request r1 taken over at seq")
        owner.signal(signal.SIGCONT)
        await owner.logged("; the generation stops here")
        await read(resumed, reading)


async def eventually_done(node: Any, session: str, reading: Reading) -> None:
    """Read the whole reply ``reading`` names from ``node`` once it has ended."""
    for _ in range(50):
        ws, _ = await resume(node, session, reading)
        async with ws:
            await read(ws, reading)
        if reading.end is not None and reading.end["type"] == "done":
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"no done for {reading.request_id}")


def owner_of(running: dict[int, ServerProcess], session: str) -> int:
    """The port of the node a session's connection went to (its log says so)."""
    return next(port for port, node in running.items() if f"session={session} " in node.output)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(300)  # 20 kills and takeovers: about 50 s on 2 cores
async def test_20_kills_of_the_owner_through_haproxy_lose_no_token(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Three nodes behind HAProxy; 20 times, the node that runs a 2,000-token resumable reply
    is killed (-9) at a random token. The SDK reconnects through HAProxy on its own and
    resumes; another node takes the reply over: every seq once, in order, and the text of the
    undisturbed run (the synthetic model continues as it would have)."""
    ports = [free_port() for _ in range(3)]
    args = ("--redis", redis_server.url, "--lease", "1", "--synthetic-tokens-per-s", "4000")

    def start(port: int) -> ServerProcess:
        return ServerProcess(*args, "--port", str(port), "--node-id", f"n{port}")

    running = {port: start(port) for port in ports}
    rng = random.Random(19)
    try:
        with haproxy(ports) as url:
            async with connect(url, session_id="reference") as session:
                expected = (await session.complete(PROMPT, max_tokens=2000, seed=5)).text
            for run in range(20):
                name = f"run{run}"
                kill_at = rng.randrange(10, 1990)
                seqs: list[int] = []
                reconnect = Reconnect(attempts=20, first_delay_s=0.05, max_delay_s=0.5)
                async with connect(url, session_id=name, reconnect=reconnect) as session:
                    stream = session.generate(PROMPT, max_tokens=2000, seed=5, resumable=True)
                    killed = None
                    async for chunk in stream:
                        seqs.extend(range(chunk.seq, chunk.seq + chunk.n))
                        if killed is None and len(seqs) >= kill_at:
                            killed = owner_of(running, name)
                            running[killed].signal(signal.SIGKILL)
                            running[killed].wait()
                    assert stream.done is not None and stream.done.finish_reason == "length"
                assert seqs == list(range(2000)), (run, kill_at)
                assert stream.text == expected, (run, kill_at)
                assert killed is not None
                running[killed] = start(killed)  # a fresh node where the dead one was
    finally:
        for node in running.values():
            node.stop()


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("drain_s", [30, 0.5], ids=["finished-there", "handed-over"])
async def test_a_stopping_node_moves_its_clients_and_loses_nothing(
    redis_server: RedisServer, drain_s: float
) -> None:
    """SIGTERM of the node running a resumable reply, behind HAProxy: its client is moved
    (1001) and resumes on the other node, which follows the reply from Redis while the
    stopping node finishes it, or, past a short drain timeout, takes it over."""
    ports = [free_port() for _ in range(2)]
    args = ("--redis", redis_server.url, "--lease", "1", "--synthetic-tokens-per-s", "800")
    args += ("--drain-timeout", str(drain_s))
    running = {p: ServerProcess(*args, "--port", str(p), "--node-id", f"n{p}") for p in ports}
    try:
        with haproxy(ports) as url:
            async with connect(url, session_id="reference") as session:
                expected = (await session.complete(PROMPT, max_tokens=2000, seed=5)).text
            seqs: list[int] = []
            async with connect(url, session_id="moving") as session:
                stream = session.generate(PROMPT, max_tokens=2000, seed=5, resumable=True)
                stopped = None
                async for chunk in stream:
                    seqs.extend(range(chunk.seq, chunk.seq + chunk.n))
                    if stopped is None and len(seqs) >= 200:
                        stopped = owner_of(running, "moving")
                        running[stopped].signal(signal.SIGTERM)
                assert stream.done is not None and stream.done.finish_reason == "length"
                assert session.reconnects >= 1
            assert seqs == list(range(2000)) and stream.text == expected
            assert stopped is not None and running[stopped].wait(30) in (0, -15, 143)
            survivor = next(node for port, node in running.items() if port != stopped)
            if drain_s < 1:
                await survivor.logged("taken over at seq")
            else:
                assert "outcome=length" in running[stopped].output
                assert "taken over" not in survivor.output
    finally:
        for node in running.values():
            node.stop()


def seedance_cluster(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``seedance cluster ARGS`` with the synthetic engine; its output lines as they come."""
    proc = subprocess.Popen(
        [SEEDANCE, "cluster", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SEEDANCE_ENGINE": "synthetic"},
    )
    lines: list[str] = []
    stdout = proc.stdout
    assert stdout is not None
    threading.Thread(target=lambda: lines.extend(iter(stdout.readline, "")), daemon=True).start()
    return proc, lines


@pytest.mark.subprocess
@pytest.mark.parametrize("sentinels", [False, True], ids=["redis-server", "sentinels"])
async def test_seedance_cluster_starts_redis_nodes_and_haproxy_and_stops_them(
    sentinels: bool,
) -> None:
    """With ``--sentinels``, the session also outlives its Redis primary's shutdown: the
    sentinels promote the replica and the nodes follow."""
    tool("redis-server", "redis-server")
    tool("haproxy", "haproxy")
    if sentinels:
        tool("redis-sentinel", "redis-sentinel")
    port = free_port()
    ha = ("--sentinels",) if sentinels else ()
    proc, lines = seedance_cluster("--nodes", "2", "--port", str(port), *ha, "--", "--lease", "1")
    try:
        await eventually(lambda: any("seedance cluster:" in line for line in lines), 60, "the URL")
        url = f"ws://127.0.0.1:{port}"
        banner = next(line for line in lines if "seedance cluster:" in line)
        assert f"{url}/v2/infer" in banner and "2 node(s)" in banner, banner
        async with connect(url, session_id="tried") as session:
            assert (await session.complete("hello", max_tokens=5)).finish_reason == "length"
        if sentinels:
            match = re.search(r"sentinel://127\.0\.0\.1:(\d+)", banner)
            assert match is not None, banner
            asked = aioredis.Redis(port=int(match.group(1)))
            _, primary = await asked.sentinel_get_master_addr_by_name("seedance")
            with contextlib.suppress(RedisConnectionError, OSError):
                await aioredis.Redis(port=int(primary)).shutdown(nosave=True)
            await asked.aclose()
        async with connect(url, session_id="tried") as session:
            # The session is the cluster's (the nodes' output says why when it is not).
            assert session.info.context_turns == 2, "".join(lines)
            assert (await session.complete("again", max_tokens=5)).finish_reason == "length"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    assert sum("on Redis at" in line and "cluster: node" in line for line in lines) == 2
    if sentinels:
        assert sum("answers again (another server: a failover)" in line for line in lines) == 2


async def test_an_sse_reply_resumes_on_another_node(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """The OpenAI API's resume (``Last-Event-ID``) carries no session for the balancer to hash:
    in a cluster, any node serves it."""
    first, second = nodes(make_server, 2, redis_server, engines=lambda: slow_engine(1000))
    async with (
        httpx.AsyncClient(base_url=first.http_url, timeout=30) as one,
        httpx.AsyncClient(base_url=second.http_url, timeout=30) as other,
    ):
        whole = await one.post("/v1/chat/completions", json={**BODY, "stream": False})
        expected = whole.json()["choices"][0]["message"]["content"]
        text, last_id, request_id = await dropped_at(one, 50)
        headers = {"Last-Event-ID": last_id}
        async with other.stream("GET", f"/v1/streams/{request_id}", headers=headers) as response:
            assert response.status_code == 200
            events = [(i, d) async for i, d in sse(response)]
    assert events[-1][1] == "[DONE]"
    text += "".join(content(d) for _, d in events)
    assert text == expected


async def test_the_cluster_bench_times_a_resume_on_another_node(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """Suite 10's resume trial, as make bench runs it (the owner alive)."""
    from benchmarks.cluster_suite import drop_and_resume

    first, second = nodes(make_server, 2, redis_server, engines=lambda: slow_engine(200))
    elapsed_ms = await drop_and_resume(first.infer_url, second.infer_url, "bench")
    assert 0 < elapsed_ms < 1000


async def test_responses_continue_and_resume_on_another_node(
    redis_server: RedisServer, make_server: Callable[..., RunningServer]
) -> None:
    """The Responses API in a cluster: ``previous_response_id`` reads the conversation from
    Redis on any node, and a background response's events resume there by sequence number."""
    import openai

    first, second = nodes(make_server, 2, redis_server, engines=lambda: slow_engine(200))
    one = openai.AsyncOpenAI(base_url=f"{first.http_url}/v1", api_key="x", max_retries=0)
    other = openai.AsyncOpenAI(base_url=f"{second.http_url}/v1", api_key="x", max_retries=0)
    opening = await one.responses.create(model="synthetic", input="hello", max_output_tokens=8)
    follow = await other.responses.create(
        model="synthetic", input="and then", previous_response_id=opening.id, max_output_tokens=8
    )
    assert follow.usage is not None and opening.usage is not None
    assert follow.usage.input_tokens > opening.usage.total_tokens  # the conversation came along
    stream = await one.responses.create(
        model="synthetic", input="a story", max_output_tokens=100, background=True, stream=True
    )
    seen = []
    async for event in stream:
        seen.append(event)
        if event.sequence_number >= 20:
            break
    await stream.close()
    rest = await other.responses.retrieve(
        seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number
    )
    seen += [event async for event in rest]
    numbers = [event.sequence_number for event in seen]
    assert numbers == sorted(set(numbers)) and seen[-1].type == "response.incomplete"
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == seen[-1].response.output_text and seen[-1].response.usage.output_tokens == 100
    # Deleted on one node, it is gone from every node.
    assert (await one.responses.delete(opening.id)) is None
    with pytest.raises(openai.NotFoundError, match=f"no response {opening.id}"):
        await other.responses.retrieve(opening.id)
    await one.close()
    await other.close()
