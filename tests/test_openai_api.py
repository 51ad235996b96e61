"""The OpenAI-compatible HTTP API, driven by the official ``openai`` package over real sockets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from seedance.client import connect
from tests.support.servers import RunningServer, one_process_only, slow_engine


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_chat_completion_matches_the_websocket_reply(server: RunningServer) -> None:
    api = client(server)
    reply = await api.chat.completions.create(
        model="synthetic",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=12,
        seed=3,
        temperature=0.5,
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "synthetic"
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    async with connect(server.url) as session:
        same = await session.complete("hello there", max_tokens=12, seed=3, temperature=0.5)
    assert choice.message.content == same.text
    assert reply.usage.prompt_tokens == same.usage.prompt_tokens


async def test_streaming_chat_with_usage(server: RunningServer) -> None:
    api = client(server)
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "stream it"}]}
    whole = await api.chat.completions.create(**body, max_tokens=20, seed=1)  # type: ignore[call-overload]
    stream = await api.chat.completions.create(
        **body, max_tokens=20, seed=1, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


async def test_completions_stream_and_not(server: RunningServer) -> None:
    api = client(server)
    whole = await api.completions.create(model="synthetic", prompt="Once upon a time", seed=2)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.usage is not None and whole.usage.completion_tokens == 16  # OpenAI's default
    stream = await api.completions.create(
        model="synthetic", prompt="Once upon a time", seed=2, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream])
    assert text == whole.choices[0].text


async def test_errors_have_openai_shape_and_status(server: RunningServer) -> None:
    api = client(server)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as missing:
        await api.chat.completions.create(model="nope", messages=messages)  # type: ignore[arg-type]
    assert missing.value.status_code == 404
    assert missing.value.code == "model_not_found" and "synthetic" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        await api.chat.completions.create(model="synthetic", messages=messages, temperature=3)  # type: ignore[arg-type]
    assert bad.value.code == "invalid_request" and "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError) as many:
        await api.chat.completions.create(model="synthetic", messages=messages, n=2)  # type: ignore[arg-type]
    assert "n:" in many.value.message
    with pytest.raises(openai.BadRequestError) as robot:
        await api.chat.completions.create(
            model="synthetic",
            messages=[{"role": "robot", "content": "x"}],  # type: ignore[list-item]
        )
    assert "role" in robot.value.message
    weather = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    with pytest.raises(openai.BadRequestError) as tools:  # never a silent text reply
        await api.chat.completions.create(model="synthetic", messages=messages, tools=[weather])  # type: ignore[arg-type, list-item]
    assert tools.value.param == "tools"
    assert "synthetic engine of model synthetic cannot call tools" in tools.value.message
    unused = await api.chat.completions.create(
        model="synthetic",
        messages=messages,  # type: ignore[arg-type]
        tools=[weather],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=2,
    )
    assert unused.choices[0].message.content
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        broken = await http.post("/v1/chat/completions", content=b"{not json")
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == "invalid_json"
        assert broken.json()["error"]["type"] == "invalid_request_error"
        huge = await http.post("/v1/completions", content=b"x" * (2 * 1024 * 1024))
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
        assert (await http.get("/v1/chat/completions")).status_code == 405
    # The server is still fine.
    ok = await api.chat.completions.create(model="synthetic", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert ok.choices[0].message.content


@pytest.mark.slow
@one_process_only("reads the server's requests in its process")
async def test_a_full_queue_is_503(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(20)], max_running=1, max_waiting=0)
    api = client(server)
    messages = [{"role": "user", "content": "hi"}]
    running = asyncio.create_task(
        api.chat.completions.create(model="synthetic", messages=messages, max_tokens=10)  # type: ignore[arg-type]
    )
    await eventually(lambda: server.engine.stats.active == 1)
    with pytest.raises(openai.InternalServerError) as full:
        await api.chat.completions.create(model="synthetic", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert full.value.status_code == 503 and full.value.code == "overloaded"
    assert (await running).choices[0].finish_reason == "length"


@pytest.mark.slow
@one_process_only("reads the server's requests in its process")
async def test_a_dropped_connection_aborts_the_generation(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(20)], max_running=1)
    engine = server.engine
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 500,
        "stream": True,
    }
    # One streaming reply, dropped after its first chunks...
    async with (
        httpx.AsyncClient(base_url=server.http_url, timeout=10) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        await anext(lines)
        # ...and a second one, still waiting for admission behind the first, dropped too.
        waiting = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await eventually(lambda: server.state.models["synthetic"].admission.waiting == 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    await eventually(lambda: engine.stats.active == 0)
    assert engine.stats.requests_aborted == 1 and engine.stats.requests_started == 1
    await eventually(lambda: server.state.models["synthetic"].admission.waiting == 0)
    produced = engine.stats.tokens_generated
    await asyncio.sleep(0.3)
    assert engine.stats.tokens_generated == produced < 100


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"max_tokens": 0}),
        ("/v1/chat/completions", {"max_completion_tokens": 0}),
        ("/v1/completions", {"max_tokens": 0}),
    ],
)
async def test_max_tokens_0_is_refused_as_over_websocket(
    server: RunningServer, path: str, fields: dict[str, int]
) -> None:
    text = (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        reply = await http.post(path, json={"model": "synthetic", **text, **fields})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request"
    assert "max_tokens must be between 1 and" in reply.json()["error"]["message"]
    async with connect(server.url) as session:  # the same rule, the same words
        with pytest.raises(Exception, match="max_tokens must be between 1 and"):
            await session.complete("hi", max_tokens=0)


async def test_deep_nesting_in_an_ignored_field_is_a_400(server: RunningServer) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"model":"synthetic","messages":[{"role":"user","content":"hi"}],"extra":' + deep
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        reply = await http.post("/v1/chat/completions", content=body + b"}")
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": "the body is not valid JSON: nested too deeply",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }


async def test_unknown_paths_and_methods_get_openai_shaped_errors(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        missing = await http.get("/v1/nothing")
        wrong = await http.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["type"] == "invalid_request_error"
    assert "allowed: POST" in wrong.json()["error"]["message"]


async def test_a_revoked_key_ends_its_streaming_http_reply_with_unauthorized(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    """An HTTP call is a peer like a socket: a key revoked mid-stream ends its reply with an
    ``unauthorized`` error event and ``[DONE]``; another tenant's stream goes on."""
    from seedance.config_loader import load_access
    from seedance.tenants.keys import add_key

    path = tmp_path / "seedance.toml"
    admin = add_key(path, "ops", role="admin").key
    acme, other = add_key(path, "acme"), add_key(path, "globex").key
    server = make_server(
        [slow_engine(tokens_per_s=20)], config_file=str(path), access=load_access(path)
    )
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 60, "stream": True}

    async def stream(client: httpx.AsyncClient, key: str, started: asyncio.Event) -> list[str]:
        events = []
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        return events

    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
        mine, theirs = asyncio.Event(), asyncio.Event()
        revoked_stream = asyncio.create_task(stream(client, acme.key, mine))
        bystander = asyncio.create_task(stream(client, other, theirs))
        await mine.wait()
        await theirs.wait()
        reply = await client.post(
            f"/admin/keys/{acme.id}/revoke", headers={"Authorization": f"Bearer {admin}"}
        )
        assert reply.status_code == 200
        events = await asyncio.wait_for(revoked_stream, 10)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "unauthorized" and "revoked" in error["message"]
        whole = await asyncio.wait_for(bystander, 10)
    assert whole[-1] == "[DONE]" and '"finish_reason":"length"' in whole[-2].replace(" ", "")
