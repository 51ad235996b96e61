"""Traces: a client's traceparent comes back in frames, headers and exported spans.

Spans are checked with the SDK's in-memory exporter, and over the wire with real OTLP receivers
(HTTP and gRPC) that these tests start.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import Callable, Sequence

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from seedance.config import ConfigError, ServerConfig
from seedance.observability.tracing import Tracing, new_provider, otlp_exporter
from tests.support.otlp import grpc_receiver, http_receiver
from tests.support.servers import (
    RunningServer,
    ServerProcess,
    one_process_only,
    serve_fails,
    slow_engine,
)
from tests.support.ws import collect, generate, open_session, recv_json

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
CONNECTION_SPAN = "WebSocket /v2/infer"
HEX_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-0[01]")


def memory_tracing(trace_tokens: bool = False) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = new_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, trace_tokens=trace_tokens), exporter


async def spans_when(
    exporter: InMemorySpanExporter,
    ready: Callable[[Sequence[ReadableSpan]], bool],
    timeout_s: float = 5.0,
) -> Sequence[ReadableSpan]:
    """The finished spans once ``ready`` holds (a span ends just after its last frame)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        spans = exporter.get_finished_spans()
        if ready(spans) or loop.time() > deadline:
            return spans
        await asyncio.sleep(0.01)


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    return {
        s.name: s
        for s in spans
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


# --------------------------------------------------------------------------- WebSocket


@one_process_only("reads spans from an exporter in the test's process")
async def test_handshake_traceparent_is_the_parent_of_request_spans(
    make_server: Callable[..., RunningServer],
) -> None:
    tracing, exporter = memory_tracing()
    server = make_server(tracing=tracing)
    ws, _ = await open_session(server.url, additional_headers={"traceparent": TRACEPARENT})
    async with ws:
        frames = await generate(ws, prompt="hello", max_tokens=6)
    start, done = frames[0], frames[-1]
    assert start["trace_id"] == TRACE == done["trace_id"]

    spans = await spans_when(exporter, lambda s: bool(named(s, CONNECTION_SPAN)))
    (request,) = named(spans, "chat synthetic")
    assert hex_ids(request)[0] == TRACE
    assert request.parent is not None and format(request.parent.span_id, "016x") == PARENT
    assert request.kind is SpanKind.SERVER
    attributes = request.attributes or {}
    assert attributes["gen_ai.request.model"] == "synthetic"
    assert attributes["gen_ai.usage.input_tokens"] == start["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 6 == done["usage"]["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["seedance.request_id"] == start["request_id"]
    assert attributes["seedance.outcome"] == "length"
    assert request.status.status_code is StatusCode.UNSET

    # Queueing, prefill and decode follow each other inside the request's span.
    parts = children(spans, request)
    assert set(parts) == {"queue", "prefill", "decode"}
    queue, prefill, decode = parts["queue"], parts["prefill"], parts["decode"]
    assert request.start_time == queue.start_time
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert request.end_time is not None and decode.end_time is not None
    assert decode.end_time <= request.end_time
    assert [e.name for e in request.events] == ["first_token", "end"]
    assert request.events[0].timestamp == prefill.end_time

    # The connection's span: a child of the same traceparent, linked from the request.
    (connection,) = named(spans, CONNECTION_SPAN)
    assert connection.parent is not None and format(connection.parent.span_id, "016x") == PARENT
    assert [link.context for link in request.links] == [connection.context]
    assert (connection.attributes or {})["seedance.close_code"] == 1000
    assert (connection.attributes or {})["seedance.requests"] == 1


@one_process_only("reads spans from an exporter in the test's process")
async def test_a_generate_frame_traceparent_wins_and_a_bad_one_is_refused(
    make_server: Callable[..., RunningServer],
) -> None:
    tracing, exporter = memory_tracing()
    server = make_server(tracing=tracing)
    own = "0af7651916cd43dd8448eb211c80319c"
    ws, _ = await open_session(server.url, additional_headers={"traceparent": TRACEPARENT})
    async with ws:
        frames = await generate(
            ws, prompt="x", max_tokens=2, traceparent=f"00-{own}-b7ad6b7169203331-01"
        )
        assert frames[0]["trace_id"] == own == frames[-1]["trace_id"]
        bad = await generate(ws, prompt="x", max_tokens=2, traceparent="00-nothex-01")
        (error,) = bad
        assert error["type"] == "error" and error["error"]["code"] == "invalid_request"
        assert "traceparent" in error["error"]["message"]
        # The connection goes on, on the handshake's trace.
        again = await generate(ws, prompt="x", max_tokens=2)
        assert again[-1]["trace_id"] == TRACE
    spans = await spans_when(exporter, lambda s: bool(named(s, CONNECTION_SPAN)))
    requests = named(spans, "chat synthetic")
    assert sorted(hex_ids(s)[0] for s in requests) == sorted([own, TRACE, TRACE])
    (refused,) = [s for s in requests if s.status.status_code is StatusCode.ERROR]
    assert (refused.attributes or {})["error.type"] == "invalid_request"
    assert (refused.attributes or {})["seedance.request_id"] == bad[0]["request_id"]


@one_process_only("reads spans from an exporter in the test's process")
async def test_without_traceparent_each_request_is_a_new_trace(
    make_server: Callable[..., RunningServer],
) -> None:
    tracing, exporter = memory_tracing()
    server = make_server(tracing=tracing)
    ws, _ = await open_session(server.url)
    async with ws:
        first = await generate(ws, prompt="a", max_tokens=2)
        second = await generate(ws, prompt="b", max_tokens=2)
    ids = {first[0]["trace_id"], second[0]["trace_id"]}
    assert len(ids) == 2
    spans = await spans_when(exporter, lambda s: bool(named(s, CONNECTION_SPAN)))
    requests = named(spans, "chat synthetic")
    assert {hex_ids(s)[0] for s in requests} == ids
    assert all(s.parent is None for s in requests)
    (connection,) = named(spans, CONNECTION_SPAN)
    assert connection.parent is None and hex_ids(connection)[0] not in ids


@one_process_only("reads spans from an exporter in the test's process")
async def test_failed_requests_have_error_spans(
    make_server: Callable[..., RunningServer],
) -> None:
    tracing, exporter = memory_tracing()
    server = make_server([slow_engine(tokens_per_s=100)], tracing=tracing, max_running=1,
                         max_waiting=0)  # fmt: skip
    busy, _ = await open_session(server.url)
    other, _ = await open_session(server.url)
    async with busy, other:
        await busy.send(json.dumps({"prompt": "long", "max_tokens": 200}))
        while (await recv_json(busy))["type"] != "token":
            pass
        refused = await generate(other, prompt="x", max_tokens=2)
        await busy.send(json.dumps({"type": "cancel"}))
        cancelled = await collect(busy)
    assert refused[-1]["error"]["code"] == "overloaded"
    assert cancelled[-1]["finish_reason"] == "cancelled"
    spans = await spans_when(exporter, lambda s: len(named(s, "chat synthetic")) == 2)
    by_outcome = {
        (s.attributes or {})["seedance.outcome"]: s for s in named(spans, "chat synthetic")
    }
    overloaded = by_outcome["overloaded"]
    assert overloaded.status.status_code is StatusCode.ERROR
    assert (overloaded.attributes or {})["error.type"] == "overloaded"
    assert set(children(spans, overloaded)) == {"queue"}  # never admitted
    ok = by_outcome["cancelled"]
    assert ok.status.status_code is StatusCode.UNSET
    assert (ok.attributes or {})["gen_ai.response.finish_reasons"] == ("cancelled",)


@one_process_only("reads spans from an exporter in the test's process")
async def test_trace_tokens_records_each_token_by_seq(
    make_server: Callable[..., RunningServer],
) -> None:
    tracing, exporter = memory_tracing(trace_tokens=True)
    server = make_server([slow_engine(tokens_per_s=400)], tracing=tracing)
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="x", max_tokens=40)
    done = frames[-1]
    spans = await spans_when(exporter, lambda s: bool(named(s, "chat synthetic")))
    attributes = named(spans, "chat synthetic")[0].attributes or {}
    emit = list(attributes["seedance.token.emit_ms"])  # type: ignore[arg-type]
    assert len(emit) == 40 == done["usage"]["completion_tokens"]
    assert emit == sorted(emit)
    assert emit[0] == pytest.approx(done["timing"]["ttft_ms"], abs=0.01)
    assert emit[-1] <= done["timing"]["total_ms"]
    slowest = attributes["seedance.token.slowest_seq"]
    assert isinstance(slowest, int) and 0 <= slowest < 40
    gaps = [b - a for a, b in zip([0.0, *emit], emit, strict=False)]
    assert attributes["seedance.token.slowest_gap_ms"] == pytest.approx(max(gaps), abs=0.01)


@one_process_only("reads spans from an exporter in the test's process")
async def test_untraced_servers_still_carry_the_trace_id(server: RunningServer) -> None:
    assert not server.state.tracing.enabled  # nothing configured: no spans are made
    ws, _ = await open_session(server.url, additional_headers={"traceparent": TRACEPARENT})
    async with ws:
        frames = await generate(ws, prompt="x", max_tokens=2)
        field = await generate(
            ws, prompt="x", max_tokens=2, traceparent=f"00-{'1' * 32}-{'2' * 16}-01"
        )
    assert frames[0]["trace_id"] == TRACE == frames[-1]["trace_id"]
    assert field[-1]["trace_id"] == "1" * 32
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "x"}]}
        passed = await client.post(
            "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}
        )
        fresh = await client.post("/v1/chat/completions", json=body)
    assert passed.headers["traceparent"] == TRACEPARENT  # handed on as it came
    match = HEX_TRACEPARENT.fullmatch(fresh.headers["traceparent"])
    assert match and match.group(1) != TRACE and fresh.headers["traceparent"].endswith("-00")


