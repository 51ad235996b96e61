"""Gateway mode (the ``openai`` engine): Seedance in front of OpenAI-compatible upstreams.

The real upstream is llama-cpp-python's own server on the embedded GGUF; failures come from
small upstreams of our own that err, stall or drop a stream halfway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from benchmarks.peers.openai_sse import create_app as openai_app
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from seedance.client import connect
from seedance.engines.llamacpp.cpu import resolve_repack
from seedance.engines.llamacpp.native import backend_cwd
from seedance.engines.local import default_model_path
from seedance.engines.openai_upstream import OpenAIUpstreamEngine
from seedance.engines.routing import (
    LatencyWindow,
    PrefixMemory,
    Upstream,
    choose,
    prefix_blocks,
)
from seedance.engines.synthetic import SyntheticEngine
from seedance.netutil import free_port
from seedance.protocol.errors import SeedanceError
from seedance.protocol.qos import QoS
from tests.support.servers import RunningServer, asgi_server, one_process_only


@pytest.fixture(scope="module")
def llama_upstream() -> Iterator[str]:
    """``python -m llama_cpp.server`` on the embedded GGUF, its weight layout the engine's
    decision for this CPU (benchmarks.peers.llama_cpp_server)."""
    port = free_port()
    model = default_model_path()
    layout = [] if resolve_repack("auto", model, 2).repack else ["--no-repack"]
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "benchmarks.peers.llama_cpp_server", *layout),
            *("--model", str(model), "--port", str(port), "--n_threads", "2"),
            *("--n_ctx", "2048", "--verbose", "False"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=backend_cwd(),  # where a runtime-dispatch build's CPU backends are found
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/models", timeout=1).close()
            break
        assert proc.poll() is None and time.monotonic() < deadline, "llama_cpp.server failed"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


def gateway(
    make_server: Callable[..., RunningServer], *upstreams: str, **fields: Any
) -> RunningServer:
    return make_server(engine="openai", upstream=upstreams, **fields)


def upstream_engine(server: RunningServer) -> OpenAIUpstreamEngine:
    engine = server.engine
    assert isinstance(engine, OpenAIUpstreamEngine)
    return engine


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- failing upstreams


def faulty_app(mode: str, model: str = "synthetic") -> Starlette:
    """An upstream that lists ``model`` but fails every chat request in its own way."""

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def chat(request: Request) -> Response:
        await request.body()
        if mode == "error":
            return JSONResponse({"error": {"message": "upstream on fire"}}, status_code=500)
        if mode == "stall":
            await asyncio.sleep(30)
        if mode == "refuse":
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)

        async def half() -> AsyncIterator[bytes]:  # "drop": two tokens, then the connection dies
            for word in ("Hello", " world"):
                chunk = {
                    "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]
                }
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await asyncio.sleep(0.05)
            raise ConnectionResetError("dropped")

        return StreamingResponse(half(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@contextlib.contextmanager
def synthetic_upstream(tokens_per_s: float = 0.0) -> Iterator[tuple[str, SyntheticEngine]]:
    engine = SyntheticEngine(name="synthetic", tokens_per_s=tokens_per_s)
    with asgi_server(openai_app(engine)) as url:
        yield f"{url}/v1", engine


# --------------------------------------------------------------------------- tests


@pytest.mark.model
@pytest.mark.subprocess
@one_process_only("reads the gateway's upstreams in its process")
async def test_seedance_in_front_of_llama_cpp_server(make_server, llama_upstream: str) -> None:  # type: ignore[no-untyped-def]
    server = gateway(make_server, llama_upstream)
    engine = upstream_engine(server)
    # The model's name comes from the upstream's /v1/models.
    assert engine.info.name == engine.upstream_model
    async with connect(server.url, session_id="gw") as session:
        stream = session.generate("What is 2+2?", temperature=0, max_tokens=40)
        chunks = [chunk async for chunk in stream]
        assert stream.done is not None and stream.done.finish_reason == "stop"
        assert "4" in stream.text and len(chunks) > 3
        # Sessions work in front of a stateless upstream: the history travels with turn two.
        second = await session.complete("And 3+3?", temperature=0, max_tokens=40)
        assert second.usage.prompt_tokens > stream.done.usage.prompt_tokens
        assert second.text
    assert engine.upstreams[0].requests == 2 and engine.upstreams[0].up


@pytest.mark.slow
@one_process_only("each worker routes by its own requests in flight")
async def test_fewest_in_flight_routing(make_server) -> None:  # type: ignore[no-untyped-def]
    with synthetic_upstream(50) as (a, engine_a), synthetic_upstream(50) as (b, engine_b):
        server = gateway(make_server, a, b)

        async def ask() -> str:
            async with connect(server.url) as session:
                return (await session.complete("hi", max_tokens=10)).text or ""

        replies = await asyncio.gather(*(ask() for _ in range(6)))
        assert all(replies)
        assert engine_a.stats.requests_started == engine_b.stats.requests_started == 3


@pytest.mark.slow
@one_process_only("reads the gateway's upstreams in its process")
async def test_a_failing_upstream_is_retried_elsewhere_and_cooled_down(make_server) -> None:  # type: ignore[no-untyped-def]
    with asgi_server(faulty_app("error")) as bad, synthetic_upstream() as (good, engine_good):
        server = gateway(make_server, f"{bad}/v1", good, cooldown_s=0.5)
        engine = upstream_engine(server)
        broken = engine.upstreams[0]
        async with connect(server.url) as session:
            for _ in range(4):
                done = await session.complete("hi", max_tokens=5)
                assert done.finish_reason == "length"
        assert broken.failures == 1  # tried once, then left out
        assert engine_good.stats.requests_finished == 4
        # The cool-down ends with a probe of /models, which answers: it is back in rotation.
        await eventually(lambda: broken.up)


@pytest.mark.slow
async def test_a_stalled_upstream_times_out_before_the_first_token(make_server) -> None:  # type: ignore[no-untyped-def]
    with asgi_server(faulty_app("stall")) as slow, synthetic_upstream() as (good, _):
        server = gateway(make_server, f"{slow}/v1", good, timeout_s=0.5)
        async with connect(server.url) as session:
            started = time.monotonic()
            done = await session.complete("hi", max_tokens=5)
            assert done.finish_reason == "length" and time.monotonic() - started < 5


@pytest.mark.slow
@one_process_only("reads the gateway's upstreams in its process")
async def test_a_stream_dropped_after_its_first_token_is_engine_error(make_server) -> None:  # type: ignore[no-untyped-def]
    with asgi_server(faulty_app("drop")) as dropping, synthetic_upstream() as (good, engine_good):
        server = gateway(make_server, f"{dropping}/v1", good)
        engine = upstream_engine(server)
        engine.upstreams[1].in_flight = 100  # route the first request to the dropping one
        async with connect(server.url) as session:
            stream = session.generate("hi", max_tokens=20)
            with pytest.raises(SeedanceError) as info:
                async for _ in stream:
                    pass
            assert info.value.code == "engine_error"
            assert stream.text == "Hello world"  # what came before the failure
            engine.upstreams[1].in_flight = 0
            assert (await session.complete("again", max_tokens=3)).text
        assert engine_good.stats.requests_started == 1  # no retry after the first token
        assert not engine.upstreams[0].up


@one_process_only("reads the gateway's upstreams in its process")
async def test_an_upstream_400_is_the_request_fault(make_server) -> None:  # type: ignore[no-untyped-def]
    with asgi_server(faulty_app("refuse")) as refusing:
        server = gateway(make_server, f"{refusing}/v1")
        async with connect(server.url) as session:
            with pytest.raises(SeedanceError) as info:
                await session.complete("hi", max_tokens=5)
        assert info.value.code == "invalid_request" and "prompt too long" in info.value.message
        assert upstream_engine(server).upstreams[0].up


async def test_cancel_aborts_the_upstream_request(make_server) -> None:  # type: ignore[no-untyped-def]
    with synthetic_upstream(40) as (url, upstream):
        server = gateway(make_server, url)
        async with connect(server.url) as session:
            stream = session.generate("long", max_tokens=500)
            await anext(aiter(stream))
            await stream.cancel()
            assert (await stream.collect()).finish_reason == "cancelled"
        await eventually(lambda: upstream.stats.active == 0)
        assert upstream.stats.requests_aborted == 1
        assert upstream.stats.tokens_generated < 100


@one_process_only("reads the gateway's upstreams in its process")
async def test_every_upstream_down_fails_healthz(make_server) -> None:  # type: ignore[no-untyped-def]
    with asgi_server(faulty_app("error")) as bad:
        server = gateway(make_server, f"{bad}/v1", cooldown_s=60)
        async with connect(server.url) as session:
            with pytest.raises(SeedanceError) as info:
                await session.complete("hi", max_tokens=5)
            assert info.value.code == "engine_error"
        assert not server.engine.health().ok
        async with httpx.AsyncClient() as http:
            health = await http.get(f"{server.http_url}/healthz")
        assert health.status_code == 503 and "every upstream is down" in health.text


def test_no_upstream_answering_at_startup_is_a_clear_error() -> None:
    from seedance.config import ConfigError

    with pytest.raises(ConfigError) as info:
        OpenAIUpstreamEngine((f"http://127.0.0.1:{free_port()}/v1",), timeout_s=1)
    assert "--upstream-model" in info.value.message


# --------------------------------------------------------------------------- routing


def window_of(*ttft_s: float) -> LatencyWindow:
    window = LatencyWindow()
    for t in ttft_s:
        window.add(t)
    return window


def test_routing_ranks_by_expected_wait_within_the_requests_class() -> None:
    fast = Upstream.parse("http://fast/v1")
    slow = Upstream.parse("http://slow/v1")
    gold = Upstream.parse("http://gold/v1#critical+high")
    assert gold.classes == {"critical", "high"} and not fast.classes
    fast.ttft, slow.ttft, gold.ttft = (
        window_of(*[0.02] * 20),
        window_of(*[0.2] * 20),
        window_of(*[0.5] * 20),
    )
    ups = [fast, slow, gold]
    assert choose(ups, "critical") is gold  # the upstreams kept for a class, however slow
    assert choose(ups, None) is fast and choose(ups, "low") is fast  # the general ones
    fast.in_flight = 12  # 0.02 x 13 > 0.2 x 1
    assert choose(ups, "normal") is slow
    slow.waiting = 5  # read from its /metrics
    assert choose(ups, "normal") is fast
    fast.in_flight, fast.kv_use = 0, 0.99  # counted as 0.95: 0.02 / 0.05 = 0.4 < 0.2 x 6
    assert choose(ups, "normal") is fast
    fast.in_flight = 2  # 0.4 x 3 = 1.2 = 0.2 x 6: a tie goes to fewer requests served
    slow.requests = 1
    assert choose(ups, "normal") is fast
    fast.in_flight = 3
    assert choose(ups, "normal") is slow
    gold.down_until = 1.0
    assert choose(ups, "critical") is slow  # none kept for it up: the general ones
    fast.down_until = slow.down_until = 1.0
    gold.down_until = 0.0
    assert choose(ups, "low") is gold  # none for it nor general: any that is up
    fresh = Upstream.parse("http://new/v1")  # no figures: the median of the others'
    assert choose([fresh], None) is fresh and fresh.ttft.p99() is None


SYSTEM_A = "You are a careful assistant for a trading desk. " * 30  # about 1.4 KB
SYSTEM_B = "You answer questions about support tickets, briefly. " * 30


def blocks_of(*contents: str) -> list[bytes]:
    return prefix_blocks(f"user\x1f{c}" for c in contents)


def test_prefix_blocks_are_chained_whole_blocks() -> None:
    shared = "x" * 600  # two whole blocks, and part of a third
    one, two = blocks_of(shared + "a" * 400), blocks_of(shared + "b" * 400)
    assert len(one) == len(two) == 3
    assert one[:2] == two[:2] and one[2] != two[2]
    assert blocks_of("short") == []  # no whole block: nothing to route by
    assert blocks_of("y" + shared[1:])[0] != one[0]  # a block's hash covers what came before


def test_prefix_routing_keeps_a_prefix_where_it_went_within_a_load_bound() -> None:
    a, b, c = (Upstream.parse(f"http://{n}/v1") for n in "abc")
    ups = [a, b, c]
    first_turn = blocks_of(SYSTEM_A, "hello")
    a.prefixes.remember(first_turn)
    assert choose(ups, None, first_turn, routing="prefix") is a
    # The conversation's next turn, and another conversation under the same system prompt.
    assert choose(ups, None, blocks_of(SYSTEM_A, "hello", "hi!", "and now?"), routing="prefix") is a
    assert choose(ups, None, blocks_of(SYSTEM_A, "another question"), routing="prefix") is a
    # No upstream holds the prefix: the load-based choice.
    a.in_flight = 1
    assert choose(ups, None, blocks_of(SYSTEM_B, "x"), routing="prefix") is b
    # A holder past the bound gives way: 4 > max(ceil(1.25 x 4 / 3), 0 + 1) = 2.
    a.in_flight = 3
    assert choose(ups, None, first_turn, routing="prefix") is not a
    b.prefixes.remember(first_turn[:2])  # b holds less of it, but is within the bound
    assert choose(ups, None, first_turn, routing="prefix") is b
    # One request more than the least loaded holds is past the bound too, unless the holder
    # has much more of the prompt: 3 blocks more than b is not enough ...
    a.in_flight = 1
    assert len(first_turn) == 5
    assert choose(ups, None, first_turn, routing="prefix") is b
    # ... a long conversation's history is (STRETCH_BLOCKS more), but not for two requests more.
    history = blocks_of(SYSTEM_A, "hello", "a long answer. " * 100, "and then?")
    a.prefixes.remember(history)
    assert choose(ups, None, history, routing="prefix") is a
    # Within the bound, the longest run wins whatever its length (b holds 2 of the 5 blocks).
    a.in_flight = 0
    assert choose(ups, None, first_turn, routing="prefix") is a
    a.in_flight = 2
    assert choose(ups, None, history, routing="prefix") is not a
    # The other routings ignore prefixes (load, the default); the SLA classes come first.
    assert choose(ups, None, first_turn) is not a
    assert [choose(ups, None, first_turn, routing="round-robin", turn=t) for t in range(4)] == [
        a,
        b,
        c,
        a,
    ]
    gold = Upstream.parse("http://gold/v1#critical")
    assert choose([a, gold], "critical", first_turn, routing="prefix") is gold
    # An upstream remembers a bounded number of blocks, the least recently sent forgotten.
    small = PrefixMemory(limit=4)
    small.remember(first_turn[:3])
    small.remember(blocks_of(SYSTEM_B)[:3])
    assert len(small) == 4 and small.matched(first_turn) == 0


def test_prefix_routing_counts_the_prefill_ahead_of_a_prompt_not_the_requests() -> None:
    # Three upstreams with a request each: a's and b's are decoding, c's is still prefilling
    # a new 7-block prompt. A prompt no upstream holds goes where less prefill is ahead of it
    # (a or b; the requests in flight, equal, would have sent it to c, which served fewest).
    a, b, c = (Upstream.parse(f"http://{n}/v1") for n in "abc")
    for u, served in ((a, 3), (b, 3), (c, 1)):
        u.in_flight, u.requests = 1, served
    c.prefilling = [7]
    c.prefixes.remember(blocks_of(SYSTEM_A, "hello"))
    assert choose([a, b, c], None, blocks_of(SYSTEM_B, "x"), routing="prefix") is not c
    assert choose([a, b, c], None, blocks_of(SYSTEM_B, "x")) is c  # by load alone
    # A prompt c holds the start of still goes there: the engine prefills the shortest rest
    # first, so the longer prefill under way is not ahead of its few blocks.
    assert choose([a, b, c], None, blocks_of(SYSTEM_A, "another"), routing="prefix") is c
    assert c.prefill_ahead(2) == 2 and c.prefill_ahead(7) == 14


@pytest.mark.slow
@one_process_only("each worker routes by what it sent")
async def test_conversations_go_where_their_prefix_is(
    make_server: Callable[..., RunningServer],
) -> None:
    """Three Seedance upstreams; four conversations under each of two long system prompts,
    three turns each: every turn under one system prompt reaches the upstream its first went
    to (its prefix's KV cache), the two prompts' homes differ (load spread them); with
    round-robin they scatter."""
    upstreams = [make_server([SyntheticEngine(name="m")]) for _ in range(3)]

    def served() -> list[int]:
        return [u.engine.stats.requests_started for u in upstreams]

    async def talk(server: RunningServer, system: str, who: int) -> list[int]:
        homes = []
        messages = [{"role": "system", "content": system}]
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
            for turn in range(3):
                messages.append({"role": "user", "content": f"question {turn} from {who}"})
                before = served()
                body = {"model": "m", "messages": messages, "max_tokens": 4}
                reply = (await client.post("/v1/chat/completions", json=body)).json()
                homes.append(
                    next(i for i, (x, y) in enumerate(zip(before, served(), strict=True)) if y > x)
                )
                messages.append(reply["choices"][0]["message"])
        return homes

    urls = [f"{u.http_url}/v1" for u in upstreams]
    server = gateway(make_server, *urls, metrics_s=0, routing="prefix")
    homes = {system: set() for system in (SYSTEM_A, SYSTEM_B)}
    for who in range(4):
        for system in (SYSTEM_A, SYSTEM_B):
            homes[system] |= set(await talk(server, system, who))
    assert all(len(h) == 1 for h in homes.values()), homes
    assert homes[SYSTEM_A] != homes[SYSTEM_B]

    scattered = gateway(make_server, *urls, metrics_s=0, routing="round-robin")
    assert len(set(await talk(scattered, SYSTEM_A, 9))) == 3


def test_an_upstreams_metrics_give_its_queue_and_kv_cache_use(server: RunningServer) -> None:
    vllm = Upstream.parse("http://vllm:8000/v1")
    assert vllm.metrics_url == "http://vllm:8000/metrics"
    vllm.read_metrics(
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 3.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.42\n'
    )
    assert (vllm.waiting, vllm.kv_use) == (3.0, 0.42)
    seedance = Upstream.parse(f"{server.http_url}/v1")
    with urllib.request.urlopen(seedance.metrics_url, timeout=5) as response:
        seedance.read_metrics(response.read().decode())
    assert seedance.waiting == 0 and seedance.kv_use is None  # the synthetic engine has no KV


@one_process_only("reads the gateway's upstreams in its process")
async def test_the_gateway_sends_requests_where_the_first_token_comes_sooner(
    make_server: Callable[..., RunningServer],
) -> None:
    fast = make_server([SyntheticEngine(name="m", ttft_ms=5)])
    slow = make_server([SyntheticEngine(name="m", ttft_ms=120)])
    gold = make_server([SyntheticEngine(name="m", ttft_ms=60)])
    server = gateway(
        make_server,
        f"{fast.http_url}/v1",
        f"{slow.http_url}/v1",
        f"{gold.http_url}/v1#critical",
        metrics_s=0.2,
    )
    async with connect(server.url) as session:
        for _ in range(60):
            await session.complete("x", max_tokens=2)
    served = [s.engine.stats.requests_started for s in (fast, slow, gold)]
    assert served[0] >= 45, served  # once measured, the fast one takes nearly all
    async with connect(server.url, qos=QoS("critical")) as session:
        for _ in range(5):
            await session.complete("x", max_tokens=2)
    assert gold.engine.stats.requests_started == served[2] + 5


@pytest.mark.model
async def test_schemas_pass_through_to_the_upstream(make_server, smollm: RunningServer) -> None:  # type: ignore[no-untyped-def]
    """A reply bound to a schema in gateway mode: the upstream (another Seedance, on llama.cpp)
    enforces it, asked as OpenAI's ``response_format``. (llama-cpp-python's server knows only
    ``json_object``, not OpenAI's ``json_schema``: not an upstream for schemas.)"""
    import jsonschema
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=50_000_000)

    server = gateway(make_server, f"{smollm.http_url}/v1")
    api = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    model = (await api.models.list()).data[0].id
    reply = await api.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(reply.choices[0].message.parsed, City)
    async with connect(server.url) as session:
        schema = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
        done = await session.complete("Is the sky blue?", schema=schema, max_tokens=30)
        jsonschema.validate(json.loads(done.text or ""), schema)
    # What the upstream cannot enforce is its 400, passed on.
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    with pytest.raises(openai.BadRequestError, match="Unimplemented keys"):
        await api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format=bad,  # type: ignore[arg-type]
        )


