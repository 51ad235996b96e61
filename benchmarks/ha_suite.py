"""Suite 23 of ``make bench``: the cluster mode behind Redis Sentinel (``--redis
sentinel://...``), in one run: a primary, a replica and three ``redis-sentinel`` processes
(``seedance cluster --sentinels``' own, :func:`seedance.cluster.local.start_redis`).

- **What waiting for a replica costs**: one node with ``--redis-wait-replicas 1`` (every
  exchange that writes ends with ``WAIT 1``) against one with 0, side by side, turns
  alternated: requests/s and latency of short replies that continue their sessions.
- **A failover under load**: two nodes; resumable replies streaming and new requests arriving
  at a steady rate; ``kill -9`` of the primary. Figures: the longest pause of any stream,
  tokens lost or repeated, requests failed, and how long after the kill new requests were
  admitted again. Goals (the issue's): no token lost or repeated, no request failed.

Needs ``redis-server`` and ``redis-sentinel`` (Debian packages); without them the suite says so
and is skipped.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.cluster_suite import lacks
from benchmarks.harness import fmt, ratio, run_bench, seedance, servers, verdict
from seedance.cluster.local import start_redis

if TYPE_CHECKING:
    from benchmarks.harness import Report

STREAM_RATE = 100  # tokens/s of each resumable reply
KILL_AFTER_S = 2.0  # into the load, the primary dies


@dataclass
class Stream:
    """One resumable reply as its client saw it."""

    seqs: list[int] = field(default_factory=list)
    longest_gap_s: float = 0.0
    end: str | None = None


@dataclass
class Arrival:
    """One new request: when it was sent, when its start came, how it ended."""

    sent: float
    started: float | None = None
    end: str | None = None


async def _stream(url: str, session: str, max_tokens: int, out: Stream) -> None:
    from websockets.asyncio.client import connect

    request = {"prompt": f"story {session}", "max_tokens": max_tokens, "resumable": True}
    async with connect(f"{url}?session_id={session}", ping_interval=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps(request))
        last = time.monotonic()
        while True:
            frame = json.loads(await ws.recv())
            now = time.monotonic()
            out.longest_gap_s = max(out.longest_gap_s, now - last)
            last = now
            if frame["type"] == "token":
                out.seqs.extend(range(frame["seq"], frame["seq"] + frame.get("n", 1)))
            elif frame["type"] in ("done", "error"):
                out.end = frame.get("code", frame["type"])
                return


async def _arrive(url: str, arrival: Arrival) -> None:
    from websockets.asyncio.client import connect

    try:
        async with connect(url, ping_interval=None, open_timeout=30) as ws:
            json.loads(await ws.recv())
            await ws.send(json.dumps({"prompt": "hello", "max_tokens": 8, "resumable": True}))
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "start":
                    arrival.started = time.monotonic()
                elif frame["type"] in ("done", "error"):
                    arrival.end = frame.get("code", frame["type"])
                    return
    except Exception as exc:  # refused at the door, cut: a failure like an error frame
        arrival.end = type(exc).__name__


async def _failover_load(
    urls: list[str], streams: int, rate: float, duration_s: float, kill: Any
) -> tuple[list[Stream], list[Arrival], float]:
    """``streams`` resumable replies over ``urls`` and ``rate`` new requests/s for
    ``duration_s``; ``kill()`` after :data:`KILL_AFTER_S`. Returns when all ended."""
    max_tokens = int(STREAM_RATE * duration_s)
    seen = [Stream() for _ in range(streams)]
    tasks = [
        asyncio.ensure_future(_stream(urls[i % len(urls)], f"ha-{i}", max_tokens, seen[i]))
        for i in range(streams)
    ]
    arrivals: list[Arrival] = []
    began = time.monotonic()
    killed_at = 0.0
    while time.monotonic() - began < duration_s:
        if not killed_at and time.monotonic() - began >= KILL_AFTER_S:
            kill()
            killed_at = time.monotonic()
        arrival = Arrival(time.monotonic())
        arrivals.append(arrival)
        tasks.append(asyncio.ensure_future(_arrive(urls[len(arrivals) % len(urls)], arrival)))
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks, return_exceptions=True)
    return seen, arrivals, killed_at


def _redis_cost(report: Report, url: str) -> list[str]:
    """One node waiting for a replica against one that does not: rows of the table."""
    load = ["-c", "50", "-d", "4" if report.quick else "8", "--max-tokens", "16"]
    contenders = [
        seedance("no WAIT", "nowait", "--redis", url, "--redis-wait-replicas", "0"),
        seedance("WAIT 1", "wait", "--redis", url, "--redis-wait-replicas", "1"),
    ]
    results: dict[str, list[dict[str, Any]]] = {"nowait": [], "wait": []}
    with servers(contenders) as running:
        for round_ in range(report.rounds):
            order = ["nowait", "wait"] if round_ % 2 == 0 else ["wait", "nowait"]
            for key in order:
                report.log(f"[23 sentinel] {key}, round {round_ + 1}/{report.rounds}")
                results[key].append(run_bench(running[key].url, load))

    def median(key: str, *path: str) -> float:
        values = []
        for run in results[key]:
            value: Any = run["summary"]
            for step in path:
                value = value[step]
            values.append(float(value))
        return statistics.median(values)

    rows = []
    base = median("nowait", "requests_per_s")
    for key, label in (("nowait", "`--redis-wait-replicas 0`"), ("wait", "`1` (the default)")):
        rps = median(key, "requests_per_s")
        rows.append(
            f"| {label} | {fmt(rps)} ({ratio(rps, base)}) | {fmt(median(key, 'ttft', 'p99_ms'))} "
            f"| {fmt(median(key, 'e2el', 'p50_ms'))} | {fmt(median(key, 'e2el', 'p99_ms'))} |"
        )
    return rows


def ha_suite(report: Report) -> None:
    title = "23. Redis failover (Sentinel)"
    if lacks(report, "23 sentinel", title, "redis-server", "redis-sentinel"):
        return
    streams, rate, duration_s = (20, 5.0, 8.0) if report.quick else (100, 20.0, 15.0)
    children: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as data:
        try:
            url, _ = start_redis(Path(data), children, sentinels=True)
            cost_rows = _redis_cost(report, url)
            pace = ("--synthetic-tokens-per-s", str(STREAM_RATE))
            nodes = [seedance(f"node {i}", f"n{i}", "--redis", url, *pace) for i in (1, 2)]
            with servers(nodes) as running:
                primary = children[0]  # the first primary: start_redis started it first
                report.log(f"[23 sentinel] failover under load: {streams} streams, {rate:g}/s")
                seen, arrivals, killed_at = asyncio.run(
                    _failover_load(
                        [s.url for s in running.values()],
                        streams,
                        rate,
                        duration_s,
                        lambda: primary.send_signal(signal.SIGKILL),
                    )
                )
        finally:
            for child in children:
                child.kill()
                child.wait()
    expected = int(STREAM_RATE * duration_s)
    lost = sum(len(set(range(expected)) - set(s.seqs)) for s in seen)
    repeated = sum(len(s.seqs) - len(set(s.seqs)) for s in seen)
    ends = [s.end for s in seen]
    failed = [a for a in arrivals if a.end != "done"]
    after = [a.started for a in arrivals if a.sent >= killed_at and a.started is not None]
    admitted_again = min(after) - killed_at if after else float("nan")
    waits = [a.started - a.sent for a in arrivals if a.started is not None]
    ok = lost == 0 and repeated == 0 and not failed and set(ends) == {"done"}
    report.goals.append(
        ("23. Redis primary killed under load: 0 tokens lost or repeated, 0 failed", "", ok)
    )
    report.sections.append(
        "\n".join(
            [
                "## 23. Redis failover (Sentinel)",
                "",
                "A primary, a replica and three `redis-sentinel` processes on this machine "
                "(`down-after-milliseconds 1000`, quorum 2; not pinned); nodes are "
                "`seedance serve --redis sentinel://...`.",
                "",
                "**What waiting for a replica costs**: one node each way, short replies that "
                f"continue their sessions (`seedance bench -c 50 --max-tokens 16`, "
                f"{report.rounds} rounds alternated; medians).",
                "",
                "| writes wait for | requests/s | TTFT p99 ms | E2E p50 ms | E2E p99 ms |",
                "|---|---|---|---|---|",
                *cost_rows,
                "",
                f"**`kill -9` of the primary under load**: two nodes, {streams} resumable "
                f"replies of {expected} tokens at {STREAM_RATE} tokens/s, {rate:g} new "
                f"requests/s (each a new connection and a resumable 8-token reply), the "
                f"primary killed {KILL_AFTER_S:g} s in. Goal: no token lost or repeated, no "
                f"request failed: {verdict(ok)}.",
                "",
                "| figure | value |",
                "|---|---|",
                f"| replies ended `done` | {ends.count('done')} of {len(ends)} |",
                f"| tokens lost / repeated | {lost} / {repeated} |",
                f"| longest pause of any stream | {fmt(max(s.longest_gap_s for s in seen))} s |",
                f"| new requests failed | {len(failed)} of {len(arrivals)} |",
                f"| from the kill to the first request admitted that was sent after it | "
                f"{fmt(admitted_again)} s |",
                f"| longest wait for admission (sent to `start`) | "
                f"{fmt(max(waits) if waits else float('nan'))} s |",
                "",
            ]
        )
    )
