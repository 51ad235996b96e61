"""Prometheus metrics, served on ``GET /metrics`` in the text format (``prometheus-client``).

Events that happen per request (first token, end, queue time) are observed as they happen, with
labels for the model and engine only (never session or request ids, which would make a series
per request). Figures that describe the present (open connections, live sessions, running and
waiting generations, KV slots, GPU memory) are read from the server's state when Prometheus
scrapes, so they cost nothing between scrapes. Names mirror vLLM's where the meaning is the
same (``..._time_to_first_token_seconds``, ``..._inter_token_latency_seconds``); every name is
listed in docs/observability.md.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from seedance.protocol.qos import QoS

#: Latency buckets: milliseconds resolved at the low end, minutes at the top; 0.8 s is the
#: design's threshold (deploy/prometheus/rules.yml: the SLO alerts count what passed it).
LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
MODEL_LABELS: Final = ("model", "engine")
#: Labels of the series observed per request: the model, its engine, and the tenant.
REQUEST_LABELS: Final = ("model", "engine", "tenant")
S = TypeVar("S")
#: Exported only where they mean something: GPU memory (a GPU and NVML), KV usage and the
#: requests inside the engine (engines that know them), the TLS certificate (with --tls-cert).
CONDITIONAL_METRICS: Final = (
    "seedance_gpu_memory_used_bytes",
    "seedance_gpu_memory_total_bytes",
    "seedance_kv_cache_usage_ratio",
    "seedance_engine_requests",
    "seedance_engine_prompt_tokens",  # engines that count their prompt cache
    "seedance_engine_prompt_cached_tokens",
    "seedance_tls_certificate_expiry_timestamp_seconds",  # with --tls-cert
    "seedance_tls_certificate_reloads",
)
#: Distinct ``slatag`` values given series of their own; later ones are counted as "other"
#: (client-chosen labels must not grow the series without bound).
MAX_SLATAGS: Final = 100


class Metrics:
    """The server's metrics, in a registry of its own (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def histogram(name: str, doc: str, labels: Iterable[str] = REQUEST_LABELS) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = histogram(
            "seedance_time_to_first_token_seconds",
            "From reading the request to sending its first token.",
        )
        # Observed once per token: series of our own, without prometheus-client's locks.
        self.itl = TokenHistogram(
            "seedance_inter_token_latency_seconds",
            "Between two tokens of a reply (a delta of n tokens counts n gaps of its mean).",
        )
        r.register(self.itl)
        self.e2e = histogram(
            "seedance_e2e_request_latency_seconds",
            "From reading the request to its end (done, error or cancel).",
        )
        self.queue = histogram(
            "seedance_request_queue_time_seconds",
            "From reading the request to its admission (waiting for a free slot).",
        )
        self.heartbeat_rtt = histogram(
            "seedance_heartbeat_round_trip_seconds",
            "From the server's heartbeat ping to the client's pong.",
            labels=(),
        )
        self.requests = Counter(
            "seedance_requests",
            "Requests ended, by outcome (a finish reason, an error code, cancelled, aborted).",
            [*REQUEST_LABELS, "outcome"],
            registry=r,
        )
        self.tool_calls = Counter(
            "seedance_tool_calls",
            "Tool calls made by replies (each checked against its tool's schema).",
            REQUEST_LABELS,
            registry=r,
        )
        self.module_calls = Counter(
            "seedance_module_calls",
            "Tenants' WebAssembly modules run for a request, by module, role (preprocess, "
            "filter, postprocess, run) and outcome (ok, refused, or the reason it failed: trap, "
            "fuel, timeout, memory, ...); a filter counts once per reply",
            ["module", "role", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "seedance_prompt_tokens",
            "Prompt tokens of admitted requests.",
            REQUEST_LABELS,
            registry=r,
        )
        self.generation_tokens = TokenCounter(
            "seedance_generation_tokens", "Tokens generated and sent."
        )
        r.register(self.generation_tokens)
        self.connections_opened = Counter(
            "seedance_connections_opened", "WebSocket connections accepted.", registry=r
        )
        self.connections_closed = Counter(
            "seedance_connections_closed",
            "WebSocket connections ended, by close code (1006: dropped without a close).",
            ["code"],
            registry=r,
        )
        # End-to-end encryption (docs/protocol.md, section 9).
        self.encrypted_connections = Counter(
            "seedance_encrypted_connections",
            "WebSocket connections that agreed end-to-end encryption.",
            registry=r,
        )
        self.stream_key_rotations = Counter(
            "seedance_stream_key_rotations",
            "Keys of end-to-end encrypted connections moved to the next, by direction.",
            ["direction"],
            registry=r,
        )
        self.encryption_failures = Counter(
            "seedance_encryption_failures",
            "End-to-end encrypted connections closed because a frame or the agreement was "
            "refused, by reason (bad_tag, replayed, reordered, plaintext, ...).",
            ["reason"],
            registry=r,
        )
        self.refused_calls = Counter(
            "seedance_refused",
            "WebSocket connections and HTTP requests refused before they started, by API and "
            "error code (unauthorized, forbidden, quota_exceeded, overloaded, ...).",
            ["api", "code"],
            registry=r,
        )
        # Per service level (X-QoS-Priority): TTFT and outcomes by SLA tag and class.
        self.slo_ttft = histogram(
            "seedance_slo_time_to_first_token_seconds",
            "Time to first token by the requests' SLA tag and QoS class.",
            labels=("slatag", "qos_class"),
        )
        self.slo_requests = Counter(
            "seedance_slo_requests",
            "Requests ended by SLA tag, QoS class and outcome (a finish reason, an error code, "
            "cancelled, aborted).",
            ["slatag", "qos_class", "outcome"],
            registry=r,
        )
        self.slo_health = Histogram(
            "seedance_slo_client_health_score",
            "The health score clients reported with their requests (X-QoS-Priority), by tag.",
            ["slatag"],
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
            registry=r,
        )
        # Per version of a registry's model (a canary beside its stable version).
        self.version_ttft = histogram(
            "seedance_model_version_time_to_first_token_seconds",
            "Time to first token by model and version (models served from a registry).",
            labels=("model", "version"),
        )
        self.version_requests = Counter(
            "seedance_model_version_requests",
            "Requests ended by model, version and outcome (models served from a registry).",
            ["model", "version", "outcome"],
            registry=r,
        )
        self._slatags: set[str] = set()

    def slatag(self, tag: str | None) -> str:
        """The label of ``tag``: itself while fewer than :data:`MAX_SLATAGS` were seen, else
        ``other``; ``none`` without one."""
        if tag is None:
            return "none"
        if tag not in self._slatags:
            if len(self._slatags) >= MAX_SLATAGS:
                return "other"
            self._slatags.add(tag)
        return tag

    def refused(self, code: str, api: str = "websocket") -> None:
        self.refused_calls.labels(api, code).inc()

    def add_collector(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Figures read at scrape time: ``collect`` yields metric families."""
        self.registry.register(_Live(collect))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render_families(families: Iterable[Metric]) -> bytes:
    """Metric families made elsewhere (another process's, added up), in the text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Live(lambda: families))
    return generate_latest(registry)


class _Live(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names vary with the models served: not checked at registration


def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class _TokenSeries(Collector, Generic[S]):
    """Series by model, engine and tenant, updated from the event loop's thread only (no
    locks)."""

    def __init__(self, name: str, doc: str, new: Callable[[], S]) -> None:
        self.name, self.doc = name, doc
        self._new = new
        self._series: dict[tuple[str, str, str], S] = {}

    def labels(self, model: str, engine: str, tenant: str) -> S:
        key = (model, engine, tenant)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._new()
        return series


class TokenHistogramSeries:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, value)] += times
        self.sum += value * times


class TokenHistogram(_TokenSeries[TokenHistogramSeries]):
    """A histogram by model and engine, observed once per token."""

    def __init__(self, name: str, doc: str) -> None:
        super().__init__(name, doc, TokenHistogramSeries)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(REQUEST_LABELS))
        for labels, series in list(self._series.items()):
            counts, total = list(series.counts), series.sum
            cumulative, running = [], 0
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                running += count
                cumulative.append((_bound(bound), running))
            family.add_metric(list(labels), cumulative, total)
        yield family


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)


