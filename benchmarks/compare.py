"""Side by side: this tree's Seedance against another revision, on the loads of suites 1 and 2.

A change to the token path, an engine or the request lifecycle is measured against the revision
before it, in one run on one machine: noise moves both figures alike, so the ratio is what to
read (never absolute figures across runs). The other revision's ``src/`` is exported with
``git archive`` into a temporary folder and served from there (``PYTHONPATH``) with this
environment's packages, so only Seedance's own code differs. Both servers stay up for the
whole run, on the server core, and take turns (A B, B A, ...).

    python -m benchmarks.compare REV [--rounds N] [--loads fanout,tokenpath,cost] [--out FILE]

Timing on a shared machine moves by 10-20% from run to run at saturation, more than the 5% a
change to the token path may cost. The ``cost`` table is the deterministic answer: each server
runs under valgrind's cachegrind with merging off (one frame per token, so both send the same
frames), twice, with a few and with many requests; the difference between the two runs, per
token, is what serving a token costs in instructions and in (simulated) cache misses, free of
the machine's noise. It needs valgrind (Debian package ``valgrind``).

The baseline runs with this environment's installed metadata (its engine entry points): a
revision whose entry points differ from this tree's does not start, and says so.
"""

from __future__ import annotations

import argparse
import io
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import seedance
from benchmarks import harness
from benchmarks.harness import (
    TOKEN_PATH_RATE,
    Cell,
    Contender,
    Load,
    Report,
    Server,
    fan_out_loads,
    fmt,
    machine_lines,
    ratio,
    run_bench,
    servers,
    token_path_loads,
)

#: How far this tree may fall behind the baseline: delivered tokens/s and CPU per token.
TOLERANCE = 0.05
#: This tree's ``src/`` (served with PYTHONPATH) and the repository around it.
THIS_SRC = Path(seedance.__file__).resolve().parents[1]
ROOT = THIS_SRC.parent


def export_source(revision: str, into: Path) -> str:
    """Write ``revision``'s ``src/`` under ``into``; returns the revision's short hash."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", revision],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision, "src"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return short


def _this_revision() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "src"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (head or "this tree") + (" with changes" if dirty else "")


def _pair(this_src: Path, base_src: Path, *extra: str) -> list[Contender]:
    this = harness.seedance("this tree", "this", *extra)
    this.env = {"PYTHONPATH": str(this_src)}
    base = harness.seedance("baseline", "base", *extra)
    base.env = {"PYTHONPATH": str(base_src)}
    return [this, base]


Run = dict[str, Any]  # one seedance bench run's --json output, with server_cpu_s
Figure = Callable[[Run], float]


def _summary(*path: str) -> Figure:
    def figure(run: Run) -> float:
        value: Any = run["summary"]
        for key in path:
            value = value[key]
        return float("nan") if value is None else float(value)

    return figure


def _cpu_per_token_us(run: Run) -> float:
    """The server's CPU microseconds per token it sent."""
    return 1e6 * float(run["server_cpu_s"]) / max(int(run["summary"]["output_tokens"]), 1)


def _tokens_per_frame(run: Run) -> float:
    summary = run["summary"]
    return int(summary["output_tokens"]) / max(int(summary["chunks"]), 1)


def paired(this: Cell, base: Cell, figure: Figure) -> tuple[float, float, float]:
    """Each side's median, and the median of the per-round ratios (the rounds ran back to back
    with the same prompts, so a drift of the machine cancels out within a pair)."""
    mine = [figure(run) for run in this.runs]
    theirs = [figure(run) for run in base.runs]
    ratios = [a / b for a, b in zip(mine, theirs, strict=True) if b]
    return (
        statistics.median(mine),
        statistics.median(theirs),
        statistics.median(ratios) if ratios else float("nan"),
    )


@dataclass(frozen=True, slots=True)
class Table:
    """One set of loads: its figures (a column each), and the tokens/s that must keep up."""

    title: str
    about: str
    loads: list[Load]
    extra: tuple[str, ...]  # server flags for both
    columns: tuple[tuple[str, Figure], ...]
    throughput: Figure


FAN_OUT = Table(
    "Fan-out (suite 2's loads)",
    "128-token replies as fast as the server goes.",
    fan_out_loads(False),
    (),
    (
        ("delivered tokens/s", _summary("delivered_tokens_per_s")),
        ("server CPU µs per token", _cpu_per_token_us),
        ("tokens per frame", _tokens_per_frame),
        ("TTFT p99 ms", _summary("ttft", "p99_ms")),
    ),
    _summary("delivered_tokens_per_s"),
)

