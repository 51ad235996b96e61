"""``GET /metrics``: Prometheus metrics change as traffic flows (scrape, stream, scrape again)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seedance.client import connect
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.waits import eventually

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: RunningServer) -> tuple[Samples, str]:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, text


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


MODEL = {"model": "synthetic", "engine": "synthetic"}
#: Series observed per request also name the tenant ("default" without tenants).
REQUEST = {**MODEL, "tenant": "default"}


@pytest.mark.slow
@one_process_only("reads the server's admission in its process")
async def test_a_stream_moves_the_counters_and_histograms(server: RunningServer) -> None:
    before, _ = scrape(server)
    async with connect(server.url) as session:
        done = await session.complete("hello", max_tokens=5)
        assert done.usage.completion_tokens == 5
        during, _ = scrape(server)
    await eventually(lambda: not server.connections, what="the server sees the close")
    after, text = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("seedance_requests_total", **REQUEST, outcome="length") == 1
    assert delta("seedance_generation_tokens_total", **REQUEST) == 5
    assert delta("seedance_prompt_tokens_total", **REQUEST) == done.usage.prompt_tokens
    assert delta("seedance_time_to_first_token_seconds_count", **REQUEST) == 1
    assert delta("seedance_inter_token_latency_seconds_count", **REQUEST) == 4
    assert delta("seedance_e2e_request_latency_seconds_count", **REQUEST) == 1
    assert delta("seedance_request_queue_time_seconds_count", **REQUEST) == 1
    assert delta("seedance_connections_opened_total") == 1
    assert delta("seedance_connections_closed_total", code="1000") == 1
    assert value(during, "seedance_connections") == value(before, "seedance_connections") + 1
    assert value(after, "seedance_connections") == value(before, "seedance_connections")
    assert value(after, "seedance_sessions") >= 1
    # No series per session, connection or request.
    for forbidden in ("session", "request_id", "conn", "trace"):
        assert f'{forbidden}="' not in text
    # No GPU here: GPU memory is absent, not zero.
    assert "seedance_gpu_memory" not in text


@pytest.mark.slow
@one_process_only("reads the server's admission in its process")
async def test_running_waiting_and_cancelled(make_server: Callable[..., RunningServer]) -> None:
    server = make_server(engines=[slow_engine(tokens_per_s=20)], max_running=1)
    async with connect(server.url) as a, connect(server.url) as b:
        first = a.generate("one", max_tokens=200)
        await anext(aiter(first))
        second = b.generate("two", max_tokens=200)
        waiting = asyncio.create_task(second.collect())  # sends the request, then waits
        admission = server.state.models["synthetic"].admission
        await eventually(lambda: admission.waiting == 1, what="the second request waits")
        live, _ = scrape(server)
        assert value(live, "seedance_requests_running", **MODEL) == 1
        assert value(live, "seedance_requests_waiting", **MODEL) == 1
        await first.cancel()
        await first.collect()
        await second.cancel()
        await waiting
    after, _ = scrape(server)
    assert value(after, "seedance_requests_total", **REQUEST, outcome="cancelled") == 2
    assert value(after, "seedance_requests_running", **MODEL) == 0


async def test_the_openai_api_is_counted_too(server: RunningServer) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    before, _ = scrape(server)
    await api.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    after, _ = scrape(server)
    key = ("seedance_requests_total", tuple(sorted({**REQUEST, "outcome": "length"}.items())))
    assert after[key] - before.get(key, 0.0) == 1
    ttft = "seedance_time_to_first_token_seconds_count"
    assert value(after, ttft, **REQUEST) - value(before, ttft, **REQUEST) == 1


@pytest.mark.slow
async def test_heartbeat_round_trips_are_measured(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server(heartbeat_interval_s=0.1, idle_timeout_s=5)
    async with connect(server.url):
        await asyncio.sleep(0.5)  # the server pings after 0.1 s of silence; the client answers
    samples, _ = scrape(server)
    assert value(samples, "seedance_heartbeat_round_trip_seconds_count") >= 1


def test_frames_merged_is_exported(server: RunningServer) -> None:
    samples: Any
    samples, _ = scrape(server)
    assert ("seedance_frames_merged_total", ()) in samples
