"""Suite 21 of ``make bench``: a node's processes. The engine in the server's process against
the engine in a process of its own (``--engine-process``), side by side in one run:

- 21a: the embedded SmolLM2 on llama.cpp, 1 and 8 streams: tokens/s and TTFT (the engine
  process must cost the model nothing);
- 21b: the synthetic engine unpaced, 64 streams: what carrying each token between the two
  processes costs, in CPU microseconds (both processes' CPU time, against the server's alone).

Servers are not pinned (llama.cpp needs every core; the engine process is a second process
that would share the server's core); the load generator shares the same cores.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import Contender, commands, cores, fmt, ratio, servers, verdict
from benchmarks.llama_suite import seedance_llama

if TYPE_CHECKING:
    from benchmarks.harness import Cell, Load, Report

STREAMS = (1, 8)


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


def _synthetic(label: str, key: str, *extra: str) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--port", "{port}", "--log-level", "warning", "--engine", "synthetic"]
    argv += ["--synthetic-tokens-per-s", "0", *extra]
    return Contender(key, label, argv, "/v2/infer", pinned=False)


def _ipc(report: Report) -> None:
    seconds = 5 if report.quick else 15
    contenders = [
        _synthetic("engine in the server's process", "inline"),
        _synthetic("engine process", "remote", "--engine-process"),
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
