"""Suite 5 of ``make bench``: the ``llamacpp`` engine on the embedded SmolLM2, against
llama-cpp-python's own server and against llama.cpp driven by a bare loop, in one run.

Every contender uses the same GGUF file and the same number of threads (all cores), so the
servers are not pinned: llama.cpp needs every core, and the load generator's share is small at
these token rates. Contenders take turns (A B A B ...); figures are medians over rounds.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from seedance.bench.load import make_prompt
from seedance.bench.suites import (
    Contender,
    _commands,
    _cores,
    fmt,
    ratio,
    servers,
    verdict,
)
from seedance.bench.svg import bar_chart
from seedance.client import connect
from seedance.engines.local import default_model_path

if TYPE_CHECKING:
    from seedance.bench.suites import Report

PROMPT = "Write a long story about a dragon who learns to sail."
STREAMS = (1, 4, 8)
HISTORY_TOKENS = 1500


def _threads() -> str:
    return str(_cores())


def seedance_llama(label: str, key: str, *extra: str) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--port", "{port}", "--log-level", "warning", "--threads", _threads()]
    return Contender(key, label, [*argv, *extra], "/v2/infer", pinned=False)


def llama_cpp_server() -> Contender:
    """llama-cpp-python's OpenAI-compatible server; by default it aborts a running stream when
    another request arrives, so the benchmark turns that off."""
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path())]
    argv += ["--port", "{port}", "--n_threads", _threads(), "--n_threads_batch", _threads()]
    argv += ["--n_ctx", "4096", "--interrupt_requests", "False", "--verbose", "False"]
    return Contender("peer", "llama-cpp-python server", argv, "/v1", pinned=False)


def bare(*args: str) -> dict[str, float]:
    """One measurement of the bare llama.cpp loop (``seedance.bench.peers.llama_bare``)."""
    argv = [sys.executable, "-m", "seedance.bench.peers.llama_bare", *args]
    out = subprocess.run([*argv, "--threads", _threads()], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama_bare failed: {out.stderr}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


async def _decode_rate(url: str, tokens: int) -> float:
    """Tokens/s of one stream after its first token, as a client receives them."""
    async with connect(url) as session:
        stream = session.generate(PROMPT, temperature=0, max_tokens=tokens, reset=True)
        arrivals = [(time.perf_counter(), chunk.n) async for chunk in stream]
    (first, first_n), (last, _) = arrivals[0], arrivals[-1]
    return (sum(n for _, n in arrivals) - first_n) / (last - first)


async def _second_turn(url: str, history: str) -> tuple[float, int]:
    """A new session's second turn after a long first one: (TTFT s, its prompt tokens)."""
    async with connect(url) as session:
        await session.generate(history, temperature=0, max_tokens=8).collect()
        stream = session.generate("Which word came first?", temperature=0, max_tokens=8)
        sent = time.perf_counter()
        first = None
        async for _ in stream:
            first = first or time.perf_counter()
        assert first is not None and stream.start is not None
        return first - sent, stream.start.prompt_tokens


def llama_suite(report: Report) -> None:
    _decode(report)
    _concurrency(report)
    _second_turns(report)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _rounds(
    report: Report, title: str, steps: list[tuple[str, Callable[[], float]]]
) -> dict[str, list[float]]:
    """Run each named step once per round, in turn; the values by name."""
    values: dict[str, list[float]] = {name: [] for name, _ in steps}
    total, done = report.rounds * len(steps), 0
    for _ in range(report.rounds):
        for name, step in steps:
            done += 1
            report.log(f"[{title}] {done}/{total}: {name}")
            values[name].append(step())
    return values