class TokenCounterSeries:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class TokenCounter(_TokenSeries[TokenCounterSeries]):
    """A counter by model and engine, increased once per token delta."""

    def __init__(self, name: str, doc: str) -> None:
        super().__init__(name, doc, TokenCounterSeries)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=list(REQUEST_LABELS))
        for labels, series in list(self._series.items()):
            family.add_metric(list(labels), series.value)
        yield family


class RequestMeter:
    """One request's observations, with its labelled series looked up once. It keeps the
    times of the request's first and last token, and appends each token delta's time and count
    to ``record`` when given one (the trace's, with ``--trace-tokens``)."""

    __slots__ = (
        "_e2e",
        "_itl",
        "_labels",
        "_metrics",
        "_slo",
        "_tokens",
        "_version",
        "first_token",
        "last_token",
        "received",
        "record",
    )

    def __init__(
        self,
        metrics: Metrics,
        model: str,
        engine: str,
        tenant: str,
        received: float,
        record: list[tuple[float, int]] | None = None,
        qos: QoS | None = None,
        version: str = "",
    ) -> None:
        self._metrics = metrics
        self._labels = (model, engine, tenant)
        #: The model and version labels (None: not a registry's model).
        self._version = (model, version) if version else None
        #: The SLA tag and class labels (None: no QoS asked).
        self._slo: tuple[str, str] | None = None
        if qos is not None:
            tag = metrics.slatag(qos.slatag)
            self._slo = (tag, qos.service_class)
            if qos.health_score is not None:
                metrics.slo_health.labels(tag).observe(qos.health_score)
        self.received = received
        self.record = record
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._itl = metrics.itl.labels(model, engine, tenant)
        self._tokens = metrics.generation_tokens.labels(model, engine, tenant)
        self._e2e = metrics.e2e.labels(model, engine, tenant)

    def admitted(self, now: float, prompt_tokens: int) -> None:
        metrics, labels = self._metrics, self._labels
        metrics.queue.labels(*labels).observe(now - self.received)
        metrics.prompt_tokens.labels(*labels).inc(prompt_tokens)

    def tokens(self, now: float, count: int) -> None:
        """``count`` tokens were sent at ``now`` (called per token delta: the two series are
        updated inline, a method call each costs as much as the update)."""
        last, self.last_token = self.last_token, now
        if last is None:
            self.first_token = now
            self._metrics.ttft.labels(*self._labels).observe(now - self.received)
            if self._slo is not None:
                self._metrics.slo_ttft.labels(*self._slo).observe(now - self.received)
            if self._version is not None:
                self._metrics.version_ttft.labels(*self._version).observe(now - self.received)
        elif count > 0:
            itl, gap = self._itl, (now - last) / count
            itl.counts[bisect_left(LATENCY_BUCKETS, gap)] += count
            itl.sum += gap * count
        self._tokens.value += count
        if self.record is not None:
            self.record.append((now, count))

    def ended(self, now: float, outcome: str, tool_calls: int = 0) -> None:
        self._e2e.observe(now - self.received)
        self._metrics.requests.labels(*self._labels, outcome).inc()
        if tool_calls:
            self._metrics.tool_calls.labels(*self._labels).inc(tool_calls)
        if self._slo is not None:
            self._metrics.slo_requests.labels(*self._slo, outcome).inc()
        if self._version is not None:
            self._metrics.version_requests.labels(*self._version, outcome).inc()
