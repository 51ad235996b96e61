"""OpenTelemetry traces: a span per connection and per request, exported over OTLP.

Every request has a W3C trace id, whether or not spans are exported: it comes from the client's
``traceparent`` (the WebSocket handshake's header, a ``generate`` frame's field, or an HTTP
request's header) or is new. ``start`` and ``done`` frames carry it, and the HTTP API returns a
``traceparent`` header, so a token is addressable as (``trace_id``, ``seq``).

Spans are made only when an exporter is configured (``--otlp-endpoint`` or the standard
``OTEL_EXPORTER_OTLP_*`` variables); otherwise :class:`Tracing` makes ids and nothing else. A
request's span is opened when the request is read; its children (``queue``, ``prefill``,
``decode``) and events (``first_token``, ``end``) are written when it ends, from the times the
request already keeps, so the token path does no tracing work (with ``--trace-tokens``, one
list append per token frame).

Each request is a trace of its own (a connection may live for hours): its span's parent is the
client's ``traceparent``, and it links to its connection's span.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from seedance import __version__
from seedance.config import OTLP_PROTOCOLS, ConfigError
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import ms

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from seedance.config import TracingConfig
    from seedance.protocol.messages import Generate

logger = logging.getLogger(__name__)

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_GRPC_EXTRA: Final = "pip install 'seedance[otlp-grpc]'"

Attributes = Mapping[str, str | bool | int | float | Sequence[str] | Sequence[float]]


class Tracing:
    """The server's tracer, or only its ids when nothing is exported (``provider`` None)."""

    def __init__(self, provider: TracerProvider | None = None, *, trace_tokens: bool = False):
        self.provider = provider
        self.enabled = provider is not None
        self.trace_tokens = trace_tokens and self.enabled
        self._tracer = provider.get_tracer("seedance", __version__) if provider else None

    @classmethod
    def from_config(cls, config: TracingConfig, environ: Mapping[str, str] = os.environ) -> Tracing:
        """Spans exported over OTLP when an endpoint is configured; ids only otherwise."""
        exporter = otlp_exporter(config, environ)
        if exporter is None:
            return cls()
        return cls(batch_provider(exporter), trace_tokens=config.trace_tokens)

    def shutdown(self) -> None:
        """Export what is buffered, then stop (spans after this are dropped)."""
        if self.provider is not None:
            self.provider.shutdown()

    # ------------------------------------------------------------------ incoming contexts

    @staticmethod
    def from_headers(headers: Iterable[tuple[bytes, bytes]]) -> otel_context.Context | None:
        """The client's context from ASGI headers; None without a valid ``traceparent`` (the
        W3C rule: an invalid one is ignored and a new trace starts)."""
        carrier = {}
        for name, value in headers:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode("latin-1")] = value.decode("latin-1")
        if "traceparent" not in carrier:
            return None
        return _valid(_PROPAGATOR.extract(carrier))

    @staticmethod
    def from_field(value: str) -> otel_context.Context:
        """The context named by a ``generate`` frame's ``traceparent`` field."""
        context = _valid(_PROPAGATOR.extract({"traceparent": value}))
        if context is None:
            raise InvalidRequest(
                "traceparent: not a W3C traceparent (00-<32 hex trace id>-<16 hex span id>-"
                f"<2 hex flags>): {value[:80]!r}"
            )
        return context

    # ------------------------------------------------------------------ spans

    def connection(
        self, parent: otel_context.Context | None, attributes: Callable[[], Attributes]
    ) -> ConnectionTrace:
        if self._tracer is None:
            return ConnectionTrace(None)
        span = self._tracer.start_span(
            "WebSocket /v2/infer",
            parent or otel_context.Context(),
            SpanKind.SERVER,
            attributes=attributes(),
        )
        return ConnectionTrace(span)

    def request(
        self,
        name: str,
        parent: otel_context.Context | None,
        received: float,
        attributes: Callable[[], Attributes],
        link: ConnectionTrace | None = None,
    ) -> RequestTrace:
        """A request read at ``received`` (``time.monotonic()``), as a child of ``parent``;
        ``attributes`` is called only when spans are recorded."""
        if self._tracer is None:
            return RequestTrace.untraced(parent)
        state = _tracestate(parent)
        clock = _WallClock()
        links: tuple[Link, ...] = ()
        if link is not None and link.span is not None:
            links = (Link(link.span.get_span_context()),)
        span = self._tracer.start_span(
            name,
            parent or otel_context.Context(),
            SpanKind.SERVER,
            attributes=attributes(),
            links=links,
            start_time=clock.ns(received),
        )
        if not span.is_recording():  # not sampled: ids only
            return RequestTrace(None, None, None, _ids(span.get_span_context()), tracestate=state)
        token_times: list[tuple[float, int]] | None = [] if self.trace_tokens else None
        return RequestTrace(
            self._tracer, span, clock, _ids(span.get_span_context()), token_times, state
        )