TOKEN_PATH = Table(
    "Token path (suite 1's loads)",
    f"16-token replies at {TOKEN_PATH_RATE} tokens/s per stream: below saturation the CPU per "
    "token is the cost to read; at 1,000 streams both servers are CPU-bound and output "
    "tokens/s is.",
    token_path_loads(False),
    ("--synthetic-tokens-per-s", str(TOKEN_PATH_RATE)),
    (
        ("TTFT p50 ms", _summary("ttft", "p50_ms")),
        ("TTFT p99 ms", _summary("ttft", "p99_ms")),
        ("output tokens/s", _summary("output_tokens_per_s")),
        ("server CPU µs per token", _cpu_per_token_us),
    ),
    _summary("output_tokens_per_s"),
)

TABLES = {"fanout": FAN_OUT, "tokenpath": TOKEN_PATH}


def _run_table(
    report: Report, table: Table, this_src: Path, base_src: Path
) -> tuple[list[str], bool]:
    """Both servers on ``table``'s loads; its section of the report, and whether every row
    is within :data:`TOLERANCE`."""
    with servers(_pair(this_src, base_src, *table.extra)) as running:
        cells = report.alternate(running, table.loads, table.title)
    names = [name for name, _ in table.columns]
    rows = []
    ok_all = True
    for load, _ in table.loads:
        this, base = cells[(load, "this")], cells[(load, "base")]
        figures = [paired(this, base, figure) for _, figure in table.columns]
        keeps_up = paired(this, base, table.throughput)[2] >= 1 - TOLERANCE
        cheap = paired(this, base, _cpu_per_token_us)[2] <= 1 + TOLERANCE
        ok_all &= keeps_up and cheap
        rows.append(
            f"| {load} | "
            + " | ".join(f"{fmt(a)} / {fmt(b)} ({r:.2f}x)" for a, b, r in figures)
            + f" | {'yes' if keeps_up and cheap else '**no**'} |"
        )
    section = [
        f"## {table.title}",
        "",
        f"{table.about} Each cell: **this tree / baseline (ratio)**, the figures the medians "
        "over rounds and the ratio the median of each round's ratio.",
        "",
        "| load | " + " | ".join(names) + " | within 5% |",
        "|---" * (len(names) + 2) + "|",
        *rows,
        "",
    ]
    return section, ok_all


#: The cost table's loads: (concurrency, requests of the short run, of the long run).
COST_LOADS = ((100, 200, 600), (1000, 1000, 2000))
#: The last-level cache cachegrind simulates (size, ways, line): a server CPU's share of L3.
SIMULATED_LL = "8388608,16,64"
COST_EVENTS = (
    ("instructions", ("Ir",)),
    ("L1 data misses", ("D1mr", "D1mw")),
    ("last-level misses", ("DLmr", "DLmw")),
)


def _cachegrind_run(src: Path, concurrency: int, requests: int) -> tuple[dict[str, int], int]:
    """Serve ``requests`` 128-token replies at ``concurrency`` from a server under cachegrind;
    its event totals and the tokens it sent."""
    with tempfile.TemporaryDirectory(prefix="seedance-cachegrind-") as tmp:
        profile = Path(tmp) / "cachegrind.out"
        server_command = harness.seedance("cost", "cost", "--merge-window-ms", "0")
        valgrind = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--LL={SIMULATED_LL}"]
        # This interpreter runs the seedance script, as without valgrind.
        server_command.argv = [
            *valgrind,
            f"--cachegrind-out-file={profile}",
            sys.executable,
            *server_command.argv,
        ]
        server_command.env = {"PYTHONPATH": str(src)}
        server = Server(server_command)
        try:
            load = ["-c", str(concurrency), "--requests", str(requests), "--warmup", "0"]
            load += ["--max-tokens", "128", "--prompt-tokens", "32", "--seed", "7"]
            result = run_bench(server.url, load)
        finally:
            server.proc.terminate()  # a clean exit writes the profile
            server.proc.wait(120)
            server.log.close()
        events: list[str] = []
        totals: list[int] = []
        for line in profile.read_text().splitlines():
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("summary:"):
                totals = [int(v) for v in line.split()[1:]]
        return dict(zip(events, totals, strict=True)), int(result["summary"]["output_tokens"])