@pytest.mark.model
async def test_logprobs_come_from_the_upstream(make_server, smollm: RunningServer) -> None:  # type: ignore[no-untyped-def]
    """Log probabilities in gateway mode: asked of the upstream (another Seedance on llama.cpp)
    in each endpoint's shape and read back per chunk, equal to the upstream's own answer."""
    import openai

    server = gateway(make_server, f"{smollm.http_url}/v1")
    direct = openai.AsyncOpenAI(base_url=f"{smollm.http_url}/v1", api_key="none", max_retries=0)
    through = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    model = (await through.models.list()).data[0].id
    ask: dict[str, Any] = {"model": model, "max_tokens": 8, "temperature": 0}
    ask["messages"] = [{"role": "user", "content": "What is the capital of France?"}]
    replies = [
        await api.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
        for api in (direct, through)
    ]
    entries = [reply.choices[0].logprobs.content for reply in replies]  # type: ignore[union-attr]
    assert entries[0] and [(e.token, e.logprob) for e in entries[0]] == [
        (e.token, e.logprob) for e in entries[1] or ()
    ]
    assert [t.token for t in entries[1][0].top_logprobs] == [  # type: ignore[index]
        t.token for t in entries[0][0].top_logprobs
    ]
    legacy = await through.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    assert legacy.choices[0].logprobs and len(legacy.choices[0].logprobs.tokens or []) == 4


