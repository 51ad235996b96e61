"""Suite 21 of ``make bench``: a node's processes, side by side in one run.

- 21a: the embedded SmolLM2 on llama.cpp, 1 and 8 streams, the engine in the server's process
  against the engine in a process of its own (``--engine-process``): tokens/s and TTFT (the
  engine process must cost the model nothing);
- 21b: the synthetic engine unpaced, 64 streams: what carrying each token between the two
  processes costs, in CPU microseconds (both processes' CPU time, against the server's alone);
- 21c-e: one worker against two (``--workers 2``, with the private Redis they share): fan-out at
  1,000 streams, the design document's table at 500 clients, and gateway mode.

Servers are not pinned (llama.cpp needs every core; the engine process and the workers are
more processes): the load generator, and gateway mode's upstream, share the same cores.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import (
    CLIENT_CORE,
    Contender,
    commands,
    cores,
    fan_out_loads,
    fmt,
    ratio,
    seedance,
    servers,
    verdict,
)
from benchmarks.llama_suite import seedance_llama

if TYPE_CHECKING:
    from benchmarks.harness import Cell, Load, Report

STREAMS = (1, 8)
_UNPACED = ("--synthetic-tokens-per-s", "0")


def processes_suite(report: Report) -> None:
    report.sections.append(
        "\n".join(
            [
                "## 21. A node's processes: the engine in a process of its own",
                "",
                "`seedance serve --engine-process` runs the engine in a second process and carries "
                "requests and token deltas between the two over a ZeroMQ socket (`ipc://`), "
                "msgpack-encoded with msgspec, every delta of one event-loop round in one message "
                "(docs/architecture.md). Contenders take turns, the order reversed every other "
                f"round; {cores()} cores, nothing pinned: the load generator shares them.",
                "",
            ]
        )
    )
    _model(report)
    _ipc(report)
    _workers(report)


def _model(report: Report) -> None:
    seconds = 10 if report.quick else 30
    contenders = [
        seedance_llama("engine in the server's process", "inline"),
        seedance_llama("engine process", "remote", "--engine-process"),
    ]
    loads: list[Load] = [
        (
            f"{n} stream{'s' if n > 1 else ''}",
            [
                *("-c", str(n), "-d", str(seconds), "--warmup", "0", "--ramp-up", "1"),
                *("--temperature", "0", "--max-tokens", "128", "--prompt-tokens", "16"),
            ],
        )
        for n in STREAMS
    ]
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "21a engine process, SmolLM2")
    rows, ok = [], True
    for load, _ in loads:
        inline, remote = cells[(load, "inline")], cells[(load, "remote")]
        tps = [c.median("summary", "delivered_tokens_per_s") for c in (inline, remote)]
        t50 = [c.median("summary", "ttft", "p50_ms") for c in (inline, remote)]
        t99 = [c.median("summary", "ttft", "p99_ms") for c in (inline, remote)]
        if load.startswith("8"):
            ok = tps[1] >= 0.97 * tps[0] and t50[1] <= 1.05 * t50[0]
        rows.append(
            f"| {load} | {fmt(tps[0], 1)} / {fmt(tps[1], 1)} ({ratio(tps[1], tps[0])}) "
            f"| {fmt(t50[0], 0)} / {fmt(t50[1], 0)} ({ratio(t50[1], t50[0])}) "
            f"| {fmt(t99[0], 0)} / {fmt(t99[1], 0)} "
            f"| {inline.errors()} / {remote.errors()} |"
        )
    report.goals.append(
        (
            "21a. engine process, SmolLM2, 8 streams: at least 0.97x the in-process engine's "
            "tokens/s, TTFT p50 at most 1.05x",
            "",
            ok,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "### 21a. The embedded model: in the server's process or its own",
                "",
                f"SmolLM2-135M-Instruct (Q4_1) on llama.cpp with {cores()} threads; a closed loop "
                "of N users, 16-word prompts, replies of up to 128 tokens at temperature 0. "
                "Cells: **in the server's process / engine process (ratio)**. Goal at 8 streams: "
                "at least 0.97x the tokens/s, TTFT p50 at most 1.05x: " + verdict(ok) + ".",
                "",
                "| load | output tokens/s | TTFT p50 ms | TTFT p99 ms | errors |",
                "|---|---|---|---|---|",
                *rows,
                "",
                commands(contenders, loads),
                "",
            ]
        )
    )


def _ipc(report: Report) -> None:
    seconds = 5 if report.quick else 15
    contenders = [
        _unpinned(seedance("engine in the server's process", "inline", *_UNPACED)),
        _unpinned(seedance("engine process", "remote", *_UNPACED, "--engine-process")),
    ]
    loads: list[Load] = [
        (
            "64 streams",
            [
                *("-c", "64", "-d", str(seconds), "--warmup", "1", "--ramp-up", "0"),
                *("--max-tokens", "256", "--prompt-tokens", "16"),
            ],
        )
    ]
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "21b engine process, IPC cost")
    load = loads[0][0]
    inline, remote = cells[(load, "inline")], cells[(load, "remote")]

    def per_token_us(cell: Cell) -> float:
        tokens = sum(run["summary"]["output_tokens"] for run in cell.runs)
        cpu = sum(run["server_cpu_s"] for run in cell.runs)
        return float(cpu / max(tokens, 1) * 1e6)

    cost = [per_token_us(c) for c in (inline, remote)]
    tps = [c.median("summary", "delivered_tokens_per_s") for c in (inline, remote)]
    report.sections.append(
        "\n".join(
            [
                "### 21b. What the IPC costs a token",
                "",
                "The synthetic engine unpaced (no model: every microsecond is serving), 64 "
                "streams of 256-token replies, frame merging on. CPU time of the server's "
                "process and, with `--engine-process`, of the engine process too, per token "
                f"delivered. The IPC's cost per token: **{fmt(cost[1] - cost[0], 1)} µs** of "
                "CPU, whichever process spends it.",
                "",
                "| | delivered tokens/s | CPU µs per token (all processes) |",
                "|---|---|---|",
                f"| engine in the server's process | {fmt(tps[0], 0)} | {fmt(cost[0], 1)} |",
                f"| engine process | {fmt(tps[1], 0)} ({ratio(tps[1], tps[0])}) "
                f"| {fmt(cost[1], 1)} ({ratio(cost[1], cost[0])}) |",
                "",
                commands(contenders, loads),
                "",
            ]
        )
    )


def _unpinned(contender: Contender) -> Contender:
    return dataclasses.replace(contender, pinned=False)


def _workers(report: Report) -> None:
    """21c-e: one worker against two, on three loads."""
    seconds = "4" if report.quick else "8"
    _, fan_out = fan_out_loads(report.quick)[1]  # 1,000 streams
    rows: list[str] = []
    ok = True
    for title, contenders, load, figure in (
        (
            "21c fan-out, 1,000 streams",
            [
                _unpinned(seedance("one worker", "one")),
                _unpinned(seedance("two workers", "two", "--workers", "2")),
            ],
            ("1,000 streams of 128 tokens", fan_out),
            ("delivered tokens/s", ("summary", "delivered_tokens_per_s")),
        ),
        (
            "21d design table, 500 clients",
            [
                _unpinned(seedance("one worker", "one")),
                _unpinned(seedance("two workers", "two", "--workers", "2")),
            ],
            (
                "500 clients, 16-token replies",
                ["-c", "500", "-d", seconds, "--max-tokens", "16", "--prompt-tokens", "32"],
            ),
            ("requests/s", ("summary", "requests_per_s")),
        ),
    ):
        cells = _one_against_two(report, title, contenders, load)
        pair = [cells[(load[0], key)] for key in ("one", "two")]
        one, two = (cell.median(*figure[1]) for cell in pair)
        p99 = [cell.median("summary", "e2el", "p99_ms") for cell in pair]
        met = two >= 1.3 * one and (not title.startswith("21d") or p99[1] <= p99[0])
        ok &= met
        unit = "output_tokens" if title.startswith("21c") else "completed"
        rows.append(
            f"| {load[0]} | {figure[0]} | {fmt(one, 0)} / {fmt(two, 0)} ({ratio(two, one)}) "
            f"| {fmt(p99[0], 1)} / {fmt(p99[1], 1)} | {_shares(pair, unit)} "
            f"| {'met' if met else 'not met'} |"
        )
    rows.append(_gateway(report, seconds))
    report.goals.append(
        (
            "21c-d. two workers: at least 1.3x one worker's fan-out tokens/s and requests/s at "
            "500 clients (p99 no worse)",
            "",
            ok,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "### 21c-e. One worker against two",
                "",
                f"`seedance serve` against `seedance serve --workers 2` on {cores()} cores, "
                "nothing pinned: the workers, their private `redis-server` (the store of the "
                "sessions, quotas and stream logs they share), the load generator and, for "
                "gateway mode, the upstream, all share the cores. One worker keeps everything "
                "in its memory. Cells: **one worker / two workers (ratio)**. Goal: at least "
                "1.3x with two workers, the p99 latency no worse: " + verdict(ok) + ".",
                "",
                "| load | figure | one / two workers | E2E latency p99 ms "
                "| server CPU µs per unit, one / two; load generator's cores | goal |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                "The CPU column is how the cores were shared: the server's CPU time (every "
                "process of it: the workers and their Redis too) per delivered token (fan-out) "
                "or per request, and the cores the load generator kept busy meanwhile. Two "
                "workers pay for the store they share (Redis's own CPU and each exchange's) on "
                "cores the load generator also needs.",
                "",
            ]
        )
    )


def _shares(pair: list[Cell], unit: str) -> str:
    """The server's CPU per ``unit`` (a summary count) for one and two workers, and the cores
    the load generator used with two."""
    per = []
    for cell in pair:
        units = sum(run["summary"][unit] for run in cell.runs)
        per.append(sum(run["server_cpu_s"] for run in cell.runs) / max(units, 1) * 1e6)
    client = pair[1].runs
    cores = sum(r["client"]["cpu_s"] for r in client) / sum(r["client"]["wall_s"] for r in client)
    return f"{fmt(per[0], 1)} / {fmt(per[1], 1)} ({ratio(per[1], per[0])}); {fmt(cores, 2)}"


def _one_against_two(
    report: Report, title: str, contenders: list[Contender], load: Load
) -> dict[tuple[str, str], Cell]:
    with servers(contenders) as running:
        return report.alternate(running, [load], title)


def _gateway(report: Report, seconds: str) -> str:
    """21e: gateway mode in front of a fast synthetic OpenAI upstream, one worker or two."""
    upstream = Contender(
        "upstream",
        "synthetic upstream",
        [sys.executable, "-m", "benchmarks.peers.openai_sse", "--port", "{port}"],
        "/v1",
        core=CLIENT_CORE,
        pinned=False,
    )
    with servers([upstream]) as up:
        base = up["upstream"].url
        exe = str(Path(sys.executable).with_name("seedance"))
        argv = [exe, "serve", "--engine", "openai", "--upstream", base, "--port", "{port}"]
        argv += ["--log-level", "warning", "--max-waiting", "20000"]
        contenders = [
            Contender("one", "gateway, one worker", argv, "/v1", pinned=False),
            Contender(
                "two", "gateway, two workers", [*argv, "--workers", "2"], "/v1", pinned=False
            ),
        ]
        load: Load = (
            "gateway mode, 32 users",
            [
                *("-c", "32", "-d", seconds, "--max-tokens", "16", "--warmup", "64"),
                "--model",
                "synthetic",
            ],
        )
        cells = _one_against_two(report, "21e gateway mode", contenders, load)
    one, two = (cells[(load[0], key)].median("summary", "requests_per_s") for key in ("one", "two"))
    p99 = [cells[(load[0], key)].median("summary", "e2el", "p99_ms") for key in ("one", "two")]
    pair = [cells[(load[0], key)] for key in ("one", "two")]
    return (
        f"| {load[0]} | requests/s | {fmt(one, 0)} / {fmt(two, 0)} ({ratio(two, one)}) "
        f"| {fmt(p99[0], 1)} / {fmt(p99[1], 1)} | {_shares(pair, 'completed')} "
        f"| {'met' if two >= 1.3 * one else 'not met'} |"
    )
