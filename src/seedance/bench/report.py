"""The summary table ``seedance bench`` prints, and its ``--json`` file."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

from seedance import __version__
from seedance.bench.load import LoadResult, LoadSpec
from seedance.bench.metrics import Distribution, Summary


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.2f}"


def summary_table(target: str, spec: LoadSpec, result: LoadResult, summary: Summary) -> str:
    load = (
        f"closed loop, {spec.concurrency} users"
        if spec.rate is None
        else f"open loop, {spec.rate:g} req/s (burstiness {spec.burstiness:g})"
        + (f", at most {spec.concurrency} in flight" if spec.concurrency else "")
    )
    conn = "a new connection per request" if spec.new_connection else "connections reused"
    lines = [
        f"target      {target}",
        f"load        {load}; {conn}; prompt ~{spec.prompt_tokens} tokens, "
        f"max_tokens {spec.max_tokens}; warm-up {spec.warmup} requests (excluded)",
        f"requests    {summary.completed} ok of {summary.requests} in {summary.duration_s:.2f} s"
        + (
            "; errors: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.errors.items()))
            if summary.errors
            else ""
        ),
        f"throughput  {summary.requests_per_s:,.1f} req/s · "
        f"{summary.output_tokens_per_s:,.0f} output tokens/s "
        f"({summary.delivered_tokens_per_s:,.0f} delivered, unfinished replies included) · "
        f"{summary.tokens_per_chunk:.2f} tokens per chunk",
        f"client      {result.client_cpu_s:.2f} s CPU over {result.wall_s:.2f} s "
        f"({100 * result.client_cpu_s / max(result.wall_s, 1e-9):.0f}% of one core)",
        "",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    rows: list[tuple[str, Distribution]] = [
        ("TTFT", summary.ttft),
        ("ITL", summary.itl),
        ("TPOT", summary.tpot),
        ("E2EL", summary.e2el),
    ]
    for name, dist in rows:
        lines.append(
            f"{name:<6}"
            + "".join(f"{_fmt(getattr(dist, k)):>10}" for k in ("mean", "p50", "p90", "p99", "max"))
        )
    return "\n".join(lines)


def result_json(
    target: str, spec: LoadSpec, result: LoadResult, summary: Summary, *, samples: bool = True
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "seedance": __version__,
        "python": platform.python_version(),
        "target": target,
        "load": {
            "concurrency": spec.concurrency,
            "rate": spec.rate,
            "burstiness": spec.burstiness,
            "requests": spec.requests,
            "duration_s": spec.duration_s,
            "warmup": spec.warmup,
            "prompt_tokens": spec.prompt_tokens,
            "max_tokens": spec.max_tokens,
            "new_connection": spec.new_connection,
            "ramp_up_s": spec.ramp_up_s,
            "seed": spec.seed,
        },
        "client": {
            "wall_s": round(result.wall_s, 4),
            "cpu_s": round(result.client_cpu_s, 4),
            "connections_opened": result.connections_opened,
            "stopped": result.stopped,
        },
        "summary": summary.to_json(),
    }
    if samples:
        out["samples"] = [s.to_json() for s in result.samples]
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