@pytest.mark.model
@one_process_only("reads the gateway's upstreams in its process")
async def test_an_upstreams_prompt_cache_hits_reach_the_gateways_metrics(
    make_server: Callable[..., RunningServer], smollm: RunningServer
) -> None:
    """The embedded engine counts the prompt tokens its cache served (a conversation's next
    turn reuses the cells of the last); the gateway reads them from the upstream's /metrics
    and reports them as its own engine's."""
    server = gateway(make_server, f"{smollm.http_url}/v1", metrics_s=0.2)
    messages = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Hi"}]
    async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(2):
            body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
            reply = (await client.post("/v1/chat/completions", json=body)).json()
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "More?"}]

        def figures(text: str) -> tuple[float, float]:
            found = {
                s.name: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name.startswith("seedance_engine_prompt_") and s.name.endswith("_total")
            }
            return (
                found.get("seedance_engine_prompt_tokens_total", 0.0),
                found.get("seedance_engine_prompt_cached_tokens_total", 0.0),
            )

        async with httpx.AsyncClient(base_url=smollm.http_url) as direct:
            prompted, cached = figures((await direct.get("/metrics")).text)
        assert cached > 0.5 * prompted / 2  # the second turn: mostly the first's cells
        await eventually(lambda: upstream_engine(server).prompt_cache() == (prompted, cached))
        assert figures((await client.get("/metrics")).text) == (prompted, cached)