def _cost_per_token(src: Path, concurrency: int, short: int, long: int) -> dict[str, float]:
    """Each of :data:`COST_EVENTS` per token, from the difference of a short and a long run
    (what starting, idling and stopping cost cancels out)."""
    (few, few_tokens), (many, many_tokens) = (
        _cachegrind_run(src, concurrency, requests) for requests in (short, long)
    )
    tokens = max(many_tokens - few_tokens, 1)
    return {name: sum(many[e] - few[e] for e in keys) / tokens for name, keys in COST_EVENTS}


def _cost_table(report: Report, this_src: Path, base_src: Path) -> tuple[list[str], bool]:
    rows = []
    ok_all = True
    for concurrency, short, long in COST_LOADS:
        report.log(f"[cost] {concurrency} streams: this tree, then the baseline, under valgrind")
        mine = _cost_per_token(this_src, concurrency, short, long)
        theirs = _cost_per_token(base_src, concurrency, short, long)
        ok = all(mine[name] <= theirs[name] * (1 + TOLERANCE) for name, _ in COST_EVENTS)
        ok_all &= ok
        rows.append(
            f"| {concurrency} streams | "
            + " | ".join(
                f"{fmt(mine[n], 1)} / {fmt(theirs[n], 1)} ({ratio(mine[n], theirs[n])})"
                for n, _ in COST_EVENTS
            )
            + f" | {'yes' if ok else '**no**'} |"
        )
    section = [
        "## Cost per token (cachegrind)",
        "",
        "128-token replies, merging off (a frame per token: both servers send the same frames), "
        f"each server under valgrind's cachegrind (last-level cache simulated as {SIMULATED_LL} "
        "bytes, ways, line) for a short and a long run of the same load: the difference, per "
        "token, is the cost of a token with its share of its request, free of the machine's "
        "noise. Each cell: **this tree / baseline (ratio)**.",
        "",
        "| load | " + " | ".join(f"{name} per token" for name, _ in COST_EVENTS) + " | within 5% |",
        "|---" * (len(COST_EVENTS) + 2) + "|",
        *rows,
        "",
        "Requests per run (short, long): "
        + ", ".join(f"{c} streams: {a:,}, {b:,}" for c, a, b in COST_LOADS)
        + ".",
        "",
    ]
    return section, ok_all


def compare(
    revision: str, rounds: int, tables: Sequence[Table], out: Path, cost: bool, command: str
) -> bool:
    """Run ``tables`` for this tree and ``revision``; write the report to ``out`` (``command``:
    the command line that asked for it); returns whether every row is within
    :data:`TOLERANCE`."""
    report = Report(False, rounds, out)
    started = time.time()
    sections: list[str] = []
    ok_all = True
    with tempfile.TemporaryDirectory(prefix="seedance-baseline-") as tmp:
        short = export_source(revision, Path(tmp))
        for table in tables:
            section, ok = _run_table(report, table, THIS_SRC, Path(tmp) / "src")
            sections += section
            ok_all &= ok
        if cost:
            section, ok = _cost_table(report, THIS_SRC, Path(tmp) / "src")
            sections += section
            ok_all &= ok
    minutes = (time.time() - started) / 60
    header = [
        f"# Side by side: {_this_revision()} against {short} ({revision})",
        "",
        f"Generated by `{command}` "
        f"({minutes:.1f} min). Both servers stay up for the whole run and take turns (A B, "
        f"B A, ...); figures are medians over {rounds} rounds, ratios the medians of the "
        "rounds' ratios. A row is within 5% when tokens/s keeps to within 5% of the "
        "baseline's and the server's CPU per token grows by at most 5%.",
        "",
        *machine_lines(),
        f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([*header, *sections]))
    return ok_all


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", help="the git revision to compare with (e.g. a commit)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per server (default 5)")
    parser.add_argument(
        "--loads",
        default="fanout,tokenpath,cost",
        help="which tables: fanout, tokenpath, cost (cachegrind; needs valgrind); default all",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks-baseline.md"))
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.loads.split(",")]
    unknown = [name for name in names if name not in (*TABLES, "cost")]
    if unknown:
        parser.error(f"--loads takes fanout, tokenpath and cost, not {', '.join(unknown)}")
    if "cost" in names and shutil.which("valgrind") is None:
        parser.error("the cost table needs valgrind (Debian package valgrind)")
    tables = [TABLES[name] for name in names if name in TABLES]
    command = shlex.join(
        ["python", "-m", "benchmarks.compare", *(sys.argv[1:] if argv is None else argv)]
    )
    ok = compare(args.revision, args.rounds, tables, args.out, "cost" in names, command)
    print(f"wrote {args.out}: {'within' if ok else 'NOT within'} 5%", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
