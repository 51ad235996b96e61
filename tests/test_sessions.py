"""Server-side sessions: context across connections, reset, end, TTL, the session cap."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from seedance.config_loader import load_access
from seedance.tenants.keys import add_key
from tests.support.servers import RunningServer, one_process_only
from tests.support.waits import eventually
from tests.support.ws import generate, open_session, raw_connect, wait_closed


async def one_turn(
    server: RunningServer, session_id: str, prompt: str, **fields: object
) -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    ws, hello = await open_session(server.url, f"session_id={session_id}")
    async with ws:
        frames = await generate(ws, prompt=prompt, max_tokens=8, **fields)
    return hello, frames


async def test_server_assigns_a_session_id(server: RunningServer) -> None:
    ws, hello = await open_session(server.url)
    async with ws:
        assert hello["created"] is True
        assert re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", hello["session_id"])


@one_process_only("reads the server's sessions in its process")
async def test_context_survives_a_new_connection(server: RunningServer) -> None:
    hello1, first = await one_turn(server, "conv", "hello there")
    hello2, second = await one_turn(server, "conv", "hello there")
    assert hello1["created"] is True and hello1["context_turns"] == 0
    assert hello2["created"] is False and hello2["context_turns"] == 2
    assert second[0]["prompt_tokens"] > first[0]["prompt_tokens"]
    _, third = await one_turn(server, "conv", "hello there")
    assert third[0]["prompt_tokens"] > second[0]["prompt_tokens"]
    session = server.state.sessions.get("default", "conv")
    assert session is not None
    assert [t.message.role for t in session.turns] == ["user", "assistant"] * 3
    assert session.turns[1].message.content == "".join(
        f["token"] for f in first if f["type"] == "token"
    )


async def test_reset_clears_the_context(server: RunningServer) -> None:
    _, fresh = await one_turn(server, "r", "question")
    await one_turn(server, "r", "more")
    hello, reset = await one_turn(server, "r", "question", reset=True)
    assert hello["context_turns"] == 4
    assert reset[0]["prompt_tokens"] == fresh[0]["prompt_tokens"]
    hello, _ = await one_turn(server, "r", "next")
    assert hello["context_turns"] == 2


async def test_messages_append_several_turns(server: RunningServer) -> None:
    ws, _ = await open_session(server.url, "session_id=m")
    async with ws:
        await generate(
            ws,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=4,
        )
    hello, _ = await one_turn(server, "m", "and then")
    assert hello["context_turns"] == 3


@one_process_only("reads the server's sessions in its process")
async def test_end_session_deletes_it_and_closes_1000(server: RunningServer) -> None:
    await one_turn(server, "ending", "remember this")
    ws, hello = await open_session(server.url, "session_id=ending")
    async with ws:
        assert hello["context_turns"] == 2
        await ws.send(json.dumps({"type": "end_session"}))
        code, _ = await wait_closed(ws)
    assert code == 1000
    assert server.state.sessions.get("default", "ending") is None
    hello, _ = await one_turn(server, "ending", "anyone?")
    assert hello["created"] is True and hello["context_turns"] == 0


@pytest.mark.slow
@one_process_only("reads the server's sessions in its process")
async def test_expired_session_starts_empty(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(session_ttl_s=0.3)
    await one_turn(server, "short", "remember")
    hello, _ = await one_turn(server, "short", "still there?")
    assert hello["created"] is False
    # the reaper removes it
    await eventually(lambda: server.state.sessions.get("default", "short") is None)
    hello, _ = await one_turn(server, "short", "and now?")
    assert hello["created"] is True and hello["context_turns"] == 0


@pytest.mark.slow
async def test_attached_session_does_not_expire(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(session_ttl_s=0.2)
    ws, _ = await open_session(server.url, "session_id=held")
    async with ws:
        first = await generate(ws, prompt="one", max_tokens=4)
        await asyncio.sleep(0.6)
        second = await generate(ws, prompt="one", max_tokens=4)
    assert second[0]["prompt_tokens"] > first[0]["prompt_tokens"]


@one_process_only("reads the server's sessions in its process")
async def test_session_cap_evicts_the_least_recently_used(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(max_sessions=2)
    await one_turn(server, "a", "x")
    await one_turn(server, "b", "x")
    await one_turn(server, "a", "x")  # a is now the most recent
    await one_turn(server, "c", "x")  # evicts b
    assert len(server.state.sessions) == 2
    hello, _ = await one_turn(server, "a", "x")
    assert hello["created"] is False
    hello, _ = await one_turn(server, "b", "x")
    assert hello["created"] is True


@one_process_only(
    "evicts idle sessions to fit; the cluster's store refuses instead (docs/cluster.md)"
)
async def test_session_cap_full_of_live_sessions_refuses(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(max_sessions=1)
    ws, _ = await open_session(server.url, "session_id=live")
    async with ws:
        async with raw_connect(server.url, "session_id=other") as second:
            code, frames = await wait_closed(second)
        assert code == 1013
        assert frames[0]["error"]["code"] == "overloaded"


@one_process_only(
    "evicts idle sessions to fit; the cluster's store refuses instead (docs/cluster.md)"
)
async def test_session_history_has_a_byte_budget(make_server: Any) -> None:
    # Three 8,000-character turns do not fit 20,000 bytes: the idle session goes first; when
    # every session is in use, the request is refused and the connection stays open.
    server: RunningServer = make_server(max_session_bytes=20_000)
    long = "x" * 8000
    a, hello_a = await open_session(server.url)
    async with a:
        assert (await generate(a, prompt=long, max_tokens=2))[-1]["type"] == "done"
    b, _ = await open_session(server.url)
    c, _ = await open_session(server.url)
    async with b, c:
        assert (await generate(b, prompt=long, max_tokens=2))[-1]["type"] == "done"
        assert (await generate(c, prompt=long, max_tokens=2))[-1]["type"] == "done"
        again, hello = await open_session(server.url, f"session_id={hello_a['session_id']}")
        async with again:
            assert hello["created"] and hello["context_turns"] == 0  # a was evicted
            refused = (await generate(again, prompt=long, max_tokens=2))[-1]
            assert refused["type"] == "error" and refused["error"]["code"] == "overloaded"
            assert "20000 bytes of history" in refused["error"]["message"]
            assert (await generate(again, prompt="short", max_tokens=2))[-1]["type"] == "done"
        # A session can always start afresh: reset frees what it held.
        assert (await generate(c, prompt=long, max_tokens=2, reset=True))[-1]["type"] == "done"
    assert server.state.sessions.bytes <= 20_000 + 2_000  # one reply may pass it for a moment


@one_process_only(
    "evicts idle sessions to fit; the cluster's store refuses instead (docs/cluster.md)"
)
async def test_a_tenants_session_history_has_a_byte_quota(tmp_path: Path, make_server: Any) -> None:
    path = tmp_path / "s.toml"
    path.write_text("[tenants.acme.quotas]\nsession_bytes = 12000\n")
    key = add_key(path, "acme").key
    server: RunningServer = make_server(config_file=str(path), access=load_access(path))
    headers = {"Authorization": f"Bearer {key}"}
    first, _ = await open_session(server.url, additional_headers=headers)
    second, _ = await open_session(server.url, additional_headers=headers)
    async with first, second:
        assert (await generate(first, prompt="x" * 8000, max_tokens=2))[-1]["type"] == "done"
        refused = (await generate(second, prompt="y" * 8000, max_tokens=2))[-1]
        assert refused["error"]["code"] == "quota_exceeded"
        assert "12000 bytes of history" in refused["error"]["message"]
    # first is idle now: its history makes room for second's, on a new connection.
    again, _ = await open_session(server.url, additional_headers=headers)
    async with again:
        assert (await generate(again, prompt="y" * 8000, max_tokens=2))[-1]["type"] == "done"