# ---- 5a: one stream's decode rate
def _decode(report: Report) -> None:
    tokens = 100 if report.quick else 200
    contender = seedance_llama("Seedance", "seedance")
    with servers([contender]) as running:
        url = running["seedance"].url
        asyncio.run(_decode_rate(url, 16))  # warm-up
        values = _rounds(
            report,
            "5a decode rate",
            [
                ("Seedance", lambda: asyncio.run(_decode_rate(url, tokens))),
                (
                    "bare loop",
                    lambda: bare("generate", "--tokens", str(tokens))["decode_tokens_per_s"],
                ),
            ],
        )
    ours, limit = _median(values["Seedance"]), _median(values["bare loop"])
    ok = ours >= 0.95 * limit
    report.goals.append(
        ("5a. llama.cpp: one stream decodes at 0.95x a bare llama.cpp loop or better", "", ok)
    )
    report.sections.append(
        "\n".join(
            [
                "## 5. The llama.cpp engine (embedded SmolLM2-135M-Instruct, Q4_1)",
                "",
                f"Every contender runs the same GGUF file with {_threads()} threads (all cores; "
                "nothing pinned). Temperature 0 everywhere, so every contender computes the same "
                "tokens.",
                "",
                "### 5a. One stream: decode tokens/s",
                "",
                f"A {tokens}-token reply to one prompt: tokens/s after the first token, as the "
                "client receives them over a WebSocket, against the same prompt decoded by "
                "llama.cpp in a bare Python loop with no server (`python -m "
                f"seedance.bench.peers.llama_bare generate --tokens {tokens}`: prefill, then "
                "sample and decode one token at a time, end-of-text ignored), the physical "
                "limit here. Goal: at least 0.95x the bare loop: " + verdict(ok) + ".",
                "",
                "| | decode tokens/s (median) | rounds |",
                "|---|---|---|",
                f"| Seedance over WebSocket | {fmt(ours, 1)} ({ratio(ours, limit)}) "
                f"| {', '.join(fmt(v, 1) for v in values['Seedance'])} |",
                f"| bare llama.cpp loop | {fmt(limit, 1)} "
                f"| {', '.join(fmt(v, 1) for v in values['bare loop'])} |",
                "",
            ]
        )
    )


# ---- 5b: concurrent streams
def _concurrency(report: Report) -> None:
    seconds = {1: 20, 4: 40, 8: 60}
    if report.quick:
        seconds = {n: s // 2 for n, s in seconds.items()}
    contenders = [seedance_llama("Seedance", "seedance"), llama_cpp_server()]
    loads = [
        (
            f"{n} streams",
            [
                *("-c", str(n), "-d", str(seconds[n]), "--warmup", "0", "--ramp-up", "2"),
                "--temperature",
                "0",
                *("--max-tokens", "128", "--prompt-tokens", "16"),
            ],
        )
        for n in STREAMS
    ]
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "5b concurrency")
    steps = 20 if report.quick else 40

    def decode_alone(n: int) -> Callable[[], float]:
        return lambda: bare("batch", "--sequences", str(n), "--steps", str(steps))["tokens_per_s"]

    decode_only = _rounds(report, "5b decode only", [(str(n), decode_alone(n)) for n in STREAMS])
    rows, chart = [], {"seedance": [], "peer": [], "decode": []}  # type: ignore[var-annotated]
    goal_peer = goal_decode = False
    for n, (load, _) in zip(STREAMS, loads, strict=True):
        sd, peer = cells[(load, "seedance")], cells[(load, "peer")]
        tps = (
            sd.median("summary", "delivered_tokens_per_s"),
            peer.median("summary", "delivered_tokens_per_s"),
        )
        t50 = (sd.median("summary", "ttft", "p50_ms"), peer.median("summary", "ttft", "p50_ms"))
        t99 = (sd.median("summary", "ttft", "p99_ms"), peer.median("summary", "ttft", "p99_ms"))
        limit = _median(decode_only[str(n)])
        chart["seedance"].append(tps[0])
        chart["peer"].append(tps[1])
        chart["decode"].append(limit)
        if n == 8:
            goal_peer = tps[0] >= 2.5 * tps[1] and t50[0] <= 0.25 * t50[1]
            goal_decode = tps[0] >= 0.85 * limit
        rows.append(
            f"| {load} | {fmt(tps[0], 1)} / {fmt(tps[1], 1)} ({ratio(*tps)}) "
            f"| {fmt(limit, 1)} ({ratio(tps[0], limit)}) "
            f"| {fmt(t50[0], 0)} / {fmt(t50[1], 0)} ({ratio(*t50)}) "
            f"| {fmt(t99[0], 0)} / {fmt(t99[1], 0)} ({ratio(*t99)}) "
            f"| {sd.median('summary', 'completed'):.0f} / {peer.median('summary', 'completed'):.0f} "
            f"| {sd.errors()} / {peer.errors()} |"
        )
    report.goals.append(
        (
            "5b. llama.cpp, 8 streams: at least 2.5x the tokens/s of llama-cpp-python's server, and a quarter of its TTFT p50",
            "",
            goal_peer,
        )
    )
    report.goals.append(
        (
            "5b. llama.cpp, 8 streams: at least 0.85x of llama.cpp's batched decode alone",
            "",
            goal_decode,
        )
    )
    report.images.mkdir(parents=True, exist_ok=True)
    (report.images / "llama-streams.svg").write_text(
        bar_chart(
            "Aggregate output tokens/s, SmolLM2-135M Q4_1 (higher is better)",
            [load for load, _ in loads],
            [
                ("Seedance", chart["seedance"]),
                ("llama-cpp-python server", chart["peer"]),
                ("llama.cpp batched decode alone", chart["decode"]),
            ],
            unit="tokens/s",
        )
    )
    report.sections.append(
        "\n".join(
            [
                "### 5b. Concurrent streams: aggregate tokens/s and TTFT",
                "",
                "Closed loop of N users, each with one reused connection, 16-word prompts (a new "
                "prompt each time), replies of up to 128 tokens, the users starting over 2 s. "
                "Tokens/s counts every token delivered, from the first request sent to the last "
                "token received (replies cut by the end of the run included). "
                "llama-cpp-python's server (`python -m llama_cpp.server`, with "
                "`--interrupt_requests False`: by default it aborts a running stream when another "
                "request arrives) runs one generation at a time behind a lock; Seedance decodes "
                "the streams together. The third figure is llama.cpp's batched decode alone: N "
                "sequences, one token each per `llama_decode`, logits computed but nothing "
                "sampled, no prefill, no serving (`python -m seedance.bench.peers.llama_bare "
                f"batch --sequences N --steps {steps}`). Cells: **Seedance / llama-cpp-python "
                "server (ratio)**. Goals at 8 streams: at least 2.5x the peer's tokens/s and at "
                "most a quarter of its TTFT p50: " + verdict(goal_peer) + "; at least 0.85x of the "
                "batched decode alone: " + verdict(goal_decode) + ". Seedance's figure pays for "
                "prefilling every new prompt (about 40 tokens each, less what the prefix cache "
                "holds: the chat template's system message) inside the same decode steps; the "
                "decode-alone figure prefills nothing.",
                "",
                "![aggregate tokens/s](bench/llama-streams.svg)",
                "",
                "| load | output tokens/s | decode alone tokens/s (Seedance's share) | TTFT p50 ms | TTFT p99 ms | replies | errors |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
                _commands(contenders, loads),
                "",
            ]
        )
    )


