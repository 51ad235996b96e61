"""Real OTLP receivers for tests: OTLP/HTTP (protobuf) and OTLP/gRPC, as a collector serves them.

Both decode the exporter's ``ExportTraceServiceRequest`` with the OpenTelemetry protobuf
definitions and keep the spans, with their resource's attributes, in arrival order.
"""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.support.servers import asgi_server


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[str]
    service: str
    status_code: int


@dataclass
class Received:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            ReceivedSpan(
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_span_id=span.parent_span_id.hex(),
                                attributes={a.key: _value(a.value) for a in span.attributes},
                                events=[e.name for e in span.events],
                                service=str(resource.get("service.name")),
                                status_code=span.status.code,
                            )
                        )

    def wait_for(
        self, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if ready(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@contextlib.contextmanager
def http_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver; yields its base URL (``http://127.0.0.1:PORT``) and what came."""
    received = Received()

    async def traces(request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(body)
        received.add(message)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return Response(reply, media_type="application/x-protobuf")

    app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
    with asgi_server(app) as url:
        yield url, received


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver; yields its URL (``http://127.0.0.1:PORT``) and what came."""
    import grpc

    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)
