"""Suite 17 of ``make bench``: typed output on the embedded SmolLM2: replies bound to a JSON
Schema, and log probabilities.

``benchmarks/risk_schema.json`` (12 fields, nested, every string and number bounded) binds every
reply: Seedance's ``/v2/infer`` with ``schema`` (llguidance's masks, :mod:`seedance.engines.grammar`)
against llama.cpp's ``llama-server`` with ``response_format`` ``json_schema`` (its grammar
sampler, from the GBNF it writes for the schema), both at 8 slots, 1 and 8 closed-loop streams,
greedy. Seedance also runs the same loads unbound: the cost of binding. Goals: Seedance bound at
least 0.9x its own unbound tokens/s, at least 1.0x llama-server's bound tokens/s, and at most
its TTFT p50. The unbound loads run once more with each token's log probability and its 5
likeliest alternatives: at least 0.9x the tokens/s without. Last, requests that end in a tool
call (``tool_choice: "required"``), 8 streams, over the OpenAI API against ``llama-server
--jinja``: at least its requests/s.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import Contender, Load, commands, fmt, ratio, servers, verdict
from benchmarks.llama_suite import llama_server, seedance_llama

if TYPE_CHECKING:
    from benchmarks.harness import Cell, Report

SCHEMA = Path(__file__).with_name("risk_schema.json")
TOOLS = Path(__file__).with_name("weather_tools.json")
#: SmolLM2's ChatML with tools in the Hermes way (Qwen 2.5's), for llama-server: its own
#: template has no tools, and llama-server then leaves them out of the prompt.
HERMES = Path(__file__).with_name("hermes_tools.jinja")
STREAMS = (1, 8)
TOP_LOGPROBS = 5


def structured_suite(report: Report) -> None:
    seconds = {1: 8, 8: 15} if report.quick else {1: 15, 8: 30}
    contenders = [seedance_llama("Seedance", "seedance"), llama_server(report)]
    common = ["--warmup", "0", "--ramp-up", "2", "--temperature", "0"]
    common += ["--max-tokens", "256", "--prompt-tokens", "16"]
    loads = []
    for n in STREAMS:
        run = ["-c", str(n), "-d", str(seconds[n]), *common]
        loads.append((f"{n} streams, schema", [*run, "--schema", str(SCHEMA)]))
        loads.append((f"{n} streams, free", run))
        loads.append((f"{n} streams, logprobs", [*run, "--logprobs", str(TOP_LOGPROBS)]))
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "17 schemas")
    rows, logprob_rows = [], []
    goal_own = goal_llama = goal_logprobs = True
    for n in STREAMS:
        free = {k: cells[(f"{n} streams, free", k)] for k in ("seedance", "llama")}
        scored = {k: cells[(f"{n} streams, logprobs", k)] for k in ("seedance", "llama")}
        plain = {k: c.median("summary", "delivered_tokens_per_s") for k, c in free.items()}
        with_lp = {k: c.median("summary", "delivered_tokens_per_s") for k, c in scored.items()}
        goal_logprobs &= with_lp["seedance"] >= 0.9 * plain["seedance"]
        logprob_rows.append(
            f"| {n} | {fmt(with_lp['seedance'], 1)} / {fmt(plain['seedance'], 1)} "
            f"({ratio(with_lp['seedance'], plain['seedance'])}) "
            f"| {fmt(with_lp['llama'], 1)} / {fmt(plain['llama'], 1)} "
            f"({ratio(with_lp['llama'], plain['llama'])}) "
            f"| {' / '.join(str(c.errors()) for c in scored.values())} |"
        )
    for n in STREAMS:
        bound = {k: cells[(f"{n} streams, schema", k)] for k in ("seedance", "llama")}
        free = {k: cells[(f"{n} streams, free", k)] for k in ("seedance", "llama")}
        tps = {k: c.median("summary", "delivered_tokens_per_s") for k, c in bound.items()}
        free_tps = {k: c.median("summary", "delivered_tokens_per_s") for k, c in free.items()}
        t50 = {k: c.median("summary", "ttft", "p50_ms") for k, c in bound.items()}
        goal_own &= tps["seedance"] >= 0.9 * free_tps["seedance"]
        goal_llama &= tps["seedance"] >= tps["llama"] and t50["seedance"] <= t50["llama"]
        rows.append(
            f"| {n} | {fmt(tps['seedance'], 1)} / {fmt(tps['llama'], 1)} "
            f"({ratio(tps['seedance'], tps['llama'])}) "
            f"| {fmt(free_tps['seedance'], 1)} ({ratio(tps['seedance'], free_tps['seedance'])}) "
            f"/ {fmt(free_tps['llama'], 1)} ({ratio(tps['llama'], free_tps['llama'])}) "
            f"| {fmt(t50['seedance'], 0)} / {fmt(t50['llama'], 0)} "
            f"({ratio(t50['seedance'], t50['llama'])}) "
            f"| {' / '.join(str(round(c.median('summary', 'completed'))) for c in bound.values())} "
            f"| {' / '.join(str(c.errors()) for c in bound.values())} |"
        )
    report.goals.append(
        ("17. Schema-bound replies: at least 0.9x Seedance's own unbound tokens/s", "", goal_own)
    )
    report.goals.append(
        (
            "17. Schema-bound replies: at least llama-server's tokens/s, at most its TTFT p50",
            "",
            goal_llama,
        )
    )
    report.goals.append(
        (
            f"17. Log probabilities (top {TOP_LOGPROBS}): at least 0.9x the tokens/s without",
            "",
            goal_logprobs,
        )
    )
    tool_rows, tool_contenders, tool_loads, goal_tools = _tool_calls(report)
    report.goals.append(
        ("17. Tool calls, 8 streams: at least llama-server's (--jinja) calls/s", "", goal_tools)
    )
    report.sections.append(
        "\n".join(
            [
                "## 17. Typed output: schema-bound replies and log probabilities",
                "",
                "Every reply bound to `benchmarks/risk_schema.json` (12 fields, nested, strings "
                "and numbers bounded): Seedance's `/v2/infer` with `schema` (llguidance's token "
                "masks, computed together for the step's bound sequences) against llama.cpp's "
                "`llama-server` with `response_format` `json_schema` (its grammar sampler), 8 "
                "slots each, closed loops of N users with 16-word prompts, greedy, replies of up "
                "to 256 tokens (a bound reply ends when its document is whole). The same loads "
                "unbound give each server's own floor. Goals: Seedance bound at least 0.9x its "
                f"unbound tokens/s: {verdict(goal_own)}; at least llama-server's bound tokens/s "
                f"and at most its TTFT p50: {verdict(goal_llama)}. The mask's own cost per "
                "token, without a server: `python -m benchmarks.grammar_mask` (docs/engines.md).",
                "",
                "| streams | bound tokens/s, Seedance / llama-server | unbound tokens/s, "
                "Seedance (bound's share) / llama-server (bound's share) "
                "| bound TTFT p50 ms | replies | errors |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                f"Log probabilities: the unbound loads again, each token with its log "
                f"probability and its {TOP_LOGPROBS} likeliest alternatives (`/v2/infer`: "
                f"`logprobs: {TOP_LOGPROBS}`; llama-server: `logprobs: true, top_logprobs: "
                f"{TOP_LOGPROBS}`). Goal: Seedance at least 0.9x its tokens/s without: "
                f"{verdict(goal_logprobs)}.",
                "",
                "| streams | Seedance tokens/s, with / without | llama-server tokens/s, with / "
                "without | errors |",
                "|---|---|---|---|",
                *logprob_rows,
                "",
                commands(contenders, loads),
                "",
                "Tool calls: closed loops of 8 users over the OpenAI API, each request offering "
                "the two tools of `benchmarks/weather_tools.json` with `tool_choice: "
                '"required"`, so every reply is one call or more (16-word prompts, greedy, up to '
                "128 tokens): Seedance's generic format bound by its grammar against "
                "`llama-server --jinja` with `benchmarks/hermes_tools.jinja` (SmolLM2's ChatML "
                "with the tools in the Hermes way: SmolLM2's own template has none, and "
                "llama-server then leaves the tools out of the prompt). llama-server does not "
                "bind the reply to a call, so its replies may be text: only replies that are "
                "calls count. Goal: at least llama-server's calls/s: "
                f"{verdict(goal_tools)}.",
                "",
                "| streams | calls/s, Seedance / llama-server | requests/s | replies that "
                "were calls | TTFT p50 ms | errors |",
                "|---|---|---|---|---|---|",
                *tool_rows,
                "",
                commands(tool_contenders, tool_loads),
                "",
            ]
        )
    )


def _call_share(cell: Cell) -> str:
    """How many of the replies were calls, over the rounds: ``calls/replies``."""
    runs = [r["summary"] for r in cell.runs if "summary" in r]
    called = sum(r["finish_reasons"].get("tool_calls", 0) for r in runs)
    return f"{called}/{sum(r['completed'] for r in runs)}"


def _calls_per_s(cell: Cell) -> float:
    """Requests that ended in a call, per second (the median over the rounds)."""
    rates = [
        r["summary"]["requests_per_s"]
        * r["summary"]["finish_reasons"].get("tool_calls", 0)
        / max(1, r["summary"]["completed"])
        for r in cell.runs
        if "summary" in r
    ]
    return float(statistics.median(rates)) if rates else float("nan")


def _tool_calls(report: Report) -> tuple[list[str], list[Contender], list[Load], bool]:
    """Requests that end in a tool call, 8 streams, Seedance against llama-server --jinja."""
    seedance = dataclasses.replace(seedance_llama("Seedance", "seedance"), path="/v1")
    llama = llama_server(report)
    llama = dataclasses.replace(
        llama, argv=[*llama.argv, "--jinja", "--chat-template-file", str(HERMES)]
    )
    contenders = [seedance, llama]
    run = ["-c", "8", "-d", "15" if report.quick else "30", "--warmup", "0", "--ramp-up", "2"]
    run += ["--temperature", "0", "--max-tokens", "128", "--prompt-tokens", "16"]
    run += ["--tools", str(TOOLS), "--tool-choice", "required"]
    loads: list[Load] = [("8 streams, one call", run)]
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "17 tool calls")
    cell = {k: cells[("8 streams, one call", k)] for k in ("seedance", "llama")}
    rps = {k: c.median("summary", "requests_per_s") for k, c in cell.items()}
    # Requests whose reply was a call, per second: a reply in text does not count.
    calls = {k: _calls_per_s(c) for k, c in cell.items()}
    t50 = {k: c.median("summary", "ttft", "p50_ms") for k, c in cell.items()}
    goal = calls["seedance"] >= calls["llama"] and all(c.errors() == 0 for c in cell.values())
    share = {k: _call_share(c) for k, c in cell.items()}
    row = (
        f"| 8 | {fmt(calls['seedance'], 2)} / {fmt(calls['llama'], 2)} "
        f"| {fmt(rps['seedance'], 2)} / {fmt(rps['llama'], 2)} "
        f"({ratio(rps['seedance'], rps['llama'])}) "
        f"| {share['seedance']} / {share['llama']} "
        f"| {fmt(t50['seedance'], 0)} / {fmt(t50['llama'], 0)} "
        f"| {' / '.join(str(c.errors()) for c in cell.values())} |"
    )
    return [row], contenders, loads, goal