# ---- 5c: the second turn of a long conversation
def _second_turns(report: Report) -> None:
    contenders = [
        seedance_llama("KV reuse on", "reuse"),
        seedance_llama("KV reuse off", "noreuse", "--kv-reuse", "false"),
    ]
    ttft: dict[str, list[float]] = {"reuse": [], "noreuse": []}
    prompt_tokens = 0
    with servers(contenders) as running:
        for i in range(report.rounds):
            for key, server in running.items():
                report.log(
                    f"[5c second turn] round {i + 1}/{report.rounds}: {server.contender.label}"
                )
                history = make_prompt(random.Random(i), HISTORY_TOKENS)  # new in every round
                seconds, prompt_tokens = asyncio.run(_second_turn(server.url, history))
                ttft[key].append(seconds * 1000.0)
    on, off = _median(ttft["reuse"]), _median(ttft["noreuse"])
    report.sections.append(
        "\n".join(
            [
                "### 5c. Second turn of a long conversation",
                "",
                f"A new session whose first message is about {HISTORY_TOKENS:,} tokens long "
                "(8-token reply), then a short second message: TTFT of the second turn, whose "
                f"prompt is {prompt_tokens:,} tokens, as the client measures it. With KV reuse, "
                "the session's sequence still holds the history and only the new tokens are "
                "prefilled; with `--kv-reuse false` the whole prompt is prefilled again.",
                "",
                "| | second-turn TTFT ms (median) | rounds |",
                "|---|---|---|",
                f"| KV reuse on (default) | {fmt(on, 0)} | {', '.join(fmt(v, 0) for v in ttft['reuse'])} |",
                f"| KV reuse off | {fmt(off, 0)} ({ratio(off, on)} slower) | {', '.join(fmt(v, 0) for v in ttft['noreuse'])} |",
                "",
                "Commands: " + ", ".join(f"`{c.display()}`" for c in contenders),
                "",
            ]
        )
    )
