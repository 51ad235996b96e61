"""What the worker processes of ``--workers N`` share with each other and their supervisor
(:mod:`seedance.server.workers`): the port, the word that a worker serves, and their metrics
(``/metrics`` on any worker answers for all of them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Final

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from seedance.config import WorkerSetup
from seedance.observability.metrics import render_families


def bind_shared(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, not listening: what a worker
    listens on, or (the supervisor's) what holds the port while the workers come and go."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    return sock


def serving_what(folder: str, pid: int) -> tuple[str, str] | None:
    """What worker ``pid`` serves (its model and engine), once it serves."""
    try:
        model, engine = (Path(folder) / f"serving-{pid}").read_text().rsplit(" ", 1)
    except (FileNotFoundError, ValueError):  # not yet, or half written
        return None
    return model, engine


def serving(setup: WorkerSetup, model: str, engine: str) -> None:
    """In a worker, once it serves: tell the supervisor (and what it serves)."""
    (Path(setup.folder) / f"serving-{os.getpid()}").write_text(f"{model} {engine}")


async def share_metrics(setup: WorkerSetup, render: Callable[[], bytes]) -> asyncio.Server:
    """In a worker: hand this worker's metrics to the other workers (a Unix socket in the
    supervisor's private folder; each connection gets the text and is closed)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(render())
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    path = Path(setup.folder) / f"metrics-{setup.index}.sock"
    path.unlink(missing_ok=True)  # this worker's predecessor's
    return await asyncio.start_unix_server(answer, path=str(path))


async def all_metrics(setup: WorkerSetup, own: bytes) -> bytes:
    """In a worker: ``/metrics`` for the whole server, every worker's added up (a counter, a
    gauge, a histogram's buckets: summed; a start time: the earliest; a gauge of
    :data:`SEEN_ALIKE`: once). A worker that does not
    answer within a second (dead, starting again) is left out."""

    async def fetch(path: Path) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(path))
        try:
            return await reader.read()
        finally:
            writer.close()

    folder = Path(setup.folder)
    others = [folder / f"metrics-{i}.sock" for i in range(setup.count) if i != setup.index]
    texts = [own]
    for result in await asyncio.gather(
        *(asyncio.wait_for(fetch(path), 1.0) for path in others), return_exceptions=True
    ):
        if isinstance(result, bytes):
            texts.append(result)
    return merge_metrics([text.decode() for text in texts])


#: Gauges that every worker reads off the same thing, taken once instead of added up: the
#: shared engine process's KV cache (server/gauges.py), a device's memory
#: (observability/gpu.py), and the certificate's expiry (server/tls.py: the earliest, in case
#: one worker has not reloaded it yet).
SEEN_ALIKE: Final = {
    "seedance_kv_cache_usage_ratio": max,
    "seedance_gpu_memory_used_bytes": max,
    "seedance_gpu_memory_total_bytes": max,
    "seedance_tls_certificate_expiry_timestamp_seconds": min,
}


def merge_metrics(texts: list[str]) -> bytes:
    """Prometheus text expositions added up into one (see :func:`all_metrics`)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            table = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                earlier = table.get(key)
                if earlier is None:
                    table[key] = sample.value
                elif sample.name.endswith(("_start_time_seconds", "_created")):
                    table[key] = min(earlier, sample.value)
                elif family.type in ("info", "stateset"):
                    table[key] = max(earlier, sample.value)
                elif family.name in SEEN_ALIKE:
                    table[key] = SEEN_ALIKE[family.name](earlier, sample.value)
                else:
                    table[key] = earlier + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return render_families(families.values())
