"""One request lifecycle for every transport: the same checks in the same order over
/v2/infer and the OpenAI API, and the SSE reply that outlives its connection
(``"seedance": {"resumable": true}``, ``GET /v1/streams/{id}`` with ``Last-Event-ID``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from seedance.engines.synthetic import SyntheticEngine
from tests.support.servers import RunningServer, one_process_only
from tests.support.waits import eventually
from tests.support.ws import collect, open_session

LONG = "word " * 200  # more tokens than a 64-token context holds


async def ws_refusal(server: RunningServer, **fields: Any) -> str:
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps(fields))
        frames = await collect(ws)
    assert frames[-1]["type"] == "error", frames
    code: str = frames[-1]["error"]["code"]
    return code


async def http_refusal(server: RunningServer, **fields: Any) -> tuple[int, str]:
    body = {"model": "synthetic", "messages": [{"role": "user", "content": fields["prompt"]}]}
    body.update({k: v for k, v in fields.items() if k != "prompt"})
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        reply = await http.post("/v1/chat/completions", json=body)
    return reply.status_code, reply.json()["error"]["code"]


@pytest.fixture
def small(make_server: Any) -> RunningServer:
    """A model whose context holds 64 tokens."""
    server: RunningServer = make_server(engines=[SyntheticEngine(context_length=64)])
    return server


async def test_a_prompt_that_leaves_no_room_is_refused_on_both_transports(
    small: RunningServer,
) -> None:
    assert await ws_refusal(small, prompt=LONG, max_tokens=4) == "context_overflow"
    assert await http_refusal(small, prompt=LONG, max_tokens=4) == (400, "context_overflow")
    # a prompt that fits with a reply that runs past the window: ends with length on both
    ws, _ = await open_session(small.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "short", "max_tokens": 60}))
        frames = await collect(ws)
    assert frames[-1]["finish_reason"] == "length"


@one_process_only("reads the server's state in its process")
async def test_draining_is_checked_first_on_both_transports(small: RunningServer) -> None:
    ws, _ = await open_session(small.url)  # open before: a draining server takes no new one
    async with ws:
        small.state.shutdown.draining = (
            True  # the shutdown's first step, without closing the listener
        )
        try:
            # also over the context and above the priority allowed: draining answers first
            await ws.send(json.dumps({"prompt": LONG, "priority": 10}))
            frames = await collect(ws)
            assert frames[-1]["error"]["code"] == "overloaded"
            assert await http_refusal(small, prompt=LONG, priority=10) == (503, "overloaded")
        finally:
            small.state.shutdown.draining = False
    assert await ws_refusal(small, prompt=LONG) == "context_overflow"
    assert await http_refusal(small, prompt=LONG) == (400, "context_overflow")


# --------------------------------------------------------------------------- SSE resume


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(event id, data) of each Server-Sent Event."""
    event_id: str | None = None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            yield event_id, line[6:]
            event_id = None


def content(data: str) -> str:
    if data == "[DONE]":
        return ""
    choices = json.loads(data).get("choices") or [{}]
    delta: str = choices[0].get("delta", {}).get("content") or ""
    return delta


BODY = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "a long story"}],
    "max_tokens": 400,
    "seed": 4,
    "stream": True,
}


async def dropped_at(http: httpx.AsyncClient, seq: int) -> tuple[str, str, str]:
    """A resumable streamed reply whose connection drops once the client holds token
    ``seq``: the text so far, the last event id, and the request id."""
    text, last_id, request_id = "", "", ""
    body = {**BODY, "seedance": {"resumable": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for event_id, data in sse(response):
            request_id = request_id or json.loads(data)["id"]
            text += content(data)
            if event_id is not None:
                last_id = event_id
                if int(event_id.rpartition(":")[2]) >= seq:
                    break  # the connection drops
    return text, last_id, request_id


@pytest.mark.slow
async def test_an_sse_reply_resumes_with_last_event_id(make_server: Any) -> None:
    server: RunningServer = make_server(tokens_per_s=1000.0)
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
        whole = await http.post("/v1/chat/completions", json={**BODY, "stream": False})
        expected = whole.json()["choices"][0]["message"]["content"]
        text, last_id, request_id = await dropped_at(http, 50)
        assert last_id.startswith(f"{request_id}:")
        headers = {"Last-Event-ID": last_id}
        async with http.stream("GET", f"/v1/streams/{request_id}", headers=headers) as response:
            assert response.status_code == 200
            events = [(i, d) async for i, d in sse(response)]
    assert events[-1][1] == "[DONE]"
    seqs = [int(i.rpartition(":")[2]) for i, _ in events if i is not None]
    assert seqs == sorted(seqs) and seqs[0] > int(last_id.rpartition(":")[2])
    text += "".join(content(d) for _, d in events)
    assert text == expected
    finishes = [json.loads(d)["choices"][0]["finish_reason"] for _, d in events[:-1]]
    assert finishes[-1] == "length"


@pytest.mark.slow
@one_process_only("reads the server's state in its process")
async def test_a_plain_sse_reply_has_no_ids_and_stops_when_the_client_leaves(
    make_server: Any,
) -> None:
    server: RunningServer = make_server(tokens_per_s=500.0)
    async with (
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=BODY) as response,
    ):
        async for event_id, _ in sse(response):
            assert event_id is None
            break
    engine = server.engine
    await eventually(lambda: engine.stats.active == 0 and engine.stats.requests_aborted == 1)


async def test_resume_refusals(make_server: Any) -> None:
    server: RunningServer = make_server()
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
        gone = await http.get("/v1/streams/chatcmpl-nope")
        assert gone.status_code == 410
        error = gone.json()["error"]
        assert error["code"] == "history_lost" and error["reason"] == "expired"
        body = {**BODY, "max_tokens": 5, "seedance": {"resumable": True}}
        reply = await http.post("/v1/chat/completions", json=body)
        request_id = reply.text.split('"id":"', 1)[1].split('"', 1)[0]
        bad = await http.get(f"/v1/streams/{request_id}", headers={"Last-Event-ID": "x:1"})
        assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]
        ahead = await http.get(f"/v1/streams/{request_id}", params={"after_seq": "99"})
        assert ahead.status_code == 410 and ahead.json()["error"]["reason"] == "cursor_ahead"
        again = await http.get(f"/v1/streams/{request_id}")
        assert again.status_code == 200 and again.text.endswith("data: [DONE]\n\n")
        unknown = await http.post(
            "/v1/chat/completions", json={**body, "seedance": {"resumeable": True}}
        )
        assert unknown.status_code == 400