@pytest.mark.model
async def test_tools_pass_through_to_the_upstream(make_server, smollm: RunningServer) -> None:  # type: ignore[no-untyped-def]
    """Tool calling in gateway mode: the tools, and the history's calls and results, asked of
    the upstream (another Seedance on llama.cpp) as OpenAI's fields; its streamed
    ``delta.tool_calls`` read back into calls that every API gives out and checks."""
    import jsonschema
    import openai

    from tests.test_tools import FLAT, QUESTION, TIME, WEATHER, schema_of

    server = gateway(make_server, f"{smollm.http_url}/v1")
    api = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    model = (await api.models.list()).data[0].id
    ask: dict[str, Any] = {"model": model, "messages": QUESTION, "tools": [WEATHER, TIME]}
    reply = await api.chat.completions.create(
        **ask, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls or ()
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    # Streamed: the name first, then the arguments in parts, as the upstream streamed them.
    stream = await api.chat.completions.create(
        **ask,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    names, arguments = [], ""
    async for chunk in stream:
        for part in chunk.choices[0].delta.tool_calls or ():
            if part.function and part.function.name:
                names.append(part.function.name)
            arguments += (part.function and part.function.arguments) or ""
    assert names == ["get_time"]
    jsonschema.validate(json.loads(arguments), schema_of("get_time"))
    # The loop on the Responses API: the call's result goes back to the upstream as a tool
    # message, and the answer is text.
    called = await api.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=FLAT,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    )
    (item,) = called.output
    assert item.type == "function_call"
    result = {"type": "function_call_output", "call_id": item.call_id, "output": '{"temp": 18}'}
    answer = await api.responses.create(
        model=model,
        previous_response_id=called.id,
        input=[result],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=30,
    )
    assert answer.output_text
    await api.close()


def test_calls_streamed_in_parts_are_written_in_the_generic_format() -> None:
    from seedance.protocol.tools import CallWriter, parse_calls, parse_tools
    from tests.test_tools import TIME, WEATHER

    tools = parse_tools([WEATHER, TIME], "required", True)
    assert tools is not None
    writer = CallWriter()
    text = writer.part(0, "get_weather", "")
    for fragment in ('{"city": "New ', 'York", ', '"unit": "celsius"}', "\n "):
        text += writer.part(0, None, fragment)
    text += (
        writer.part(1, "get_time", None) + writer.part(1, None, '{"city":"Oslo"}') + writer.end()
    )
    calls = parse_calls(text, tools)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "unit": "celsius"}),
        ("get_time", {"city": "Oslo"}),
    ]
    empty = CallWriter()  # a call whose arguments never came: an empty object
    text = empty.part(0, "get_time", None) + empty.end()
    assert text == '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
