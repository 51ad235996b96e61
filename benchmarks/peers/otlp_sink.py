"""An OTLP/HTTP trace receiver that counts what it is sent: the collector of suite 8.

``POST /v1/traces`` decodes the exporter's ``ExportTraceServiceRequest`` (as a collector must)
and answers as a collector does; ``GET /count`` returns the spans received so far.

    python -m benchmarks.peers.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse
import gzip
from typing import Any

import uvicorn
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

_REPLY = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()


class Sink:
    def __init__(self) -> None:
        self.spans = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["method"] == "POST":
            headers = dict(scope["headers"])
            if headers.get(b"content-encoding") == b"gzip":
                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.spans += sum(
                len(scope_spans.spans)
                for resource_spans in request.resource_spans
                for scope_spans in resource_spans.scope_spans
            )
            reply, kind = _REPLY, b"application/x-protobuf"
        else:
            reply, kind = str(self.spans).encode(), b"text/plain"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        )
        await send({"type": "http.response.body", "body": reply})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    uvicorn.run(Sink(), host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
