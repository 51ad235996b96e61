"""What every suite of ``make bench`` shares: its contenders and their server processes, runs
of the load generator taken in turn, the figures' formatting, and the report they are written
to (``docs/benchmarks.md``, by :mod:`benchmarks.suites`).

Every suite starts the servers it needs, pins them to core 0 and the load generator
(``seedance bench``, run as its own process) to core 1, and runs the contenders in turn
(A B A B ...). Figures are the median over rounds; ratios are what count.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from seedance.netutil import free_port

SERVER_CORE = 0
CLIENT_CORE = 1


# --------------------------------------------------------------------------- processes


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pin_to(core: int) -> Any:
    if cores() < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


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
    argv = [sys.executable, "-m", "benchmarks.peers.raw_websockets", "--port", "{port}"]
    return Contender("raw", "raw websockets", [*argv, *extra], "/")


def raw_picows(*extra: str) -> Contender:
    argv = [sys.executable, "-m", "benchmarks.peers.raw_picows", "--port", "{port}"]
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
        """CPU time the server has used so far (user and system), its child processes' (an
        engine process) included."""
        ticks = 0
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def terminate(proc: subprocess.Popen[Any]) -> None:
    """Stop ``proc``: SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def metric_sums(url: str, *names: str) -> list[float]:
    """Each of ``names`` summed over its labels, from the ``/metrics`` of the server at ``url``
    (``ws://host:port/...`` or ``http://...``), scraped once."""
    host = url.split("/")[2]
    with urllib.request.urlopen(f"http://{host}/metrics", timeout=30) as response:
        text = response.read().decode()
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return [sums[name] for name in names]


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


def pair(seedance_cell: Cell, raw_cell: Cell, *path: str) -> tuple[float, float]:
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


def venv_version(exe: Path, distribution: str) -> str:
    """The version of ``distribution`` in the virtual environment of ``exe`` (a peer's own)."""
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    found = subprocess.run(
        [str(exe.with_name("python")), "-c", code], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() or "unknown"


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
            "Generated by `make bench` (`python -m benchmarks.suites`); do not edit by hand. "
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


def commands(contenders: Sequence[Contender], loads: Sequence[Load]) -> str:
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
        f"- machine: {cpu_name}, {cores()} cores{mem}; {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}; " + ", ".join(versions),
    ]
