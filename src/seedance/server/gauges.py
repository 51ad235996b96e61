"""The figures of a server that describe the present (connections, sessions, admission, the
engines' KV cache and requests, GPU memory), read from its state when Prometheus scrapes: the
server registers them with its :class:`~seedance.observability.metrics.Metrics`, so they cost
nothing between scrapes and each server in a process reports its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric

from seedance.observability.gpu import GpuMemory
from seedance.observability.metrics import MODEL_LABELS, gauge

if TYPE_CHECKING:
    from seedance.server.lifecycle.services import Services


def state_metrics(state: Services, gpu: GpuMemory | None) -> Iterator[Metric]:
    """The gauges of a server, read when Prometheus scrapes."""
    connections = gauge("seedance_connections", "Open WebSocket connections.")
    connections.add_metric([], state.peers.count("infer"))
    sessions = gauge("seedance_sessions", "Live sessions in the session store.")
    sessions.add_metric([], len(state.sessions))
    history = gauge(
        "seedance_session_history_bytes", "History held by the sessions (see --max-session-bytes)."
    )
    history.add_metric([], state.sessions.bytes)
    running = gauge("seedance_requests_running", "Generations admitted and running.", MODEL_LABELS)
    waiting = gauge("seedance_requests_waiting", "Generations waiting for admission.", MODEL_LABELS)
    running_limit = gauge(
        "seedance_requests_running_limit", "Generations run at once at most.", MODEL_LABELS
    )
    waiting_limit = gauge(
        "seedance_requests_waiting_limit", "Length of the admission queue.", MODEL_LABELS
    )
    kv = gauge(
        "seedance_kv_cache_usage_ratio", "Share of the engine's KV cache in use.", MODEL_LABELS
    )
    inside = gauge(
        "seedance_engine_requests",
        "Requests the engine itself holds, running or queued inside it.",
        MODEL_LABELS,
    )
    prompted = CounterMetricFamily(
        "seedance_engine_prompt_tokens",
        "Prompt tokens the engine was given (where it counts its prompt cache).",
        labels=list(MODEL_LABELS),
    )
    cached = CounterMetricFamily(
        "seedance_engine_prompt_cached_tokens",
        "Of those, the tokens that came from the engine's cache (a session's earlier turns, a "
        "shared prefix) instead of a prefill.",
        labels=list(MODEL_LABELS),
    )
    for model in state.models.values():
        labels = [model.name, model.engine.info.engine]
        admission = model.admission
        running.add_metric(labels, admission.running)
        waiting.add_metric(labels, admission.waiting)
        running_limit.add_metric(labels, admission.max_running)
        waiting_limit.add_metric(labels, admission.max_waiting)
        usage = model.engine.kv_cache_usage()
        if usage is not None:
            kv.add_metric(labels, usage)
        held = model.engine.unfinished_requests()
        if held is not None:
            inside.add_metric(labels, held)
        cache = model.engine.prompt_cache()
        if cache is not None:
            prompted.add_metric(labels, cache[0])
            cached.add_metric(labels, cache[1])
    merged = CounterMetricFamily(
        "seedance_frames_merged",
        "Token deltas that joined an earlier token frame instead of making their own.",
    )
    merged.add_metric([], state.merger.merged if state.merger is not None else 0)
    yield from (
        connections,
        sessions,
        history,
        running,
        waiting,
        running_limit,
        waiting_limit,
        merged,
    )
    if kv.samples:
        yield kv
    if inside.samples:
        yield inside
    if prompted.samples:
        yield from (prompted, cached)
    if gpu is not None:
        yield from gpu.collect()