class ConnectionTrace:
    """A connection's span (None when nothing is exported)."""

    __slots__ = ("span",)

    def __init__(self, span: trace.Span | None) -> None:
        self.span = span

    def end(self, close_code: int | None, requests: int) -> None:
        if self.span is None:
            return
        self.span.set_attributes(
            {"seedance.close_code": 1006 if close_code is None else close_code,
             "seedance.requests": requests}
        )  # fmt: skip
        self.span.end()


class RequestTrace:
    """One request's trace id and, when spans are exported, its span."""

    __slots__ = (
        "_clock",
        "_tracer",
        "sampled",
        "span",
        "span_id",
        "token_times",
        "trace_id",
        "tracestate",
    )

    def __init__(
        self,
        tracer: trace.Tracer | None,
        span: trace.Span | None,
        clock: _WallClock | None,
        ids: tuple[str, str, bool],
        token_times: list[tuple[float, int]] | None = None,
        tracestate: str | None = None,
    ) -> None:
        self._tracer = tracer
        self.span = span
        self._clock = clock
        self.trace_id, self.span_id, self.sampled = ids
        #: (time.monotonic(), tokens) per token frame, with ``--trace-tokens``.
        self.token_times = token_times
        #: The client's W3C ``tracestate``, passed on with :attr:`traceparent` (None: none).
        self.tracestate = tracestate

    @classmethod
    def untraced(cls, parent: otel_context.Context | None) -> RequestTrace:
        """Ids without a span: the client's, or new ones (not sampled: nothing is recorded)."""
        if parent is not None:
            context = trace.get_current_span(parent).get_span_context()
            return cls(None, None, None, _ids(context), tracestate=_tracestate(parent))
        # As OpenTelemetry's own id generator: random, not secret (ids are not credentials).
        trace_id = format(random.getrandbits(128) or 1, "032x")
        return cls(None, None, None, (trace_id, format(random.getrandbits(64) or 1, "016x"), False))

    @property
    def traceparent(self) -> str:
        """The W3C header naming this request's span (the client's own when untraced)."""
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def end(
        self,
        *,
        received: float,
        admitted: float | None,
        first_token: float | None,
        last_token: float | None,
        outcome: str,
        error: tuple[str, str] | None,
        attributes: Attributes,
    ) -> None:
        """Close the span, with its children and events, from the request's own times
        (``time.monotonic()``); ``error`` is (code, message)."""
        span, tracer, clock = self.span, self._tracer, self._clock
        if span is None or tracer is None or clock is None:
            return
        end = time.monotonic()
        parent = trace.set_span_in_context(span, otel_context.Context())

        def child(name: str, start: float, stop: float) -> None:
            tracer.start_span(name, parent, start_time=clock.ns(start)).end(clock.ns(stop))

        child("queue", received, admitted if admitted is not None else end)
        if admitted is not None:
            child("prefill", admitted, first_token if first_token is not None else end)
            if first_token is not None:
                child("decode", first_token, last_token if last_token is not None else end)
        if first_token is not None:
            span.add_event(
                "first_token",
                {"seedance.ttft_ms": ms(first_token - received)},
                clock.ns(first_token),
            )
        span.add_event("end", {"seedance.outcome": outcome}, clock.ns(end))
        span.set_attributes(attributes)
        span.set_attribute("seedance.outcome", outcome)
        if error is None and outcome != "aborted":  # a finish reason, or cancelled
            span.set_attribute("gen_ai.response.finish_reasons", [outcome])
        if self.token_times:
            span.set_attributes(_token_attributes(self.token_times, received))
        if error is not None:
            span.set_attribute("error.type", error[0])
            span.set_status(Status(StatusCode.ERROR, error[1]))
        span.end(clock.ns(end))


