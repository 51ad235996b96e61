"""Suite 8 of ``make bench``: what observability costs.

1. ``GET /metrics`` with no session and with 10,000 (idle WebSocket connections, each a
   session, pinging the server): how long a scrape takes and how big it is. The gauges are
   read at scrape time, so the scrape must not grow with the sessions.
2. Traces: the same load on a server that exports no spans (the default), on one exporting
   every request's spans over OTLP/HTTP to a local collector (``peers.otlp_sink``), and on one
   with ``--trace-tokens`` too.
"""

from __future__ import annotations

import http.client
import statistics
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from benchmarks.harness import (
    CLIENT_CORE,
    Cell,
    Contender,
    Server,
    command_line,
    fmt,
    ratio,
    run_bench,
    seedance,
    servers,
    verdict,
)

if TYPE_CHECKING:
    from benchmarks.harness import Report

SCRAPES = 60
SAMPLE_10 = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}


def _sink() -> Contender:
    argv = [sys.executable, "-m", "benchmarks.peers.otlp_sink", "--port", "{port}"]
    return Contender("sink", "OTLP collector", argv, "/", core=CLIENT_CORE)


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _scrapes(port: int) -> tuple[list[float], int]:
    """``SCRAPES`` scrapes over one kept-alive connection, 50 ms apart: times (ms), size."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    times, size = [], 0
    try:
        for _ in range(SCRAPES):
            started = time.perf_counter()
            conn.request("GET", "/metrics")
            size = len(conn.getresponse().read())
            times.append((time.perf_counter() - started) * 1000)
            time.sleep(0.05)
    finally:
        conn.close()
    return times, size


def _scrape_under(server: Server, sessions: int, hold_s: int) -> dict[str, Any]:
    """Scrape while ``sessions`` idle connections are open (0: none)."""
    run_bench(server.url, ["-c", "1", "-n", "20", "--warmup", "5", "--max-tokens", "8"])
    idle: threading.Thread | None = None
    if sessions:
        args = ["--idle-connections", str(sessions), "-d", str(hold_s), "--ping-interval", "10"]
        idle = threading.Thread(target=run_bench, args=(server.url, args), daemon=True)
        idle.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = _get(server.port, "/metrics").decode()
            if _gauge(text, "seedance_sessions") >= sessions:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{sessions} idle connections did not open")
    text = _get(server.port, "/metrics").decode()
    open_sessions = _gauge(text, "seedance_sessions")
    times, size = _scrapes(server.port)
    if idle is not None:
        idle.join()
    return {"times": times, "size": size, "sessions": open_sessions}


def scrape_part(report: Report) -> list[str]:
    big = 2000 if report.quick else 10_000
    hold = 20 if report.quick else 40
    contender = seedance("Seedance", "seedance")
    results: dict[int, list[dict[str, Any]]] = {0: [], big: []}
    total, done = report.rounds * 2, 0
    for _ in range(report.rounds):
        for n in (0, big):
            done += 1
            report.log(f"[8 /metrics] {done}/{total}: {n:,} sessions")
            server = Server(contender)
            try:
                results[n].append(_scrape_under(server, n, hold))
            finally:
                server.stop()

    def figure(n: int, q: float) -> float:
        per_round = [statistics.quantiles(r["times"], n=100)[int(q) - 1] for r in results[n]]
        return float(statistics.median(per_round))

    rows = []
    for n in (0, big):
        sessions = statistics.median(r["sessions"] for r in results[n])
        size = statistics.median(r["size"] for r in results[n])
        rows.append(
            f"| {n:,} | {sessions:,.0f} | {fmt(figure(n, 50), 3)} | {fmt(figure(n, 99), 3)} "
            f"| {size:,.0f} |"
        )
    p50_small, p50_big = figure(0, 50), figure(big, 50)
    ok = p50_big <= 2 * p50_small
    report.goals.append(
        (f"8. A /metrics scrape with {big:,} sessions within 2x of one with none", "", ok)
    )
    return [
        f"### /metrics with {big:,} sessions",
        "",
        f"{SCRAPES} scrapes, 50 ms apart, over one kept-alive connection, while {big:,} idle "
        "WebSocket connections (each a session) hold open and ping the server every 10 s, "
        "against the same server with none. Goal: the scrape with "
        f"{big:,} sessions within 2x of the one with none ({verdict(ok)}: "
        f"{fmt(p50_big, 3)} ms against {fmt(p50_small, 3)} ms, {ratio(p50_big, p50_small)}). "
        "Gauges are read from the server's state at scrape time, and no series is labelled "
        "by session, so a scrape's size does not grow with sessions.",
        "",
        "| idle connections | live sessions (scraped) | scrape p50 ms | scrape p99 ms | bytes |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def tracing_part(report: Report) -> list[str]:
    duration = "4" if report.quick else "8"
    load = ["-c", "16", "-d", duration, "--max-tokens", "16", "--warmup", "16"]
    with servers([_sink()]) as sinks:
        sink = sinks["sink"]
        collector = f"http://127.0.0.1:{sink.port}"
        contenders = [
            seedance("no exporter (default)", "off"),
            seedance("OTLP/HTTP export", "otlp", "--otlp-endpoint", collector),
            seedance(
                "OTLP/HTTP export, --trace-tokens",
                "tokens",
                *("--otlp-endpoint", collector, "--trace-tokens"),
            ),
            seedance("OTLP/HTTP export, 10% sampled", "sampled", "--otlp-endpoint", collector),
        ]
        contenders[-1].env.update(SAMPLE_10)
        with servers(contenders) as running:
            cells = report.alternate(running, [("16 streams", load)], "8 traces")
        spans = int(_get(sink.port, "/count") or 0)
    base: Cell = cells[("16 streams", "off")]
    base_rps = base.median("summary", "requests_per_s")
    base_ttft = base.median("summary", "ttft", "p50_ms")
    rows = []
    for c in contenders:
        cell = cells[("16 streams", c.key)]
        rps = cell.median("summary", "requests_per_s")
        ttft = cell.median("summary", "ttft", "p50_ms")
        rows.append(
            f"| {c.label} | {fmt(rps, 0)} ({ratio(rps, base_rps)}) | {fmt(ttft, 3)} "
            f"({ratio(ttft, base_ttft)}) | {cell.errors()} |"
        )
    return [
        "### Traces",
        "",
        "16 users sending request after request for 16 tokens each, on the synthetic engine (no "
        "model time: the most requests a second one core passes, so what tracing costs shows "
        "in full). Exporting, every request makes 4 spans (the request, queue, prefill and "
        "decode), batched to a local OTLP/HTTP collector on the client core. Ratios are to the "
        f"server without an exporter. The collector received {spans:,} spans.",
        "",
        "| server | requests/s | TTFT p50 ms | errors |",
        "|---|---|---|---|",
        *rows,
        "",
        "```",
        *(c.display() for c in [_sink(), *contenders[:-1]]),
        " ".join(f"{k}={v}" for k, v in SAMPLE_10.items()) + " " + contenders[-1].display(),
        command_line(load),
        "```",
        "",
    ]


def observability_suite(report: Report) -> None:
    scrape = scrape_part(report)
    traces = tracing_part(report)
    report.sections.append("\n".join(["## 8. Observability costs", "", *scrape, *traces]))
