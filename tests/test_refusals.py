"""Every refusal on every API writes the same audit record and log line (docs/audit.md): a
WebSocket connection and a ``generate`` frame, the OpenAI HTTP API (``/tokenize`` too), the
Responses API over HTTP and over its WebSocket, a Realtime connection and its
``response.create``. Real servers, real sockets, the official ``openai`` package where it is
what a user runs."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import connect as ws_connect

from seedance.config_loader import load_access
from seedance.tenants.keys import add_key
from tests.support.servers import RunningServer, one_process_only
from tests.support.waits import eventually
from tests.support.ws import generate, open_session, raw_connect, wait_closed

#: The fields of every ``refused`` record, whatever API refused.
SHAPE = {"kind", "time", "seq", "prev", "hash", "api", "peer", "path", "tenant", "credential",
         "outcome", "message", "trace_id"}  # fmt: skip
LINE = re.compile(
    r"^refused (websocket|http) (/\S+) peer=\S+ tenant=\S+ request=\S+ model=\S+ code=\w+: .+"
)


@pytest.fixture
def audited(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> tuple[RunningServer, Path, str]:
    """A server with one tenant (its key returned) and an audit log."""
    config = tmp_path / "seedance.toml"
    key = add_key(config, "acme").key
    log = tmp_path / "audit.log"
    server = make_server(config_file=str(config), access=load_access(config), audit_file=str(log))
    return server, log, key


def refusals(log: Path) -> list[dict[str, Any]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [r for r in map(json.loads, lines) if r["kind"] == "refused"]


async def refused_once(log: Path, **fields: Any) -> dict[str, Any]:
    """The one ``refused`` record with these fields (waited for: the writer is a thread)."""

    def matching() -> list[dict[str, Any]]:
        return [r for r in refusals(log) if all(r.get(k) == v for k, v in fields.items())]

    await eventually(lambda: matching(), 5, f"a refused record with {fields}")
    (record,) = matching()
    assert set(record) >= SHAPE, record
    return record


def logged(caplog: pytest.LogCaptureFixture, path: str, code: str) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("refusals")]
    mine = [line for line in lines if f" {path} " in line and f"code={code}:" in line]
    assert len(mine) == 1, lines
    assert LINE.match(mine[0]), mine[0]
    return mine[0]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@one_process_only("reads the server's log records in the test's process")
async def test_a_refused_websocket_connection_and_frame(
    audited: tuple[RunningServer, Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, log, key = audited
    caplog.set_level(logging.INFO)
    async with raw_connect(server.url, "model=nope", additional_headers=auth(key)) as ws:
        await wait_closed(ws)
    record = await refused_once(log, path="/v2/infer", outcome="model_not_found")
    assert record["api"] == "websocket" and record["tenant"] == "acme"
    logged(caplog, "/v2/infer", "model_not_found")
    ws, _hello = await open_session(server.url, "session_id=s1", additional_headers=auth(key))
    async with ws:
        await ws.send("{not json")
        assert json.loads(await ws.recv())["error"]["code"] == "invalid_json"
        frames = await generate(ws, prompt="hi", max_tokens=5, priority=9, request_id="r-9")
    assert frames[-1]["error"]["code"] == "forbidden"  # above the tenant's max_priority
    record = await refused_once(log, request_id="r-9")
    assert record["outcome"] == "forbidden" and record["session"] == "s1"
    assert record["model"] == "synthetic" and record["connection"].startswith("c-")
    logged(caplog, "/v2/infer", "forbidden")
    record = await refused_once(log, path="/v2/infer", outcome="invalid_json")
    assert record["session"] == "s1" and "request_id" not in record


@one_process_only("reads the server's log records in the test's process")
async def test_a_refused_openai_http_request(
    audited: tuple[RunningServer, Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, log, key = audited
    caplog.set_level(logging.INFO)
    client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )
    record = await refused_once(log, path="/v1/chat/completions", outcome="model_not_found")
    assert record["api"] == "http" and record["tenant"] == "acme"
    assert record["request_id"].startswith("chatcmpl-")
    logged(caplog, "/v1/chat/completions", "model_not_found")
    async with httpx.AsyncClient(base_url=server.http_url) as http:  # no credential at all
        reply = await http.post("/v1/chat/completions", json={})
    assert reply.status_code == 401
    record = await refused_once(log, path="/v1/chat/completions", outcome="unauthorized")
    assert record["tenant"] is None


@one_process_only("reads the server's log records in the test's process")
async def test_a_refused_responses_request_over_http(
    audited: tuple[RunningServer, Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, log, key = audited
    caplog.set_level(logging.INFO)
    client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="synthetic", input="hi", max_output_tokens=10**9)
    record = await refused_once(log, path="/v1/responses", outcome="invalid_request")
    assert record["api"] == "http" and record["request_id"].startswith("resp_")
    assert "max_output_tokens" in record["message"]
    logged(caplog, "/v1/responses", "invalid_request")


@one_process_only("reads the server's log records in the test's process")
async def test_a_refused_responses_websocket_and_response_create(
    audited: tuple[RunningServer, Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, log, key = audited
    caplog.set_level(logging.INFO)
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    async with ws_connect(url) as ws:  # no credential
        error = json.loads(await ws.recv())
    assert error["error"]["code"] == "unauthorized"
    record = await refused_once(log, path="/v1/responses", outcome="unauthorized")
    assert record["api"] == "websocket"
    logged(caplog, "/v1/responses", "unauthorized")
    async with ws_connect(url, additional_headers=auth(key)) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "nope", "input": "hi"}))
        error = json.loads(await ws.recv())
    assert error["error"]["code"] == "model_not_found"
    record = await refused_once(log, path="/v1/responses", outcome="model_not_found")
    assert record["api"] == "websocket" and record["tenant"] == "acme"
    assert record["request_id"].startswith("resp_")


@one_process_only("reads the server's log records in the test's process")
async def test_a_refused_realtime_connection_and_response_create(
    audited: tuple[RunningServer, Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, log, key = audited
    caplog.set_level(logging.INFO)
    base = f"ws://127.0.0.1:{server.port}/v1/realtime"
    async with ws_connect(f"{base}?model=nope", additional_headers=auth(key)) as ws:
        error = json.loads(await ws.recv())
    assert error["error"]["code"] == "model_not_found"
    record = await refused_once(log, path="/v1/realtime", outcome="model_not_found")
    assert record["api"] == "websocket" and record["tenant"] == "acme"
    logged(caplog, "/v1/realtime", "model_not_found")
    client = openai.AsyncOpenAI(
        base_url=f"{server.http_url}/v1", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1",
        api_key=key,
    )  # fmt: skip
    async with client.realtime.connect(model="synthetic") as connection:
        await connection.response.create()  # nothing in the conversation yet
        async for event in connection:
            if event.type == "error":
                break
    assert "empty" in event.error.message
    record = await refused_once(log, path="/v1/realtime", outcome="invalid_request")
    assert record["session"] and record["connection"].startswith("rt-")
    assert record["request_id"].startswith("resp_")
    logged(caplog, "/v1/realtime", "invalid_request")


@one_process_only("reads the server's log records in the test's process")
async def test_a_refused_tokenize_call(
    audited: tuple[RunningServer, Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, log, key = audited
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        reply = await http.post("/tokenize", json={"prompt": "hi"})  # no credential
        assert reply.status_code == 401
        record = await refused_once(log, path="/tokenize", outcome="unauthorized")
        assert record["api"] == "http" and record["tenant"] is None
        reply = await http.post("/detokenize", json={"tokens": [1]}, headers=auth(key))
        assert reply.status_code == 400  # the synthetic engine has no tokenizer
    record = await refused_once(log, path="/detokenize", outcome="invalid_request")
    assert record["tenant"] == "acme" and record["model"] == "synthetic"
    assert record["request_id"].startswith("tok-")
    logged(caplog, "/detokenize", "invalid_request")
