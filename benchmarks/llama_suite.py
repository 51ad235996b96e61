"""Suite 5 of ``make bench``: the ``llamacpp`` engine on the embedded SmolLM2 against
llama.cpp's own C++ server (``llama-server``, built from the llama.cpp source that the pinned
llama-cpp-python vendors, with the engine's CMake flags: :mod:`benchmarks.llama_server`),
llama-cpp-python's server, and llama.cpp driven by a bare loop, in one run.

Every contender uses the same GGUF file, the same number of threads (all cores) and the same
weight layout (the engine's ``--repack auto`` decision, given to llama-server as
``--no-repack`` when off), so the servers are not pinned: llama.cpp needs every core, and the
load generator's share is small at these token rates. Contenders take turns (A B A B ...);
figures are medians over rounds.
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

import aiohttp

from benchmarks.harness import (
    Contender,
    commands,
    cores,
    fmt,
    metric_sums,
    ratio,
    servers,
    verdict,
)
from benchmarks.llama_server import NATIVE_FLAGS, ensure_built
from benchmarks.svg import bar_chart
from seedance.bench.load import make_prompt
from seedance.client import connect
from seedance.engines.llamacpp.cpu import resolve_repack
from seedance.engines.llamacpp.native import backend_cwd
from seedance.engines.local import default_model_path
from seedance.protocol.openai import decode_stream_chunk, sse_data

if TYPE_CHECKING:
    from benchmarks.harness import Report

PROMPT = "Write a long story about a dragon who learns to sail."
STREAMS = (1, 4, 8)
HISTORY_TOKENS = 1000
PREFILL_WORDS = 1000
SECOND_MESSAGE = "Which word came first?"


def _threads() -> str:
    return str(cores())


def _repack() -> bool:
    """The engine's own decision for this machine (probed once, then cached)."""
    return resolve_repack("auto", default_model_path(), cores()).repack


def seedance_llama(label: str, key: str, *extra: str) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--port", "{port}", "--log-level", "warning", "--threads", _threads()]
    argv += ["--repack", "on" if _repack() else "off"]
    return Contender(key, label, [*argv, *extra], "/v2/infer", pinned=False)


def llama_server(report: Report, native: bool = False) -> Contender:
    """llama.cpp's ``llama-server`` with 8 slots of 4,096 tokens, as Seedance has by default;
    built with the engine's flags, or ``native`` (for this CPU alone, as a user who builds
    llama.cpp gets it)."""
    binary = ensure_built(report.log, NATIVE_FLAGS if native else None)
    argv = [str(binary), "-m", str(default_model_path()), "--port", "{port}"]
    argv += ["-t", _threads(), "-tb", _threads(), "--parallel", "8", "-c", "32768"]
    argv += ["--log-disable", *([] if _repack() else ["--no-repack"])]
    if native:
        return Contender("native", "llama-server (native)", argv, "/v1", pinned=False)
    return Contender("llama", "llama-server", argv, "/v1", pinned=False)


def llama_cpp_server() -> Contender:
    """llama-cpp-python's OpenAI-compatible server; by default it aborts a running stream when
    another request arrives, so the benchmark turns that off. A runtime-dispatch build finds its
    CPU backends only in the working directory (Seedance's engine loads them itself). Its weight
    layout is the engine's decision for this machine (:mod:`benchmarks.peers.llama_cpp_server`)."""
    argv = [sys.executable, "-m", "benchmarks.peers.llama_cpp_server"]
    argv += [*([] if _repack() else ["--no-repack"]), "--model", str(default_model_path())]
    argv += ["--port", "{port}", "--n_threads", _threads(), "--n_threads_batch", _threads()]
    argv += ["--n_ctx", "4096", "--interrupt_requests", "False", "--verbose", "False"]
    cwd = backend_cwd()
    repo = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # benchmarks, from cwd
    return Contender(
        "peer", "llama-cpp-python server", argv, "/v1", pinned=False, cwd=cwd, env=repo
    )


def bare(*args: str) -> dict[str, float]:
    """One measurement of the bare llama.cpp loop (``benchmarks.peers.llama_bare``)."""
    argv = [sys.executable, "-m", "benchmarks.peers.llama_bare", *args]
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


