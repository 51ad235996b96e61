"""Suite 10 of ``make bench``: the cluster mode (``--redis``), side by side in one run.

- **Fan-out with Redis**: one node in cluster mode (every frame written to Redis before it
  goes out) against one node in memory, suite 2's load, turns alternated; goal 0.7x.
- **Three nodes behind HAProxy** against one node, both in cluster mode: requests/s and TTFT
  p99 of short replies (on a 2-core machine three nodes share the same two cores, so this
  measures the balancer's and Redis's cost more than any gain).
- **Resume latency**, a client dropping mid-reply and resuming on another node: while the
  owner lives (the other node follows the log from Redis), and after ``kill -9`` of the owner
  (the other node takes the generation over once the lease expired); goal at p99: one lease
  plus 1 s.
- **Redis memory per active session**: ``used_memory`` before and after sessions that each
  hold one exchange and its resumable stream log.

Needs ``redis-server`` and ``haproxy`` (Debian packages); without them the suite says so and
is skipped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from benchmarks.harness import (
    CLIENT_CORE,
    Contender,
    Server,
    fan_out_loads,
    fmt,
    pin_to,
    ratio,
    run_bench,
    seedance,
    servers,
    verdict,
)
from seedance.cluster.local import (
    HAPROXY_CFG,
    ClusterError,
    haproxy_env,
    program,
    redis_command,
    wait_until,
)
from seedance.netutil import free_port

if TYPE_CHECKING:
    from benchmarks.harness import Report

LEASE_S = 2.0
RESUME_RATE = "200"  # tokens/s of the replies that are dropped and resumed
DROP_AFTER = 20
SESSIONS = 200  # sessions for the memory figure


@contextmanager
def redis(directory: str) -> Iterator[str]:
    """A redis-server without persistence, off the server core (as on its own machine, Redis
    takes no time from the node: it shares the load generator's core); its URL."""
    port = free_port()
    proc = subprocess.Popen(
        redis_command(port, directory), stdout=subprocess.DEVNULL, preexec_fn=pin_to(CLIENT_CORE)
    )
    try:
        wait_until(f"127.0.0.1:{port}", "redis-server", [proc])
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def haproxy(ports: list[int]) -> Iterator[str]:
    """HAProxy with deploy/haproxy/haproxy.cfg in front of ``ports``; its ws:// URL."""
    port = free_port()
    proc = subprocess.Popen(
        [program("haproxy", "haproxy"), "-db", "-f", str(HAPROXY_CFG)],
        env=haproxy_env(port, ports),
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until(f"127.0.0.1:{port}", "haproxy", [proc])
        time.sleep(1.5)  # its first health checks
        yield f"ws://127.0.0.1:{port}/v2/infer"
    finally:
        proc.terminate()
        proc.wait(10)


def node(key: str, url: str, *extra: str, pinned: bool = True) -> Contender:
    contender = seedance(f"Seedance, cluster mode ({key})", key, "--redis", url, *extra)
    contender.pinned = pinned
    return contender


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --------------------------------------------------------------------------- resume trials


async def drop_and_resume(owner: str, other: str, session: str, kill: Any = None) -> float:
    """Ask ``owner`` for a resumable reply, drop it after a few tokens (``kill``: kill the
    owner then), resume on ``other``; ms from the drop to the first token there."""
    from websockets.asyncio.client import connect

    request = {"prompt": f"story {session}", "max_tokens": 400, "resumable": True}
    last = -1
    async with connect(f"{owner}?session_id={session}", ping_interval=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({**request, "request_id": "r"}))
        while last < DROP_AFTER:
            frame = json.loads(await ws.recv())
            if frame["type"] == "token":
                last = frame["seq"] + frame.get("n", 1) - 1
        if kill is not None:
            kill()
        ws.transport.abort()
    dropped = time.perf_counter()
    async with connect(f"{other}?session_id={session}", ping_interval=None) as ws:
        hello = json.loads(await ws.recv())
        resume = {"type": "resume", "request_id": "r", "after_seq": last}
        await ws.send(json.dumps({**resume, "epoch": hello["epoch"]}))
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "token":
                if frame["seq"] != last + 1:
                    raise RuntimeError(f"resume gave seq {frame['seq']} after {last}")
                return (time.perf_counter() - dropped) * 1000
            if frame["type"] in ("done", "error"):
                raise RuntimeError(f"resume ended without a token: {frame}")


def _resume_figures(report: Report, url: str) -> tuple[list[float], list[float]]:
    trials = 10 if report.quick else 30
    kills = 5 if report.quick else 10
    extra = ("--lease", str(LEASE_S), "--synthetic-tokens-per-s", RESUME_RATE)
    alive: list[float] = []
    dead: list[float] = []
    with servers([node("a", url, *extra), node("b", url, *extra)]) as running:
        a, b = running["a"].url, running["b"].url
        for i in range(trials):
            report.log(f"[10 cluster] resume, owner alive {i + 1}/{trials}")
            alive.append(asyncio.run(drop_and_resume(a, b, f"alive-{i}")))
        for i in range(kills):
            report.log(f"[10 cluster] resume, owner killed {i + 1}/{kills}")
            doomed = Server(node("doomed", url, *extra))
            kill = functools.partial(doomed.proc.send_signal, signal.SIGKILL)
            try:
                dead.append(asyncio.run(drop_and_resume(doomed.url, b, f"dead-{i}", kill)))
            finally:
                doomed.stop()
    return alive, dead


# --------------------------------------------------------------------------- memory


async def _sessions(url: str, count: int) -> None:
    from websockets.asyncio.client import connect

    for i in range(count):
        async with connect(f"{url}?session_id=mem-{i}", ping_interval=None) as ws:
            await ws.recv()
            request = {"prompt": f"hello {i}", "max_tokens": 64, "resumable": True}
            await ws.send(json.dumps(request))
            while json.loads(await ws.recv())["type"] not in ("done", "error"):
                pass


def _used_memory(url: str) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


# --------------------------------------------------------------------------- the suite


def lacks(report: Report, tag: str, title: str, *programs: str) -> bool:
    """Whether a suite cannot run for want of one of ``programs`` (each from the Debian
    package of its name); its section then says so."""
    try:
        for name in programs:
            program(name, name)
    except ClusterError as exc:
        report.log(f"[{tag}] skipped: {exc}")
        report.sections.append(f"## {title}\n\nNot run: {exc}.\n")
        return True
    return False


def cluster_suite(report: Report) -> None:
    if lacks(report, "10 cluster", "10. Cluster mode", "redis-server", "haproxy"):
        return
    with tempfile.TemporaryDirectory() as data, redis(data) as url:
        # Fan-out: one node with Redis against one in memory.
        loads = fan_out_loads(report.quick)
        memory = seedance("Seedance, memory", "memory")
        clustered = node("redis", url)
        with servers([memory, clustered]) as running:
            cells = report.alternate(running, loads, "10 cluster fan-out")
        fan_rows, fan_ok = [], True
        for load, _ in loads:
            base = cells[(load, "memory")].median("summary", "delivered_tokens_per_s")
            tps = cells[(load, "redis")].median("summary", "delivered_tokens_per_s")
            ttft = cells[(load, "redis")].median("summary", "ttft", "p99_ms")
            base_ttft = cells[(load, "memory")].median("summary", "ttft", "p99_ms")
            fan_ok &= tps >= 0.7 * base
            fan_rows.append(
                f"| {load} | {fmt(base)} | {fmt(tps)} | {ratio(tps, base)} | "
                f"{fmt(base_ttft)} | {fmt(ttft)} |"
            )

        # Three nodes behind HAProxy against one node.
        short = ["-c", "100", "-d", "4" if report.quick else "8"]
        short += ["--max-tokens", "16", "--prompt-tokens", "32"]
        rate = ("--synthetic-tokens-per-s", "50")
        three = [node(f"n{i}", url, *rate, pinned=False) for i in (1, 2, 3)]
        scale_rows = []
        with servers(three) as running:
            ports = [s.port for s in running.values()]
            with haproxy(ports) as balanced:
                single = running["n1"].url
                results: dict[str, list[dict[str, Any]]] = {"one": [], "three": []}
                for round_ in range(report.rounds):
                    order = [("one", single), ("three", balanced)]
                    for key, target in order if round_ % 2 == 0 else reversed(order):
                        report.log(f"[10 cluster] {key} node(s), round {round_ + 1}")
                        seeded = [*short, "--seed", str(7000 + round_)]
                        results[key].append(run_bench(target, seeded, pinned=False))
        for key, label in (("one", "one node"), ("three", "three nodes behind HAProxy")):
            runs = results[key]
            rps = statistics.median(r["summary"]["requests_per_s"] for r in runs)
            p99 = statistics.median(r["summary"]["ttft"]["p99_ms"] for r in runs)
            errors = sum(sum(r["summary"]["errors"].values()) for r in runs)
            scale_rows.append(f"| {label} | {fmt(rps)} | {fmt(p99)} | {errors} |")

        alive, dead = _resume_figures(report, url)
        dead_ok = _p(dead, 0.99) <= (LEASE_S + 1) * 1000

        before = _used_memory(url)
        with servers([node("mem", url)]) as running:
            asyncio.run(_sessions(running["mem"].url, SESSIONS))
            per_session = (_used_memory(url) - before) / SESSIONS

    report.goals.append(
        ("10. Fan-out, one node with Redis / in memory >= 0.7x", "see suite 10", fan_ok)
    )
    report.goals.append(
        (
            f"10. Resume after the owner died, p99 <= lease + 1 s ({LEASE_S + 1:g} s)",
            f"{fmt(_p(dead, 0.99) / 1000)} s",
            dead_ok,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 10. Cluster mode (Redis)",
                "",
                "One `redis-server` (no persistence) on this machine, on the load generator's "
                "core (off the node's); every node is `seedance serve --redis URL` unless it "
                "says memory.",
                "",
                f"**Fan-out**, suite 2's load, one node with Redis against one in memory "
                f"(turns alternated, {report.rounds} rounds; figures the medians). Goal: "
                f"0.7x or more, {verdict(fan_ok)}.",
                "",
                "| load | memory tokens/s | Redis tokens/s | ratio | memory TTFT p99 ms "
                "| Redis TTFT p99 ms |",
                "|---|---|---|---|---|---|",
                *fan_rows,
                "",
                "**Three nodes behind HAProxy against one node** (100 streams of 16-token "
                "replies at 50 tokens/s; the nodes are not pinned and share this machine's "
                "cores with HAProxy, Redis and the load generator).",
                "",
                "| | requests/s | TTFT p99 ms | errors |",
                "|---|---|---|---|",
                *scale_rows,
                "",
                f"**Resume on another node** (a reply at {RESUME_RATE} tokens/s dropped after "
                f"token {DROP_AFTER}; from the drop to the first token on the other node; "
                f"`--lease {LEASE_S:g}`):",
                "",
                "| owner | trials | p50 ms | p99 ms |",
                "|---|---|---|---|",
                f"| alive (the other node follows its log) | {len(alive)} | "
                f"{fmt(statistics.median(alive))} | {fmt(_p(alive, 0.99))} |",
                f"| killed (-9): taken over | {len(dead)} | {fmt(statistics.median(dead))} | "
                f"{fmt(_p(dead, 0.99))} |",
                "",
                f"Goal for a takeover: p99 under one lease plus 1 s, {verdict(dead_ok)}.",
                "",
                f"**Redis memory per active session** (one exchange of a 64-token resumable "
                f"reply each, {SESSIONS} sessions): {per_session / 1024:.1f} KiB.",
                "",
            ]
        )
    )