@pytest.mark.slow
@one_process_only("reads spans from an exporter in the test's process")
async def test_unsampled_requests_keep_their_ids_and_export_nothing(
    make_server: Callable[..., RunningServer],
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)  # as OTEL_TRACES_SAMPLER=always_off
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = make_server(tracing=Tracing(provider, trace_tokens=True))
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="x", max_tokens=3)
    assert re.fullmatch(r"[0-9a-f]{32}", frames[-1]["trace_id"])
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "x"}]}
        reply = await client.post("/v1/chat/completions", json=body)
    assert HEX_TRACEPARENT.fullmatch(reply.headers["traceparent"])
    assert reply.headers["traceparent"].endswith("-00")  # not sampled
    await asyncio.sleep(0.2)
    assert exporter.get_finished_spans() == ()


# --------------------------------------------------------------------------- HTTP API


@pytest.mark.parametrize("stream", [False, True])
@one_process_only("reads spans from an exporter in the test's process")
async def test_http_traceparent_header_in_and_out(
    make_server: Callable[..., RunningServer], stream: bool
) -> None:
    tracing, exporter = memory_tracing()
    server = make_server(tracing=tracing)
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": stream,
    }
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        reply = await client.post(
            "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}
        )
        refused = await client.post(
            "/v1/chat/completions", json={**body, "model": "nope"}, headers={}
        )
    assert reply.status_code == 200 and refused.status_code == 404
    match = HEX_TRACEPARENT.fullmatch(reply.headers["traceparent"])
    assert match and match.group(1) == TRACE
    spans = await spans_when(exporter, lambda s: len([x for x in s if x.parent is None or
                                                      x.name.startswith("chat")]) >= 2)  # fmt: skip
    (span,) = named(spans, "chat synthetic")
    assert hex_ids(span) == (TRACE, match.group(2))
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT
    attributes = span.attributes or {}
    assert attributes["url.path"] == "/v1/chat/completions"
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert set(children(spans, span)) == {"queue", "prefill", "decode"}
    # A refused request has its span too, and its id in the error's headers.
    (failed,) = named(spans, "chat")
    assert failed.status.status_code is StatusCode.ERROR
    assert (failed.attributes or {})["error.type"] == "model_not_found"
    assert refused.headers["traceparent"] == "00-{}-{}-01".format(*hex_ids(failed))


