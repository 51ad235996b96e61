"""Suite 6 of ``make bench``: first-token latency of the same server over a reused WebSocket
and over HTTP (OpenAI API, SSE), with a new connection per reply as most HTTP clients make, and
with a kept-alive one.

Two engines: the synthetic one (no model time: what the transport costs) with the server pinned
to one core and the load generator to the other, and the embedded SmolLM2 (what a user sees
with a real model; nothing pinned, llama.cpp uses every core).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import (
    Cell,
    Contender,
    command_line,
    cores,
    fmt,
    ratio,
    run_bench,
    servers,
)

if TYPE_CHECKING:
    from benchmarks.harness import Report

WAYS: tuple[tuple[str, str, list[str]], ...] = (
    ("ws", "WebSocket, one reused connection", []),
    ("http-new", "HTTP + SSE, a new connection per reply", ["--new-connection"]),
    ("http-keep", "HTTP + SSE, a kept-alive connection", []),
)


def _server(key: str, label: str, *extra: str, pinned: bool) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--port", "{port}", "--log-level", "warning", *extra]
    return Contender(key, label, argv, "/v2/infer", pinned=pinned)


def http_suite(report: Report) -> None:
    synthetic_n = 150 if report.quick else 400
    model_n = 8 if report.quick else 20
    setups = [
        (
            _server("synthetic", "synthetic engine", "--engine", "synthetic", pinned=True),
            ["-c", "1", "-n", str(synthetic_n), "--max-tokens", "16", "--warmup", "5"],
        ),
        (
            _server("model", "SmolLM2-135M (llamacpp)", "--threads", str(cores()), pinned=False),
            [
                *("-c", "1", "-n", str(model_n), "--max-tokens", "8", "--warmup", "2"),
                *("--temperature", "0", "--prompt-tokens", "16"),
            ],
        ),
    ]
    rows: list[str] = []
    commands: list[str] = []
    headline: tuple[float, float] = (float("nan"), float("nan"))
    for contender, args in setups:
        cells = {key: Cell() for key, _, _ in WAYS}
        with servers([contender]) as running:
            server = running[contender.key]
            http = server.url.replace("ws://", "http://").replace("/v2/infer", "/v1")
            total, done = report.rounds * len(WAYS), 0
            for _ in range(report.rounds):
                for key, label, extra in WAYS:
                    done += 1
                    report.log(f"[6 ws vs http] {contender.label} {done}/{total}: {label}")
                    url = server.url if key == "ws" else http
                    # Prompts of their own in every run: none finds another's in the KV cache.
                    seed = ["--seed", str(done)]
                    cells[key].runs.append(
                        run_bench(url, [*args, *extra, *seed], pinned=contender.pinned)
                    )
        commands += [contender.display()] + [
            command_line([*(["--openai", "BASE"] if key != "ws" else []), *args, *extra])
            for key, _, extra in WAYS
        ]

        base50 = cells["ws"].median("summary", "ttft", "p50_ms")
        base99 = cells["ws"].median("summary", "ttft", "p99_ms")
        for key, label, _ in WAYS:
            cell = cells[key]
            p50, p99 = (
                cell.median("summary", "ttft", "p50_ms"),
                cell.median("summary", "ttft", "p99_ms"),
            )
            rows.append(
                f"| {contender.label} | {label} | {fmt(p50, 3)} ({ratio(p50, base50)}) "
                f"| {fmt(p99, 3)} ({ratio(p99, base99)}) | {fmt(cell.median('summary', 'e2el', 'p50_ms'), 2)} |"
            )
            if contender.key == "synthetic" and key == "http-new":
                headline = (base50, p50)
    report.sections.append(
        "\n".join(
            [
                "## 6. First token: reused WebSocket vs HTTP",
                "",
                "The same server answers the same requests over `/v2/infer` (one WebSocket, "
                "reused) and over the OpenAI API (`/v1/chat/completions`, SSE), one request at a "
                "time. With the synthetic engine the model takes no time, so TTFT is what the "
                "transport costs; with SmolLM2 it is what a user sees (every run has prompts of "
                "its own, so that none finds another's in the KV cache). Ratios are to the "
                f"WebSocket's. Headline: with no model time, a new HTTP request takes "
                f"{fmt(headline[1], 3)} ms to its first token against {fmt(headline[0], 3)} ms "
                f"over the reused WebSocket ({ratio(headline[1], headline[0])}).",
                "",
                "| engine | transport | TTFT p50 ms | TTFT p99 ms | E2EL p50 ms |",
                "|---|---|---|---|---|",
                *rows,
                "",
                "Commands (PORT, URL and BASE filled in by the runner):",
                "",
                "```",
                *commands,
                "```",
                "",
            ]
        )
    )