def request_attributes(message: Generate) -> dict[str, str | int | float]:
    """A request's sampling settings, as OpenTelemetry's GenAI conventions name them."""
    attributes: dict[str, str | int | float] = {
        "gen_ai.request.max_tokens": message.max_tokens,
        "gen_ai.request.temperature": message.temperature,
        "gen_ai.request.top_p": message.top_p,
    }
    if message.seed is not None:  # OTLP integers are 64-bit signed; seeds go to 2^64 - 1
        seed = message.seed
        attributes["gen_ai.request.seed"] = seed if seed < 2**63 else str(seed)
    # Typed output: what the reply is bound to, and what it carries.
    if message.schema is not None:
        attributes["gen_ai.output.type"] = "json"
    if message.tools:
        attributes["seedance.request.tools"] = len(message.tools)
        choice = message.tool_choice
        attributes["seedance.request.tool_choice"] = (
            choice if isinstance(choice, str) else "function" if choice else "auto"
        )
    if message.logprobs is not None:
        attributes["seedance.request.top_logprobs"] = message.logprobs
    return attributes


def _token_attributes(times: list[tuple[float, int]], received: float) -> Attributes:
    """Each token's emit time in ms after the request was read, indexed by its ``seq``, and
    the slowest gap (a frame of n tokens: n tokens at the same time)."""
    emit: list[float] = []
    slowest_seq, slowest_gap = 0, 0.0
    previous = received
    for at, count in times:
        if at - previous > slowest_gap:
            slowest_seq, slowest_gap = len(emit), at - previous
        emit.extend([ms(at - received)] * count)
        previous = at
    return {
        "seedance.token.emit_ms": emit,
        "seedance.token.slowest_seq": slowest_seq,
        "seedance.token.slowest_gap_ms": ms(slowest_gap),
    }


class _WallClock:
    """Turns ``time.monotonic()`` readings into the epoch nanoseconds spans need."""

    __slots__ = ("_offset",)

    def __init__(self) -> None:
        self._offset = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic: float) -> int:
        return self._offset + int(monotonic * 1e9)


def _ids(context: SpanContext) -> tuple[str, str, bool]:
    return (
        format(context.trace_id, "032x"),
        format(context.span_id, "016x"),
        context.trace_flags.sampled,
    )


def _tracestate(parent: otel_context.Context | None) -> str | None:
    """The ``tracestate`` header of the client's context (None: none, or empty)."""
    if parent is None:
        return None
    state = trace.get_current_span(parent).get_span_context().trace_state
    return state.to_header() or None if state else None


def _valid(context: otel_context.Context) -> otel_context.Context | None:
    return context if trace.get_current_span(context).get_span_context().is_valid else None


# ---------------------------------------------------------------------- export


def otlp_exporter(config: TracingConfig, environ: Mapping[str, str]) -> SpanExporter | None:
    """The OTLP exporter ``--otlp-endpoint`` or the ``OTEL_*`` variables ask for, or None."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    endpoint = config.otlp_endpoint
    from_env = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint is None and not from_env:
        return None
    protocol = (
        config.otlp_protocol
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ConfigError(f"OTLP over gRPC needs the otlp-grpc extra: {_GRPC_EXTRA}") from None
        return GrpcExporter(endpoint=endpoint)  # None: the exporter reads OTEL_* itself
    if protocol != "http/protobuf":
        raise ConfigError(
            f"OTLP protocol {protocol!r} is not supported; use one of {', '.join(OTLP_PROTOCOLS)}"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    if endpoint is not None and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


def batch_provider(exporter: SpanExporter) -> TracerProvider:
    """A provider exporting from a background thread (the event loop never waits on it)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = new_provider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def new_provider() -> TracerProvider:
    """A provider of this server's own (not the process's global one), named ``seedance``
    unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` name the service; its
    sampler follows ``OTEL_TRACES_SAMPLER`` (default: the parent's decision, else always)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "seedance"}))
    return TracerProvider(resource=resource)
