"""Quality of service (``X-QoS-Priority``): parsed strictly, a class sets the priority within
the tenant's range, and the server's metrics are kept per SLA tag."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from seedance.client import connect
from seedance.observability.metrics import MAX_SLATAGS, Metrics
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.qos import QoS, parse_qos
from seedance.tenants.keys import add_key
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.ws import collect, generate, open_session, raw_connect, recv_json
from tests.test_metrics import scrape, value
from tests.test_tenants import auth, refused, tenant_server, write_config

HEADER = "X-QoS-Priority"
CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_the_header_is_parsed_strictly() -> None:
    assert parse_qos("high; slatag=api_payment_v2; health_score=0.92") == QoS(
        "high", "api_payment_v2", 0.92
    )
    assert parse_qos("LOW") == QoS("low")
    assert parse_qos(" critical ;slatag=a.b:c-d ") == QoS("critical", "a.b:c-d")
    assert QoS("high", "pay", 0.5).header() == "high; slatag=pay; health_score=0.50"
    assert parse_qos(QoS("background", "x", 0.25).header()) == QoS("background", "x", 0.25)
    refusals = {
        "": "must start with a class",
        "urgent": "unknown QoS class 'urgent'",
        "high; slatag": "'slatag' is not name=value",
        "high; slatag=": "is not name=value",
        "high; tier=gold": "unknown QoS parameter 'tier'",
        "high; slatag=a; slatag=b": "'slatag' is given twice",
        "high; slatag=has space": "must be 1 to 64 letters",
        f"high; slatag={'x' * 65}": "must be 1 to 64 letters",
        "high; health_score=1.5": "between 0 and 1",
        "high; health_score=nan": "between 0 and 1",
        "high; health_score=good": "is not a number",
        "high; " + "slatag=x;" * 40: "over 256 characters",
    }
    for value_, message in refusals.items():
        with pytest.raises(InvalidRequest, match=message):
            parse_qos(value_)


def test_slatags_past_the_limit_share_one_series() -> None:
    metrics = Metrics()
    labels = [metrics.slatag(f"tag{i}") for i in range(MAX_SLATAGS + 5)]
    assert labels[:MAX_SLATAGS] == [f"tag{i}" for i in range(MAX_SLATAGS)]
    assert set(labels[MAX_SLATAGS:]) == {"other"}
    assert metrics.slatag("tag3") == "tag3" and metrics.slatag(None) == "none"


async def test_metrics_per_slatag_from_the_header_and_the_frame(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server()
    headers = {HEADER: "high; slatag=api_payment_v2; health_score=0.92"}
    ws, _ = await open_session(server.url, additional_headers=headers)
    async with ws:
        assert (await generate(ws, prompt="x", max_tokens=3))[-1]["type"] == "done"
        # A browser's frame field overrides the handshake's for its request.
        frame = await generate(ws, prompt="x", max_tokens=3, qos="low; slatag=chat_ui")
        assert frame[-1]["type"] == "done"
        # A malformed field refuses that request only; the connection goes on.
        bad = await generate(ws, prompt="x", qos="high; slatag=a b")
        assert bad[-1]["error"]["code"] == "invalid_request"
        assert "slatag 'a b' must be 1 to 64" in bad[-1]["error"]["message"]
        assert (await generate(ws, prompt="x", max_tokens=1))[-1]["type"] == "done"
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        ok = await client.post(
            "/v1/chat/completions", json=CHAT, headers={HEADER: "normal; slatag=api_payment_v2"}
        )
        assert ok.status_code == 200
        malformed = await client.post(
            "/v1/chat/completions", json=CHAT, headers={HEADER: "soon; slatag=x"}
        )
        assert malformed.status_code == 400
        assert "unknown QoS class 'soon'" in malformed.json()["error"]["message"]

    samples, _ = scrape(server)
    ttft = "seedance_slo_time_to_first_token_seconds_count"
    assert value(samples, ttft, slatag="api_payment_v2", qos_class="high") == 2
    assert value(samples, ttft, slatag="api_payment_v2", qos_class="normal") == 1
    assert value(samples, ttft, slatag="chat_ui", qos_class="low") == 1
    ended = "seedance_slo_requests_total"
    assert value(samples, ended, slatag="api_payment_v2", qos_class="high", outcome="length") == 2
    assert value(samples, ended, slatag="chat_ui", qos_class="low", outcome="length") == 1
    health = "seedance_slo_client_health_score"
    assert value(samples, f"{health}_count", slatag="api_payment_v2") == 2
    assert value(samples, f"{health}_sum", slatag="api_payment_v2") == pytest.approx(1.84)


async def test_a_malformed_header_refuses_the_connection(server: RunningServer) -> None:
    code, error = await refused(server.url, additional_headers={HEADER: "high; health_score=2"})
    assert error["code"] == "invalid_request" and "between 0 and 1" in error["message"]
    assert code == 1008


@one_process_only("each worker has its own admission queue")
async def test_a_class_orders_admission_within_the_tenants_range(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    """One slot, busy: queued requests start by class (high before low), and a class above
    the tenant's ``max_priority`` is lowered to it (critical waits behind an earlier high)
    instead of being refused; an explicit ``priority`` above it is still refused."""
    path = write_config(tmp_path / "s.toml", "[tenants.acme]\nmax_priority = 5\n")
    key = add_key(path, "acme").key
    server = tenant_server(
        make_server, path, [slow_engine(tokens_per_s=200)], max_running=1, max_waiting=10
    )
    busy, _ = await open_session(server.url, additional_headers=auth(key))
    await busy.send(json.dumps({"prompt": "x", "max_tokens": 40}))
    assert (await recv_json(busy))["type"] == "start"

    started: list[str] = []

    async def ask(name: str, qos: str) -> None:
        headers = {**auth(key), HEADER: qos}
        async with raw_connect(server.url, additional_headers=headers) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"prompt": "x", "max_tokens": 2}))
            frames = await collect(ws)
            assert frames[-1]["type"] == "done", frames
            started.append(name)

    tasks = []
    for name, qos in (("low", "low"), ("high", "high"), ("critical", "critical")):
        tasks.append(asyncio.create_task(ask(name, qos)))
        await asyncio.sleep(0.05)  # queued in this order
    await collect(busy)
    await asyncio.gather(*tasks)
    assert started == ["high", "critical", "low"]

    async with busy:
        await busy.send(json.dumps({"prompt": "x", "priority": 7}))
        error = await recv_json(busy)
    assert error["error"]["code"] == "forbidden" and "highest, 5" in error["error"]["message"]


async def test_the_python_sdk_sends_the_session_qos_and_a_requests_own(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server()
    qos = QoS("high", "sdk_tag", 0.75)
    async with connect(server.url, qos=qos) as session:
        assert (await session.complete("x", max_tokens=2)).finish_reason == "length"
        own = await session.complete("x", max_tokens=2, qos=QoS("low", "sdk_tag"))
        assert own.finish_reason == "length"
        with pytest.raises(InvalidRequest, match="unknown QoS class"):
            await session.complete("x", qos="urgent")
    with pytest.raises(InvalidRequest, match="between 0 and 1"):
        await connect(server.url, qos="high; health_score=3")
    samples, _ = scrape(server)
    ended = "seedance_slo_requests_total"
    assert value(samples, ended, slatag="sdk_tag", qos_class="high", outcome="length") == 1
    assert value(samples, ended, slatag="sdk_tag", qos_class="low", outcome="length") == 1
