"""``make bench``: Seedance against a minimal server on the raw ``websockets`` library, in one
run, written to ``docs/benchmarks.md``.

Every suite starts the servers it needs, pins them to core 0 and the load generator
(``seedance bench``, run as its own process) to core 1, and runs the contenders in turn
(A B A B ...). Figures are the median over rounds; ratios are what count.

    python -m seedance.bench.suites [--quick] [--rounds N] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from seedance.bench.svg import bar_chart

SERVER_CORE = 0
CLIENT_CORE = 1


# --------------------------------------------------------------------------- processes


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pin_to(core: int) -> Any:
    if _cores() < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(slots=True)
class Contender:
    key: str
    label: str
    argv: list[str]  # "{port}" is replaced
    path: str  # URL path of the WebSocket endpoint (an ``http`` one: the OpenAI API's base)
    pinned: bool = True  # on the server core (off: the server may use every core)
    core: int = SERVER_CORE  # the core it is pinned to
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    cwd: str | None = None  # where it runs (default: here)

    def command(self, port: int | str) -> list[str]:
        return [a.replace("{port}", str(port)) for a in self.argv]

    def display(self) -> str:
        """The command as a user types it (``seedance``, ``python``; no virtualenv path)."""
        shown = {
            sys.executable: "python",
            str(Path(sys.executable).with_name("seedance")): "seedance",
        }
        return shlex.join([shown.get(a, a) for a in self.command("PORT")])


def seedance(label: str, key: str, *extra: str) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--engine", "synthetic", "--port", "{port}", "--log-level", "warning"]
    argv += ["--max-connections", "20000", "--max-waiting", "20000", *extra]
    return Contender(key, label, argv, "/v2/infer")


def raw(*extra: str) -> Contender:
    argv = [sys.executable, "-m", "seedance.bench.peers.raw_websockets", "--port", "{port}"]
    return Contender("raw", "raw websockets", [*argv, *extra], "/")


def raw_picows(*extra: str) -> Contender:
    argv = [sys.executable, "-m", "seedance.bench.peers.raw_picows", "--port", "{port}"]
    return Contender("picows", "raw picows", [*argv, *extra], "/")


class Server:
    """One contender's server process, pinned to the server core."""

    def __init__(self, contender: Contender) -> None:
        self.contender = contender
        self.port = free_port()
        scheme = "http" if contender.path.startswith("/v1") else "ws"
        self.url = f"{scheme}://127.0.0.1:{self.port}{contender.path}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            contender.command(self.port),
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            preexec_fn=pin_to(contender.core) if contender.pinned else None,
            env={**os.environ, **contender.env} if contender.env else None,
            cwd=contender.cwd,
        )
        deadline = time.monotonic() + 180  # LiteLLM takes a while to import
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{contender.label} exited: {self.log.read().decode()}")
            if self._ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{contender.label} did not start")

    def _ready(self) -> bool:
        """Accepting connections; for an HTTP server, also past loading (llama-server takes
        connections at once and answers 503 until its model is loaded)."""
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
        except OSError:
            return False
        if not self.url.startswith("http"):
            return True
        try:
            urllib.request.urlopen(f"{self.url}/models", timeout=2).close()
        except urllib.error.HTTPError as exc:
            return exc.code != 503  # any other answer (401 without a key, say): it is up
        except OSError:
            return False
        return True

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user and system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@contextlib.contextmanager
def servers(contenders: Sequence[Contender]) -> Iterator[dict[str, Server]]:
    started: dict[str, Server] = {}
    try:
        for c in contenders:
            started[c.key] = Server(c)
        yield started
    finally:
        for server in started.values():
            server.stop()


def bench_argv(url: str, args: Sequence[str]) -> list[str]:
    target = ["--openai", url] if url.startswith("http") else [url]
    return [str(Path(sys.executable).with_name("seedance")), "bench", *target, "-q", *args]