async def _ttft_ws(url: str, turns: list[str], max_tokens: int = 8) -> tuple[float, int]:
    """One new session's turns over a WebSocket: (seconds to the last turn's first token, its
    prompt tokens)."""
    async with connect(url) as session:
        for text in turns[:-1]:
            await session.generate(text, temperature=0, max_tokens=8).collect()
        stream = session.generate(turns[-1], temperature=0, max_tokens=max_tokens)
        sent = time.perf_counter()
        first = None
        async for _ in stream:
            first = first or time.perf_counter()
        assert first is not None and stream.start is not None
        return first - sent, stream.start.prompt_tokens


async def _ttft_http(base: str, turns: list[str], max_tokens: int = 8) -> tuple[float, int]:
    """The same over the OpenAI API, the conversation sent whole each turn (as a client of a
    stateless server does): (seconds to the last turn's first token, its prompt tokens)."""
    messages: list[dict[str, str]] = []
    # A connection per request: llama-server closes each one after its stream.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            last = i == len(turns) - 1
            body = {
                "model": "smollm2-135m",
                "messages": messages,
                "temperature": 0,
                "max_tokens": max_tokens if last else 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sent, first, reply, prompt_tokens = time.perf_counter(), None, [], 0
            async with http.post(f"{base}/chat/completions", json=body) as response:
                response.raise_for_status()
                async for data in sse_data(response.content):
                    chunk = decode_stream_chunk(data)
                    if chunk.usage is not None and chunk.usage.prompt_tokens:
                        prompt_tokens = chunk.usage.prompt_tokens
                    for choice in chunk.choices:
                        if choice.content:
                            first = first or time.perf_counter()
                            reply.append(choice.content)
            messages.append({"role": "assistant", "content": "".join(reply)})
        if first is None or not prompt_tokens:
            raise RuntimeError(f"{base} sent no token or no usage")
        return first - sent, prompt_tokens


def _ttft(url: str, turns: list[str], max_tokens: int = 8) -> tuple[float, int]:
    measure = _ttft_http if url.startswith("http") else _ttft_ws
    return asyncio.run(measure(url, turns, max_tokens))


def llama_suite(report: Report) -> None:
    _decode(report)
    _concurrency(report)
    _second_turns(report)
    _prefill(report)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _rounds(
    report: Report,
    title: str,
    steps: list[tuple[str, Callable[[], float]]],
    rounds: int | None = None,
) -> dict[str, list[float]]:
    """Run each named step once per round (``report.rounds`` unless given), in turn; the
    values by name."""
    rounds = rounds or report.rounds
    values: dict[str, list[float]] = {name: [] for name, _ in steps}
    total, done = rounds * len(steps), 0
    for _ in range(rounds):
        for name, step in steps:
            done += 1
            report.log(f"[{title}] {done}/{total}: {name}")
            values[name].append(step())
    return values


# ---- 5a: one stream's decode rate
# A round takes a second or two, and on a shared 2-core VM one round's rate moves by 10%
# (154 to 170 tokens/s in one run): the median of more rounds than the other suites use.
_DECODE_ROUNDS = 5


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
            rounds=max(report.rounds, _DECODE_ROUNDS),
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
                f"benchmarks.peers.llama_bare generate --tokens {tokens}`: prefill, then "
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
def _stream_loads(report: Report) -> list[tuple[str, list[str]]]:
    """Closed loops of 1, 4 and 8 users: 16-word prompts, replies of up to 128 tokens."""
    seconds = {1: 20, 4: 40, 8: 60}
    if report.quick:
        seconds = {n: s // 2 for n, s in seconds.items()}
    return [
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


def _concurrency(report: Report) -> None:
    contenders = [
        seedance_llama("Seedance", "seedance"),
        llama_server(report),
        llama_cpp_server(),
    ]
    loads = _stream_loads(report)
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "5b concurrency")
    steps = 20 if report.quick else 40

    def decode_alone(n: int) -> Callable[[], float]:
        return lambda: bare("batch", "--sequences", str(n), "--steps", str(steps))["tokens_per_s"]

    decode_only = _rounds(report, "5b decode only", [(str(n), decode_alone(n)) for n in STREAMS])
    rows = []
    chart: dict[str, list[float]] = {"seedance": [], "llama": [], "peer": [], "decode": []}
    goal_llama = True
    for n, (load, _) in zip(STREAMS, loads, strict=True):
        cell = {key: cells[(load, key)] for key in ("seedance", "llama", "peer")}
        tps = {k: c.median("summary", "delivered_tokens_per_s") for k, c in cell.items()}
        t50 = {k: c.median("summary", "ttft", "p50_ms") for k, c in cell.items()}
        t99 = {k: c.median("summary", "ttft", "p99_ms") for k, c in cell.items()}
        limit = _median(decode_only[str(n)])
        for key in ("seedance", "llama", "peer"):
            chart[key].append(tps[key])
        chart["decode"].append(limit)
        if n >= 4:
            goal_llama &= tps["seedance"] >= tps["llama"] and t50["seedance"] <= t50["llama"]
        rows.append(
            f"| {load} | {fmt(tps['seedance'], 1)} / {fmt(tps['llama'], 1)} "
            f"({ratio(tps['seedance'], tps['llama'])}) / {fmt(tps['peer'], 1)} "
            f"| {fmt(limit, 1)} ({ratio(tps['seedance'], limit)}) "
            f"| {fmt(t50['seedance'], 0)} / {fmt(t50['llama'], 0)} "
            f"({ratio(t50['seedance'], t50['llama'])}) / {fmt(t50['peer'], 0)} "
            f"| {fmt(t99['seedance'], 0)} / {fmt(t99['llama'], 0)} / {fmt(t99['peer'], 0)} "
            f"| {' / '.join(str(round(c.median('summary', 'completed'))) for c in cell.values())} "
            f"| {' / '.join(str(c.errors()) for c in cell.values())} |"
        )
    report.goals.append(
        (
            "5b. llama.cpp, 4 and 8 streams: at least llama-server's tokens/s, at most its TTFT p50",
            "",
            goal_llama,
        )
    )
    report.images.mkdir(parents=True, exist_ok=True)
    (report.images / "llama-streams.svg").write_text(
        bar_chart(
            "Aggregate output tokens/s, SmolLM2-135M Q4_1 (higher is better)",
            [load for load, _ in loads],
            [
                ("Seedance", chart["seedance"]),
                ("llama-server", chart["llama"]),
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
                "token received (replies cut by the end of the run included). The peers: "
                "llama.cpp's own `llama-server` (C++, continuous batching over 8 slots, driven "
                "over its OpenAI API), built from the llama.cpp source that llama-cpp-python "
                f"{_llama_cpp_version()} vendors with the engine's CMake flags; and "
                "llama-cpp-python's server (`--interrupt_requests False`: by default it aborts a "
                "running stream when another request arrives), which runs one generation at a "
                "time. The decode-alone figure is llama.cpp's batched decode with no serving: N "
                "sequences, one token each per `llama_decode`, logits computed but nothing "
                "sampled, no prefill (`python -m benchmarks.peers.llama_bare batch "
                f"--sequences N --steps {steps}`). Cells: **Seedance / llama-server (ratio) / "
                "llama-cpp-python server**. Goal at 4 and 8 streams: at least llama-server's "
                "tokens/s and at most its TTFT p50: " + verdict(goal_llama) + ".",
                "",
                "![aggregate tokens/s](bench/llama-streams.svg)",
                "",
                "| load | output tokens/s | decode alone tokens/s (Seedance's share) | TTFT p50 ms | TTFT p99 ms | replies | errors |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
                commands(contenders, loads),
                "",
            ]
        )
    )


def _llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


# ---- 5c: the second turn of a long conversation
def _second_turns(report: Report) -> None:
    contenders = [
        seedance_llama("Seedance", "reuse"),
        seedance_llama("Seedance, KV reuse off", "noreuse", "--kv-reuse", "false"),
        llama_server(report),
    ]
    labels = {c.key: c.label for c in contenders}
    second: dict[str, list[float]] = {c.key: [] for c in contenders}
    first: dict[str, list[float]] = {c.key: [] for c in contenders}
    prompt_tokens = 0
    with servers(contenders) as running:
        for i in range(report.rounds + 1):  # the first round warms every server up
            history = make_prompt(random.Random(i), HISTORY_TOKENS)  # new in every round
            for key, server in running.items():
                report.log(f"[5c second turn] round {i + 1}/{report.rounds + 1}: {labels[key]}")
                seconds, tokens = _ttft(server.url, [history, SECOND_MESSAGE])
                alone, _ = _ttft(server.url, [SECOND_MESSAGE])
                if i > 0:
                    second[key].append(seconds * 1000.0)
                    first[key].append(alone * 1000.0)
                    prompt_tokens = prompt_tokens or tokens
    med2 = {k: _median(v) for k, v in second.items()}
    med1 = {k: _median(v) for k, v in first.items()}
    ok = med2["reuse"] <= 1.5 * med1["reuse"]
    report.goals.append(
        (
            f"5c. llama.cpp: a second turn after {HISTORY_TOKENS:,} tokens of history within "
            "1.5x the TTFT of the same message with no history",
            "",
            ok,
        )
    )
    rows = [
        f"| {labels[k]} | {fmt(med2[k], 0)} | {fmt(med1[k], 0)} | {ratio(med2[k], med1[k])} "
        f"| {', '.join(fmt(v, 0) for v in second[k])} |"
        for k in second
    ]
    report.sections.append(
        "\n".join(
            [
                "### 5c. Second turn of a long conversation",
                "",
                f"A new session whose first message is about {HISTORY_TOKENS:,} words long "
                f"(8-token reply), then `{SECOND_MESSAGE}`: TTFT of that second turn (its "
                f"prompt is {prompt_tokens:,} tokens), against the TTFT of the same message as "
                "the first turn of a new session, as the client measures them. Seedance keeps "
                "the session on the server and prefills only the new tokens; with `--kv-reuse "
                "false` it prefills the whole prompt again. llama-server gets the conversation "
                "whole (OpenAI API) and reuses its slot's cache for the common prefix. Goal: "
                "Seedance's second turn within 1.5x its first: " + verdict(ok) + ".",
                "",
                "| | second turn TTFT ms (median) | first turn, same message, ms | ratio | rounds (second turn) |",
                "|---|---|---|---|---|",
                *rows,
                "",
                "Commands: " + ", ".join(f"`{c.display()}`" for c in contenders),
                "",
            ]
        )
    )


# ---- 5d: prefill of a long prompt
def _prefill(report: Report) -> None:
    contenders = [seedance_llama("Seedance", "seedance"), llama_server(report)]
    labels = {c.key: c.label for c in contenders}
    rates: dict[str, list[float]] = {c.key: [] for c in contenders}
    with servers(contenders) as running:
        for i in range(report.rounds + 1):
            prompt = make_prompt(random.Random(1000 + i), PREFILL_WORDS)  # nothing cached
            for key, server in running.items():
                report.log(f"[5d prefill] round {i + 1}/{report.rounds + 1}: {labels[key]}")
                seconds, tokens = _ttft(server.url, [prompt], max_tokens=1)
                if i > 0:
                    rates[key].append(tokens / seconds)
    ours, theirs = _median(rates["seedance"]), _median(rates["llama"])
    ok = ours >= theirs
    report.goals.append(("5d. llama.cpp: prefill tokens/s at least llama-server's", "", ok))
    report.sections.append(
        "\n".join(
            [
                "### 5d. Prefill of a long prompt",
                "",
                f"A new prompt of about {PREFILL_WORDS:,} words in every round, one token of "
                "reply: prompt tokens over the time to that token, as the client measures it. "
                "Goal: at least llama-server's rate: " + verdict(ok) + ".",
                "",
                "| | prefill tokens/s (median) | rounds |",
                "|---|---|---|",
                *(
                    f"| {labels[k]} | {fmt(_median(v), 0)} | {', '.join(fmt(x, 0) for x in v)} |"
                    for k, v in rates.items()
                ),
                "",
            ]
        )
    )


# ---- 22: against llama-server built for this CPU
#: New 16-word prompts whose first token is timed, one at a time, for suite 22's breakdown.
_FIRST_TOKENS = 20
#: Seedance's time to first token as its ``/metrics`` has it: the sum and the count.
_TTFT = ("seedance_time_to_first_token_seconds_sum", "seedance_time_to_first_token_seconds_count")


def native_suite(report: Report) -> None:
    """Suite 22 of ``make bench``: the engine as ``make serve`` installs it (llama.cpp's runtime CPU dispatch) against
    ``llama-server`` built with ``GGML_NATIVE=ON``, at 1, 4 and 8 streams; and where one
    stream's first token goes."""
    contenders = [seedance_llama("Seedance", "seedance"), llama_server(report, native=True)]
    loads = _stream_loads(report)
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "22 native llama-server")
        report.log("[22] first tokens, one at a time")
        parts = {key: _first_token_parts(server.url) for key, server in running.items()}
    rows, goal = [], True
    for load, _ in loads:
        ours, theirs = cells[(load, "seedance")], cells[(load, "native")]
        tps = [c.median("summary", "delivered_tokens_per_s") for c in (ours, theirs)]
        t50 = [c.median("summary", "ttft", "p50_ms") for c in (ours, theirs)]
        if load == "1 streams":
            goal = tps[0] >= tps[1] and t50[0] <= t50[1]
        rows.append(
            f"| {load} | {fmt(tps[0], 1)} / {fmt(tps[1], 1)} ({ratio(*tps)}) "
            f"| {fmt(t50[0], 0)} / {fmt(t50[1], 0)} ({ratio(*t50)}) "
            f"| {ours.errors()} / {theirs.errors()} |"
        )
    prompt_tokens = round(_median(parts["seedance"]["prompt_tokens"]))
    floor = [bare("prefill", "--tokens", str(prompt_tokens))["prefill_s"] * 1000 for _ in "12"]
    whole = min(floor)
    breakdown = []
    for key, label in (("seedance", "Seedance"), ("native", "llama-server (native)")):
        client = _median(parts[key]["client_ms"])
        server = _median(parts[key]["server_ms"]) if parts[key]["server_ms"] else None
        breakdown.append(
            f"| {label} | {fmt(client, 1)} "
            f"| {'' if server is None else fmt(server, 1)} "
            f"| {'' if server is None else fmt(client - server, 1)} | {fmt(whole, 1)} |"
        )
    report.goals.append(
        (
            "22. llama.cpp, 1 stream, against llama-server built for this CPU: at least its "
            "tokens/s, at most its TTFT p50",
            "",
            goal,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 22. The embedded engine against llama-server built for this CPU",
                "",
                "The engine as `make serve` installs it (llama.cpp's runtime CPU dispatch: one "
                "backend per instruction-set level, the best one this CPU runs loaded at start) "
                "against `llama-server` built from the same llama.cpp with `GGML_NATIVE=ON` (what "
                "a user who builds llama.cpp gets: `-march=native`, one backend linked in). The "
                "loads of suite 5b. Cells: **Seedance / llama-server (native) (ratio)**. Goal at 1 "
                "stream: at least its tokens/s and at most its TTFT p50: " + verdict(goal) + ".",
                "",
                "| load | output tokens/s | TTFT p50 ms | errors |",
                "|---|---|---|---|",
                *rows,
                "",
                f"Where one stream's first token goes: {_FIRST_TOKENS} new 16-word prompts "
                f"({prompt_tokens} prompt tokens with the chat template), one at a time, one "
                "token of reply, medians. Seedance's server time is its "
                "`seedance_time_to_first_token_seconds` (from reading the request to sending "
                "its first token); the wire and the client are the rest. Both servers keep the "
                "chat template's opening (SmolLM2's default system prompt) from the conversation "
                "before and prefill only the rest; the last column is what prefilling the whole "
                "prompt takes in llama.cpp's bare loop (`python -m benchmarks.peers.llama_bare "
                f"prefill --tokens {prompt_tokens}`, warm, the better of two).",
                "",
                "| | client TTFT ms | server ms | the wire and the client ms | whole prompt, "
                "bare loop ms |",
                "|---|---|---|---|---|",
                *breakdown,
                "",
                commands(contenders, loads),
                "",
            ]
        )
    )


def _first_token_parts(url: str) -> dict[str, list[float]]:
    """Times of :data:`_FIRST_TOKENS` first tokens at ``url`` as the client sees them, and (a
    Seedance) as the server does, from its ``/metrics``; the prompts' token counts."""
    parts: dict[str, list[float]] = {"client_ms": [], "server_ms": [], "prompt_tokens": []}
    seedance = url.startswith("ws")
    for i in range(_FIRST_TOKENS):
        prompt = make_prompt(random.Random(5000 + i), 16)
        before = metric_sums(url, *_TTFT) if seedance else [0.0, 0.0]
        seconds, tokens = _ttft(url, [prompt], max_tokens=1)
        parts["client_ms"].append(seconds * 1000)
        parts["prompt_tokens"].append(tokens)
        if seedance:
            after = metric_sums(url, *_TTFT)
            if after[1] == before[1] + 1:
                parts["server_ms"].append((after[0] - before[0]) * 1000)
    return parts