# --------------------------------------------------------------------------- OTLP export


@pytest.mark.slow
@one_process_only("reads spans from an exporter in the test's process")
async def test_spans_reach_an_otlp_http_receiver(make_server: Callable[..., RunningServer]) -> None:
    with http_receiver() as (url, received):
        server = make_server(otlp_endpoint=url, trace_tokens=True)
        assert server.state.tracing.enabled
        ws, _ = await open_session(server.url, additional_headers={"traceparent": TRACEPARENT})
        async with ws:
            frames = await generate(ws, prompt="x", max_tokens=3, seed=2**64 - 1)
        await asyncio.to_thread(server.stop)  # shutdown exports what is buffered
        spans = received.spans
    assert frames[-1]["trace_id"] == TRACE
    names = sorted(s.name for s in spans)
    assert names == sorted([CONNECTION_SPAN, "chat synthetic", "queue", "prefill", "decode"])
    (request,) = [s for s in spans if s.name == "chat synthetic"]
    assert request.trace_id == TRACE and request.parent_span_id == PARENT
    assert request.service == "seedance"
    assert request.events == ["first_token", "end"]
    assert len(request.attributes["seedance.token.emit_ms"]) == 3
    assert request.attributes["seedance.request_id"] == frames[0]["request_id"]
    # OTLP integers are 64-bit signed: a seed above them travels as text.
    assert request.attributes["gen_ai.request.seed"] == str(2**64 - 1)


