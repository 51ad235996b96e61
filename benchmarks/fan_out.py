"""Suite 2 of ``make bench``. The fan-out ceiling: every server CPU-bound, with merging on and off."""

from __future__ import annotations

from benchmarks.harness import (
    Report,
    commands,
    fan_out_loads,
    fmt,
    ratio,
    raw,
    raw_picows,
    seedance,
    servers,
    verdict,
)
from benchmarks.svg import bar_chart


def fan_out(report: Report) -> None:
    contenders = [
        seedance("Seedance, merging on (5 ms)", "merge"),
        seedance("Seedance, merging off", "nomerge", "--merge-window-ms", "0"),
        raw(),
        raw_picows(),
    ]
    loads = fan_out_loads(report.quick)
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "2 fan-out")
    rows = []
    chart: dict[str, list[float]] = {c.key: [] for c in contenders}
    goal_ok = False
    for load, _ in loads:
        base = cells[(load, "raw")].median("summary", "delivered_tokens_per_s")
        base_ttft = cells[(load, "raw")].median("summary", "ttft", "p99_ms")
        for c in contenders:
            cell = cells[(load, c.key)]
            tps = cell.median("summary", "delivered_tokens_per_s")
            chart[c.key].append(tps)
            per_chunk = cell.median("summary", "output_tokens") / max(
                cell.median("summary", "chunks"), 1
            )
            alone = sum(r["summary"]["first_chunk_alone"] for r in cell.runs)
            completed = sum(r["summary"]["completed"] for r in cell.runs)
            ttft99 = cell.median("summary", "ttft", "p99_ms")
            rows.append(
                f"| {load} | {c.label} | {fmt(tps)} | {ratio(tps, base)} | {fmt(per_chunk)} "
                f"| {alone:,} of {completed:,} "
                f"| {fmt(cell.median('summary', 'ttft', 'p50_ms'))} | {fmt(ttft99)} ({ratio(ttft99, base_ttft)}) "
                f"| {cell.errors()} |"
            )
            if load.startswith("1000") and c.key == "merge":
                goal_ok = tps >= 3 * base and alone == completed
    report.goals.append(
        (
            "2. Fan-out: merging on, 1,000 streams, at least 3x the raw server's tokens/s, first token never merged",
            "",
            goal_ok,
        )
    )
    report.stack = {
        (load, c.key): cells[(load, c.key)].median("summary", "delivered_tokens_per_s")
        for load, _ in loads
        for c in contenders
    }
    report.images.mkdir(parents=True, exist_ok=True)
    (report.images / "fan-out.svg").write_text(
        bar_chart(
            "Delivered tokens/s, unlimited token rate (higher is better)",
            [load for load, _ in loads],
            [(c.label, chart[c.key]) for c in contenders],
            unit="tokens/s",
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 2. Fan-out ceiling",
                "",
                "The synthetic engine with no delay at all, 128-token replies, no warm-up (delivered "
                "tokens/s counts every token received, from the first request sent to the last token): every server is CPU-bound, "
                "and what it delivers is its ceiling. Goal: with merging on, at least 3x the raw server's "
                "tokens/s at 1,000 streams, and the first token never delayed by merging (it always "
                "travels alone in its frame, written as soon as the engine yields it; the TTFT columns "
                "show the time spent waiting for a saturated event loop, with the ratio to the raw "
                "server's p99): " + verdict(goal_ok) + ".",
                "",
                "![delivered tokens/s](bench/fan-out.svg)",
                "",
                "| load | server | delivered tokens/s | vs raw | tokens per frame | first frame alone | TTFT p50 ms | TTFT p99 ms | errors |",
                "|---|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                commands(contenders, loads),
            ]
        )
    )
