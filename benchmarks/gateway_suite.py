"""Suite 7 of ``make bench``: Seedance in gateway mode against LiteLLM's proxy and against no
gateway at all, all in front of the same fast synthetic OpenAI upstream.

The upstream (``benchmarks.peers.openai_sse``, no model time) and the load generator share
the client core; the gateway under test has the server core to itself. Two loads: one user
sending request after request (the TTFT a gateway adds: its p50 minus the direct p50) and 32
users at once (the most requests a second the gateway passes on). LiteLLM runs from its own
virtual environment (``make bench`` creates ``.venv-litellm``; its dependencies would change
the project's own) with one worker, no database and no callbacks.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import (
    CLIENT_CORE,
    Cell,
    Contender,
    command_line,
    fmt,
    ratio,
    run_bench,
    servers,
    venv_version,
)

if TYPE_CHECKING:
    from benchmarks.harness import Report

#: Where ``make bench`` installs LiteLLM (override with ``LITELLM=/path/to/litellm``).
LITELLM_DEFAULT = ".venv-litellm/bin/litellm"
MODEL = "synthetic"
#: LiteLLM refuses to start without a master key; every path is sent it (the others ignore it).
KEY = "sk-seedance-bench"


def litellm_path() -> Path:
    return Path(os.environ.get("LITELLM", LITELLM_DEFAULT))


def litellm_executable() -> Path | None:
    path = litellm_path()
    return path if path.exists() else None


def litellm_version(exe: Path) -> str:
    """The version of the LiteLLM next to ``exe`` (in its own virtual environment)."""
    return venv_version(exe, "litellm")


def _upstream() -> Contender:
    argv = [sys.executable, "-m", "benchmarks.peers.openai_sse", "--port", "{port}"]
    return Contender("upstream", "synthetic upstream", argv, "/v1", core=CLIENT_CORE)


def _seedance(upstream: str) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--engine", "openai", "--upstream", upstream, "--port", "{port}"]
    argv += ["--log-level", "warning", "--max-waiting", "20000"]
    return Contender("seedance", "Seedance gateway", argv, "/v1")


def _litellm(exe: Path, upstream: str, folder: Path) -> Contender:
    config = folder / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
        "  telemetry: false\n"
    )
    argv = [str(exe), "--config", str(config), "--port", "{port}", "--num_workers", "1"]
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_MASTER_KEY": KEY,
    }
    return Contender("litellm", "LiteLLM proxy", argv, "/v1", env=env)


def gateway_suite(report: Report) -> None:
    latency_n = 100 if report.quick else 300
    duration = "4" if report.quick else "8"
    loads = {
        "latency": ["-c", "1", "-n", str(latency_n), "--max-tokens", "16", "--warmup", "10"],
        "throughput": ["-c", "32", "-d", duration, "--max-tokens", "16", "--warmup", "64"],
    }
    exe = litellm_executable()
    with tempfile.TemporaryDirectory() as tmp, servers([_upstream()]) as up:
        upstream = up["upstream"].url
        gateways = [_seedance(upstream)]
        if exe is not None:
            gateways.append(_litellm(exe, upstream, Path(tmp)))
        else:
            report.log(f"[7 gateway] LiteLLM not found at {litellm_path()}: left out")
        with servers(gateways) as running:
            # (url, label, pinned client?) for every way to reach the upstream.
            ways = [("direct", upstream, "direct (no gateway)")]
            seedance_url = running["seedance"].url
            ways.append(("seedance-http", seedance_url, "Seedance, HTTP + SSE"))
            ways.append(
                (
                    "seedance-ws",
                    seedance_url.replace("http://", "ws://").replace("/v1", "/v2/infer"),
                    "Seedance, WebSocket",
                )
            )
            if "litellm" in running:
                ways.append(("litellm", running["litellm"].url, "LiteLLM, HTTP + SSE"))
            cells: dict[tuple[str, str], Cell] = {}
            total, done = report.rounds * len(loads) * len(ways), 0
            for load, args in loads.items():
                for _ in range(report.rounds):
                    for key, url, label in ways:
                        done += 1
                        report.log(f"[7 gateway] {done}/{total}: {label}, {load}")
                        run = run_bench(url, [*args, "--model", MODEL, "--api-key", KEY])
                        cells.setdefault((load, key), Cell()).runs.append(run)
    _write(report, cells, ways, loads, gateways, litellm_version(exe) if exe else None)


def _write(
    report: Report,
    cells: dict[tuple[str, str], Cell],
    ways: list[tuple[str, str, str]],
    loads: dict[str, list[str]],
    gateways: list[Contender],
    litellm: str | None,
) -> None:
    def ttft(key: str, q: str = "p50_ms") -> float:
        return cells[("latency", key)].median("summary", "ttft", q)

    def rps(key: str) -> float:
        return cells[("throughput", key)].median("summary", "requests_per_s")

    direct50 = ttft("direct")
    rows = []
    for key, _, label in ways:
        added = "-" if key == "direct" else fmt(ttft(key) - direct50, 3)
        errors = sum(cells[(load, key)].errors() for load in loads)
        rows.append(
            f"| {label} | {fmt(ttft(key), 3)} | {fmt(ttft(key, 'p99_ms'), 3)} | {added} "
            f"| {fmt(rps(key), 0)} | {errors} |"
        )
    lines = [
        "## 7. Gateway mode: Seedance vs LiteLLM's proxy",
        "",
        "The same synthetic OpenAI upstream (no model time) is reached directly, through "
        f"Seedance's `openai` engine and through LiteLLM's proxy ({litellm or 'absent'}, "
        "one worker). The gateway has "
        "one core; the upstream and the load generator share the other. *Added* is the "
        "gateway's TTFT p50 minus the direct one. Requests/s is 32 users sending 16-token "
        "requests back to back; the core shared by the upstream and the load generator caps "
        "it (the direct row), so a gateway at that figure is not its own limit.",
        "",
        "| path | TTFT p50 ms | TTFT p99 ms | added ms | requests/s | errors |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if litellm:
        ours, theirs = ttft("seedance-http") - direct50, ttft("litellm") - direct50
        ours_rps, theirs_rps = rps("seedance-http"), rps("litellm")
        report.goals.append(
            (
                "7. gateway: Seedance adds at most a fifth of LiteLLM's TTFT (HTTP to HTTP)",
                "",
                ours <= theirs / 5,
            )
        )
        report.goals.append(
            (
                "7. gateway: Seedance passes at least 3x LiteLLM's requests/s",
                "",
                ours_rps >= 3 * theirs_rps,
            )
        )
        lines += [
            f"Seedance over HTTP adds {fmt(ours, 3)} ms to the first token, LiteLLM "
            f"{fmt(theirs, 3)} ms ({ratio(ours, theirs)} of LiteLLM's; goal: at most 0.20x). "
            f"Seedance passes {fmt(ours_rps, 0)} requests/s, LiteLLM {fmt(theirs_rps, 0)} "
            f"({ratio(ours_rps, theirs_rps)}; goal: at least 3x).",
            "",
        ]
    else:
        lines += ["LiteLLM was not installed for this run (`make bench` installs it).", ""]
    lines += [
        "Commands (PORT, URL and UPSTREAM filled in by the runner):",
        "",
        "```",
        "python -m benchmarks.peers.openai_sse --port PORT",
        *(g.display() for g in gateways),
        *(command_line([*args, "--model", MODEL]) for args in loads.values()),
        "```",
        "",
    ]
    report.sections.append("\n".join(lines))