@pytest.mark.subprocess
def test_spans_reach_an_otlp_grpc_receiver_from_the_environment(
    server_process: Callable[..., ServerProcess],
) -> None:
    from websockets.sync.client import connect

    with grpc_receiver() as (url, received):
        proc = server_process(
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": url,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_SERVICE_NAME": "seedance-test",
                "OTEL_BSP_SCHEDULE_DELAY": "100",
            }
        )
        with connect(f"{proc.url}/v2/infer", additional_headers={"traceparent": TRACEPARENT}) as ws:
            ws.recv()  # session
            ws.send(json.dumps({"prompt": "x", "max_tokens": 3}))
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                data = ws.recv(timeout=10)
                if isinstance(data, str):
                    frames.append(json.loads(data))
        # Exported within the batch delay, while the server runs.
        spans = received.wait_for(lambda s: any(x.name == "chat synthetic" for x in s))
        proc.signal(signal.SIGTERM)
        assert proc.wait() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    (request,) = [s for s in spans if s.name == "chat synthetic"]
    assert request.trace_id == TRACE == frames[-1]["trace_id"]
    assert request.service == "seedance-test"
    # Log lines name the request and its trace.
    request_id = frames[0]["request_id"]
    lines = [line for line in proc.lines if f"request_id={request_id} trace_id={TRACE}" in line]
    assert any(f"request {request_id} " in line for line in lines), proc.output


# --------------------------------------------------------------------------- configuration


def test_exporter_choice_follows_flags_and_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    plain = ServerConfig().tracing
    assert otlp_exporter(plain, {}) is None
    flagged = ServerConfig.of(otlp_endpoint="http://collector:4318").tracing
    exporter = otlp_exporter(flagged, {})
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://collector:4318/v1/traces"
    assert isinstance(otlp_exporter(plain, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}),
                      HttpExporter)  # fmt: skip
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert isinstance(otlp_exporter(plain, env), GrpcExporter)
    assert otlp_exporter(flagged, {"OTEL_SDK_DISABLED": "true"}) is None
    assert otlp_exporter(flagged, {"OTEL_TRACES_EXPORTER": "none"}) is None
    with pytest.raises(ConfigError, match="http/json"):
        otlp_exporter(flagged, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ConfigError, match=r"seedance\[otlp-grpc\]"):
        grpc = ServerConfig.of(otlp_endpoint="http://c:4317", otlp_protocol="grpc")
        otlp_exporter(grpc.tracing, {})


@pytest.mark.subprocess
def test_serve_refuses_a_bad_otlp_setting() -> None:
    assert "--otlp-protocol" in serve_fails("--otlp-protocol", "carrier-pigeon")
    assert "--otlp-endpoint" in serve_fails("--otlp-endpoint", "collector:4318")


@pytest.mark.slow
async def test_one_trace_spans_the_client_the_gateway_and_its_upstream(
    make_server: Callable[..., RunningServer],
) -> None:
    """A gateway sends its request span's ``traceparent`` (and the client's ``tracestate``)
    on to the upstream: an upstream Seedance's request span is its child, both in the trace
    the client began, as a real OTLP receiver gets them."""
    with http_receiver() as (url, received):
        upstream = make_server(otlp_endpoint=url)
        gateway = make_server(
            engine="openai", upstream=(f"{upstream.http_url}/v1",), otlp_endpoint=url
        )
        headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=7"}
        async with httpx.AsyncClient(base_url=gateway.http_url) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            reply = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(upstream.stop)
        spans = received.spans
    requests = [s for s in spans if s.name == "chat synthetic"]  # the upstream's model
    assert len(requests) == 2 and {s.trace_id for s in requests} == {TRACE}, spans
    (edge,) = [s for s in requests if s.parent_span_id == PARENT]  # the client's span
    (inner,) = [s for s in requests if s is not edge]
    assert inner.parent_span_id == edge.span_id  # the gateway's request span
    assert edge.attributes["seedance.engine"] == "openai"
    assert inner.attributes["seedance.engine"] == "synthetic"