def run_bench(
    url: str, args: Sequence[str], *, watch: Server | None = None, pinned: bool = True
) -> dict[str, Any]:
    """Run ``seedance bench`` (pinned to the client core unless ``pinned`` is false); its
    ``--json`` output (plus the server's peak RSS while it ran when ``watch`` is given)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.Popen(
            [*bench_argv(url, args), "--json", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=pin_to(CLIENT_CORE) if pinned else None,
        )
        peak = 0
        while proc.poll() is None:
            if watch is not None:
                peak = max(peak, watch.rss_bytes())
            time.sleep(0.2)
        stdout, stderr = proc.communicate()
        if not out.exists():
            raise RuntimeError(f"seedance bench failed ({proc.returncode}): {stderr}{stdout}")
        data: dict[str, Any] = json.loads(out.read_text())
        data.pop("samples", None) if "summary" in data else None
        data["peak_rss"] = peak
        data["exit_code"] = proc.returncode
        return data


def command_line(args: Sequence[str]) -> str:
    return shlex.join(["seedance", "bench", "URL", *args])


# --------------------------------------------------------------------------- loads

#: Suite 1's per-stream token rate (tokens/s): a typical model's speed.
TOKEN_PATH_RATE = 50

Load = tuple[str, list[str]]  # a name, and the seedance bench arguments


def token_path_loads(quick: bool) -> list[Load]:
    """Suite 1: 16-token replies at :data:`TOKEN_PATH_RATE`, 1, 100 and 1,000 streams."""
    short = 4 if quick else 6
    return [
        (
            f"{n} streams",
            [
                *("-c", str(n), "-d", str(seconds), "--ramp-up", "1"),
                *("--max-tokens", "16", "--prompt-tokens", "32"),
            ],
        )
        for n, seconds in ((1, 3 * short), (100, short), (1000, 2 * short))
    ]


def fan_out_loads(quick: bool) -> list[Load]:
    """Suite 2: 128-token replies as fast as the server goes, 100 and 1,000 streams."""
    duration = "4" if quick else "8"
    return [
        (
            f"{n} streams",
            [
                *("-c", str(n), "-d", duration, "--warmup", "0"),
                *("--max-tokens", "128", "--prompt-tokens", "32"),
            ],
        )
        for n in (100, 1000)
    ]


# --------------------------------------------------------------------------- figures


@dataclass(slots=True)
class Cell:
    """One contender at one load: its rounds."""

    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, *path: str) -> float:
        values = []
        for run in self.runs:
            value: Any = run
            for key in path:
                value = value[key]
            values.append(float("nan") if value is None else float(value))
        return float(statistics.median(values)) if values else float("nan")

    def errors(self) -> int:
        return sum(sum(r["summary"]["errors"].values()) for r in self.runs if "summary" in r)


def _pair(seedance_cell: Cell, raw_cell: Cell, *path: str) -> tuple[float, float]:
    """The same figure for Seedance and the raw server."""
    return seedance_cell.median(*path), raw_cell.median(*path)


def fmt(value: float, digits: int = 2) -> str:
    if value != value:  # NaN
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def ratio(a: float, b: float) -> str:
    return "-" if not b or a != a or b != b else f"{a / b:.2f}x"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


# --------------------------------------------------------------------------- suites


class Report:
    def __init__(self, quick: bool, rounds: int, out: Path) -> None:
        self.quick = quick
        self.rounds = rounds
        self.out = out
        self.images = out.parent / "bench"
        self.sections: list[str] = []
        self.goals: list[tuple[str, str, bool]] = []
        self.client_costs: list[tuple[float, float, float]] = []  # frames, CPU s, core share
        self.stack: dict[tuple[str, str], float] = {}  # suite 2: (load, contender) -> tokens/s

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def alternate(
        self,
        running: dict[str, Server],
        loads: Sequence[Load],
        title: str,
    ) -> dict[tuple[str, str], Cell]:
        """Run every (load, contender) ``rounds`` times, contenders in turn, the order reversed
        every other round (A B, B A, A B) so that a drift of the machine favours neither.

        Each (load, round) has prompts of its own (``--seed``), the same for every contender:
        with one seed everywhere, a later run repeated an earlier run's prompts, and a server
        with a prompt cache (llama-server's) answered them from it.
        """
        cells: dict[tuple[str, str], Cell] = {}
        total = self.rounds * len(loads) * len(running)
        done = 0
        for number, (load, args) in enumerate(loads):
            for round_ in range(self.rounds):
                seeded = [*args, "--seed", str(1000 * (number + 1) + round_)]
                order = list(running.items())
                if round_ % 2:
                    order.reverse()
                for key, server in order:
                    done += 1
                    self.log(f"[{title}] {done}/{total}: {server.contender.label}, {load}")
                    cpu = server.cpu_seconds()
                    result = run_bench(server.url, seeded, pinned=server.contender.pinned)
                    result["server_cpu_s"] = server.cpu_seconds() - cpu
                    cells.setdefault((load, key), Cell()).runs.append(result)
                    summary = result["summary"]
                    client = result["client"]
                    share = client["cpu_s"] / max(client["wall_s"], 1e-9)
                    self.client_costs.append((summary["chunks"], client["cpu_s"], share))
        return cells

    # ---- suite 1
    def token_path(self) -> None:
        rate = TOKEN_PATH_RATE
        contenders = [
            seedance("Seedance", "seedance", "--synthetic-tokens-per-s", str(rate)),
            raw("--tokens-per-s", str(rate)),
        ]
        loads = token_path_loads(self.quick)
        with servers(contenders) as running:
            cells = self.alternate(running, loads, "1 token path")
        rows = []
        ok_all = True
        for load, _ in loads:
            sd, rw = cells[(load, "seedance")], cells[(load, "raw")]
            t50 = _pair(sd, rw, "summary", "ttft", "p50_ms")
            t99 = _pair(sd, rw, "summary", "ttft", "p99_ms")
            tps = _pair(sd, rw, "summary", "output_tokens_per_s")
            ok = t50[0] <= 1.2 * t50[1] and t99[0] <= 1.2 * t99[1] and tps[0] >= tps[1] * 0.99
            ok_all &= ok
            rows.append(
                f"| {load} | {fmt(t50[0])} / {fmt(t50[1])} ({ratio(*t50)}) "
                f"| {fmt(t99[0])} / {fmt(t99[1])} ({ratio(*t99)}) "
                f"| {fmt(tps[0])} / {fmt(tps[1])} ({ratio(*tps)}) "
                f"| {fmt(sd.median('summary', 'itl', 'p99_ms'))} / {fmt(rw.median('summary', 'itl', 'p99_ms'))} "
                f"| {sd.errors()} / {rw.errors()} | {'yes' if ok else 'no'} |"
            )
        self.goals.append(
            (
                "1. Token path overhead: TTFT p50, p99 within 1.2x, tokens/s at least equal",
                "",
                ok_all,
            )
        )
        self.sections.append(
            "\n".join(
                [
                    "## 1. Token path overhead",
                    "",
                    f"The synthetic engine paced at {rate} tokens/s per stream (a typical model speed), "
                    "16-token replies, closed loop, one reused connection per stream; the streams start "
                    "spread over one second (`--ramp-up 1`) so that they do not tick in lockstep, and the "
                    "first request of each is warm-up. At 1,000 streams both servers are CPU-bound "
                    f"({rate * 1000:,} tokens/s asked for): TTFT is then mostly time spent waiting for the "
                    "event loop, and output tokens/s (of the replies completed in the run) is what counts. "
                    "Each cell: **Seedance / raw websockets (ratio)**. "
                    "Goal: TTFT p50 and p99 within 1.2x of the raw server's, output tokens/s at least equal: "
                    + verdict(ok_all)
                    + ".",
                    "",
                    "| load | TTFT p50 ms | TTFT p99 ms | output tokens/s | ITL p99 ms | errors | goal |",
                    "|---|---|---|---|---|---|---|",
                    *rows,
                    "",
                    _commands(contenders, loads),
                ]
            )
        )

    # ---- suite 2
    def fan_out(self) -> None:
        contenders = [
            seedance("Seedance, merging on (5 ms)", "merge"),
            seedance("Seedance, merging off", "nomerge", "--merge-window-ms", "0"),
            raw(),
            raw_picows(),
        ]
        loads = fan_out_loads(self.quick)
        with servers(contenders) as running:
            cells = self.alternate(running, loads, "2 fan-out")
        rows = []
        chart: dict[str, list[float]] = {c.key: [] for c in contenders}
        goal_ok = False
        for load, _ in loads:
            base = cells[(load, "raw")].median("summary", "delivered_tokens_per_s")
            base_ttft = cells[(load, "raw")].median("summary", "ttft", "p99_ms")
            for c in contenders:
                cell = cells[(load, c.key)]
                tps = cell.median("summary", "delivered_tokens_per_s")
                chart[c.key].append(tps)
                per_chunk = cell.median("summary", "output_tokens") / max(
                    cell.median("summary", "chunks"), 1
                )
                alone = sum(r["summary"]["first_chunk_alone"] for r in cell.runs)
                completed = sum(r["summary"]["completed"] for r in cell.runs)
                ttft99 = cell.median("summary", "ttft", "p99_ms")
                rows.append(
                    f"| {load} | {c.label} | {fmt(tps)} | {ratio(tps, base)} | {fmt(per_chunk)} "
                    f"| {alone:,} of {completed:,} "
                    f"| {fmt(cell.median('summary', 'ttft', 'p50_ms'))} | {fmt(ttft99)} ({ratio(ttft99, base_ttft)}) "
                    f"| {cell.errors()} |"
                )
                if load.startswith("1000") and c.key == "merge":
                    goal_ok = tps >= 3 * base and alone == completed
        self.goals.append(
            (
                "2. Fan-out: merging on, 1,000 streams, at least 3x the raw server's tokens/s, first token never merged",
                "",
                goal_ok,
            )
        )
        self.stack = {
            (load, c.key): cells[(load, c.key)].median("summary", "delivered_tokens_per_s")
            for load, _ in loads
            for c in contenders
        }
        self.images.mkdir(parents=True, exist_ok=True)
        (self.images / "fan-out.svg").write_text(
            bar_chart(
                "Delivered tokens/s, unlimited token rate (higher is better)",
                [load for load, _ in loads],
                [(c.label, chart[c.key]) for c in contenders],
                unit="tokens/s",
            )
        )
        self.sections.append(
            "\n".join(
                [
                    "## 2. Fan-out ceiling",
                    "",
                    "The synthetic engine with no delay at all, 128-token replies, no warm-up (delivered "
                    "tokens/s counts every token received, from the first request sent to the last token): every server is CPU-bound, "
                    "and what it delivers is its ceiling. Goal: with merging on, at least 3x the raw server's "
                    "tokens/s at 1,000 streams, and the first token never delayed by merging (it always "
                    "travels alone in its frame, written as soon as the engine yields it; the TTFT columns "
                    "show the time spent waiting for a saturated event loop, with the ratio to the raw "
                    "server's p99): " + verdict(goal_ok) + ".",
                    "",
                    "![delivered tokens/s](bench/fan-out.svg)",
                    "",
                    "| load | server | delivered tokens/s | vs raw | tokens per frame | first frame alone | TTFT p50 ms | TTFT p99 ms | errors |",
                    "|---|---|---|---|---|---|---|---|---|",
                    *rows,
                    "",
                    _commands(contenders, loads),
                ]
            )
        )

    # ---- suite 3
    def idle(self) -> None:
        big = 2000 if self.quick else 10_000
        hold = "10" if self.quick else "30"
        # The many connections heartbeat every 10 s (more often than the protocol's default
        # 25 s); the 10-connection baseline pings often enough to give a p99 of its own.
        intervals = {10: "0.2", big: "10"}
        contenders = [seedance("Seedance", "seedance"), raw()]
        sizes = (10, big)
        results: dict[tuple[int, str], list[dict[str, Any]]] = {}
        total = self.rounds * len(sizes) * len(contenders)
        done = 0
        for _ in range(self.rounds):
            for n in sizes:
                for c in contenders:
                    done += 1
                    self.log(f"[3 idle] {done}/{total}: {c.label}, {n} connections")
                    server = Server(c)
                    try:
                        run_bench(
                            server.url,
                            ["-c", "1", "-n", "20", "--warmup", "5", "--max-tokens", "8"],
                        )
                        time.sleep(0.5)
                        base = server.rss_bytes()
                        args = [
                            "--idle-connections",
                            str(n),
                            "-d",
                            hold,
                            "--ping-interval",
                            intervals[n],
                        ]
                        result = run_bench(server.url, args, watch=server)
                        result["base_rss"] = base
                        results.setdefault((n, c.key), []).append(result)
                    finally:
                        server.stop()

        def per_conn(n: int, key: str) -> float:
            return float(
                statistics.median((r["peak_rss"] - r["base_rss"]) / n for r in results[(n, key)])
            )

        def p99(n: int, key: str) -> float:
            values = [r["heartbeat"]["p99_ms"] or float("nan") for r in results[(n, key)]]
            return float(statistics.median(values))

        def failures(n: int, key: str) -> int:
            return sum(r["failures"] for r in results[(n, key)])

        mem_sd, mem_raw = per_conn(big, "seedance"), per_conn(big, "raw")
        p_small, p_big = p99(10, "seedance"), p99(big, "seedance")
        ok_mem = mem_sd <= 1.5 * mem_raw
        ok_p99 = p_big <= 2 * p_small
        self.goals.append(
            (f"3. Idle: memory per connection within 1.5x of raw ({big:,} connections)", "", ok_mem)
        )
        self.goals.append(
            (
                f"3. Idle: heartbeat p99 with {big:,} connections within 2x of the p99 with 10",
                "",
                ok_p99,
            )
        )
        rows = []
        for c in contenders:
            rows.append(
                f"| {c.label} | {fmt(per_conn(big, c.key) / 1024, 1)} KiB | {fmt(p99(10, c.key), 3)} "
                f"| {fmt(p99(big, c.key), 3)} | {ratio(p99(big, c.key), p99(10, c.key))} "
                f"| {failures(10, c.key) + failures(big, c.key)} |"
            )
        self.sections.append(
            "\n".join(
                [
                    "## 3. Idle connections",
                    "",
                    f"{big:,} open connections (each a session on Seedance) held for {hold} s, each sending a "
                    f"heartbeat ping every {intervals[big]} s ({big // int(intervals[big]):,} pings/s in all), "
                    f"against 10 connections pinging every {intervals[10]} s; the server also sends its own "
                    "heartbeats. Memory is the server's resident set at its peak minus the same server's after "
                    "a short warm-up, divided by the connections. "
                    f"Goals: memory per connection no more than 1.5x the raw library's ({verdict(ok_mem)}), and "
                    f"heartbeat round-trip p99 with {big:,} connections within 2x of the p99 with 10 "
                    f"({verdict(ok_p99)}).",
                    "",
                    f"| server | memory per connection | heartbeat p99 ms, 10 conns | p99 ms, {big:,} conns | ratio | failures |",
                    "|---|---|---|---|---|---|",
                    *rows,
                    "",
                    "```",
                    *(c.display() for c in contenders),
                    shlex.join(
                        [
                            "seedance",
                            "bench",
                            "URL",
                            "--idle-connections",
                            "N",
                            "-d",
                            hold,
                            "--ping-interval",
                            "S",
                        ]
                    ),
                    "```",
                ]
            )
        )

    # ---- suite 4
    def design_table(self) -> None:
        duration = "3" if self.quick else "6"
        contenders = [seedance("Seedance", "seedance"), raw()]
        loads = [
            (
                f"{n} clients",
                ["-c", str(n), "-d", duration, "--max-tokens", "16", "--prompt-tokens", "32"],
            )
            for n in (50, 500)
        ]
        claims = {"50 clients": (218, 142), "500 clients": (1943, 287)}
        with servers(contenders) as running:
            cells = self.alternate(running, loads, "4 design table")
        rows = []
        ok_all = True
        for load, _ in loads:
            sd, rw = cells[(load, "seedance")], cells[(load, "raw")]
            rps = _pair(sd, rw, "summary", "requests_per_s")
            p99 = _pair(sd, rw, "summary", "e2el", "p99_ms")
            ok = rps[0] >= 0.8 * rps[1] and p99[0] <= 1.25 * p99[1]
            ok_all &= ok
            claim = claims[load]
            rows.append(
                f"| {load} | {fmt(rps[0])} | {fmt(p99[0])} | {fmt(rps[1])} | {fmt(p99[1])} "
                f"| {ratio(*rps)} | {ratio(*p99)} | {claim[0]:,} / {claim[1]} | {'yes' if ok else 'no'} |"
            )
        self.goals.append(
            (
                "4. Design table: at least 0.8x the raw server's req/s, p99 within 1.25x (50 and 500 clients)",
                "",
                ok_all,
            )
        )
        self.sections.append(
            "\n".join(
                [
                    "## 4. The design document's table",
                    "",
                    "50 and 500 concurrent clients, 16-token replies, the synthetic engine without delays; "
                    "latency is the whole reply (E2EL). The design document claimed the figures in the "
                    "*design* column (req/s / p99 ms). Goal: at least 0.8x the raw server's requests/s with "
                    "p99 within 1.25x of its p99: " + verdict(ok_all) + ".",
                    "",
                    "| load | Seedance req/s | Seedance p99 ms | raw req/s | raw p99 ms | req/s ratio | p99 ratio | design | goal |",
                    "|---|---|---|---|---|---|---|---|---|",
                    *rows,
                    "",
                    _commands(contenders, loads),
                ]
            )
        )

    def _stack_section(self) -> list[str]:
        if not self.stack:
            return []
        return [
            "## The server stack",
            "",
            "One frame per token costs what the WebSocket stack costs; suite 2 measured each stack's "
            "ceiling on the same engine (delivered tokens/s, and the ratio to the raw `websockets` server):",
            "",
            "| load | raw websockets | raw picows | Seedance, merging off | Seedance, merging on |",
            "|---|---|---|---|---|",
            *_stack_rows(self.stack),
            "",
            "Seedance stays on uvicorn and the `websockets` library's parser, as an ASGI app that users "
            "can mount, with its own write and read paths for `/v2/infer` (frames written straight to "
            "the transport, messages taken as they are parsed). On that path one frame per token already "
            "beats a server written directly on `websockets`; picows (Cython) frames faster still, but "
            "merging does more than a faster framer could: a merged frame costs one write for many "
            "tokens, whatever the library. Moving to picows would mean a second, non-ASGI transport "
            "beside the one the OpenAI HTTP API uses on the same port; it stays an "
            "option for the day per-frame cost is the limit again.",
            "",
        ]

    # ---- the file
    def write(self, started: float) -> None:
        frames = sum(f for f, _, _ in self.client_costs)
        cpu = sum(c for _, c, _ in self.client_costs)
        busiest = max((share for _, _, share in self.client_costs), default=0.0)
        per_frame_us = cpu / frames * 1e6 if frames else float("nan")
        lines = [
            "# Benchmarks",
            "",
            "Generated by `make bench` (`python -m seedance.bench.suites`); do not edit by hand. "
            "Servers run pinned to core 0 and the load generator (`seedance bench`) to core 1; "
            "the contenders take turns (A B A B ...) and each figure is the median of "
            f"{self.rounds} rounds. Absolute figures depend on the machine; the ratios are what count. "
            "This tree against an earlier revision, side by side: "
            "[benchmarks-baseline.md](benchmarks-baseline.md) (`make bench-compare BASELINE=REV`).",
            "",
            "## Machine and versions",
            "",
            *machine_lines(),
            f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
            f"{(time.time() - started) / 60:.1f} minutes{' (quick mode)' if self.quick else ''}",
            "",
            "## Goals",
            "",
            "| goal | result |",
            "|---|---|",
            *(f"| {name} | {verdict(ok)} |" for name, _, ok in self.goals),
            "",
            *(section + "\n" for section in self.sections),
            *self._stack_section(),
        ]
        if frames:  # the suites that ran seedance bench
            lines += [
                "## The load generator",
                "",
                f"Over every run above, `seedance bench` spent **{fmt(per_frame_us)} µs of CPU "
                "per frame received** (all its work included: parsing, timing, bookkeeping), so "
                f"one core of it can take about **{fmt(1e6 / per_frame_us, 0)} frames/s**. In the "
                f"busiest run it used **{busiest:.0%} of its core**: below 100%, the load "
                "generator was not what limited the figures.",
                "",
            ]
        self.out.write_text("\n".join(lines))


def _stack_rows(stack: dict[tuple[str, str], float]) -> list[str]:
    rows = []
    for load in sorted({load for load, _ in stack}, key=lambda x: int(x.split()[0])):
        ws, pw = stack.get((load, "raw"), 0.0), stack.get((load, "picows"), 0.0)
        off, on = stack.get((load, "nomerge"), 0.0), stack.get((load, "merge"), 0.0)
        rows.append(
            f"| {load} | {fmt(ws)} | {fmt(pw)} ({ratio(pw, ws)}) | {fmt(off)} ({ratio(off, ws)}) "
            f"| {fmt(on)} ({ratio(on, ws)}) |"
        )
    return rows


def _commands(contenders: Sequence[Contender], loads: Sequence[Load]) -> str:
    lines = ["Commands (PORT and URL filled in by the runner):", "", "```"]
    lines += [c.display() for c in contenders]
    lines += [command_line(args) for _, args in loads]
    lines.append("```")
    lines += [
        "",
        "Every (load, round) adds `--seed N` of its own: new prompts, the same for every contender.",
    ]
    return "\n".join(lines)


def cpu() -> str:
    """The CPU's name, with AMD's family when the name says no more than "AMD EPYC" (as in a
    KVM guest): ``AMD EPYC (family 26, model 2: Zen 5)``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return "unknown CPU"
    name = fields.get("model name", "unknown CPU")
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    zen = {"23": "Zen or Zen 2", "25": "Zen 3 or Zen 4", "26": "Zen 5"}.get(family)
    if fields.get("vendor_id") == "AuthenticAMD" and zen:
        return f"{name} (family {family}, model {model}: {zen})"
    return f"{name} (family {family}, model {model})"


def machine_lines() -> list[str]:
    cpu_name = cpu()
    versions = []
    for name in (
        "seedance",
        "uvicorn",
        "websockets",
        "starlette",
        "msgspec",
        "uvloop",
        "picows",
        "aiohttp",
        "llama-cpp-python",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{name} {metadata.version(name)}")
    mem = ""
    with contextlib.suppress(OSError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 1024 / 1024:.0f} GiB"
    return [
        f"- machine: {cpu_name}, {_cores()} cores{mem}; {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}; " + ", ".join(versions),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, 2,000 idle connections")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per contender (default 2)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--suites",
        default="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
        help="which suites to run (default all: 1-15)",
    )
    args = parser.parse_args(argv)
    if _cores() < 2:
        print("note: fewer than 2 cores; server and load generator share them", file=sys.stderr)
    from seedance.bench.browser_suite import browser_suite
    from seedance.bench.cluster_suite import cluster_suite
    from seedance.bench.confidential_suite import confidential_suite
    from seedance.bench.gateway_suite import gateway_suite
    from seedance.bench.http_suite import http_suite
    from seedance.bench.llama_suite import llama_suite
    from seedance.bench.observability_suite import observability_suite
    from seedance.bench.openai_suite import openai_suite
    from seedance.bench.qos_suite import qos_suite
    from seedance.bench.reload_suite import reload_suite
    from seedance.bench.resume_suite import resume_suite

    report = Report(args.quick, args.rounds, args.out)
    started = time.time()
    chosen = {s.strip() for s in args.suites.split(",")}
    suites: dict[str, Callable[[], None]] = {
        "1": report.token_path,
        "2": report.fan_out,
        "3": report.idle,
        "4": report.design_table,
        "5": functools.partial(llama_suite, report),
        "6": functools.partial(http_suite, report),
        "7": functools.partial(gateway_suite, report),
        "8": functools.partial(observability_suite, report),
        "9": functools.partial(resume_suite, report),
        "10": functools.partial(cluster_suite, report),
        "11": functools.partial(qos_suite, report),
        "12": functools.partial(browser_suite, report),
        "13": functools.partial(openai_suite, report),
        "14": functools.partial(reload_suite, report),
        "15": functools.partial(confidential_suite, report),
    }
    for key in sorted(chosen, key=int):
        suites[key]()
    report.write(started)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
