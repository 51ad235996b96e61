"""Suite 1 of ``make bench``. The token path's overhead: Seedance against a raw ``websockets`` server, paced streams."""

from __future__ import annotations

from benchmarks.harness import (
    TOKEN_PATH_RATE,
    Report,
    commands,
    fmt,
    pair,
    ratio,
    raw,
    seedance,
    servers,
    token_path_loads,
    verdict,
)


def token_path(report: Report) -> None:
    rate = TOKEN_PATH_RATE
    contenders = [
        seedance("Seedance", "seedance", "--synthetic-tokens-per-s", str(rate)),
        raw("--tokens-per-s", str(rate)),
    ]
    loads = token_path_loads(report.quick)
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "1 token path")
    rows = []
    ok_all = True
    for load, _ in loads:
        sd, rw = cells[(load, "seedance")], cells[(load, "raw")]
        t50 = pair(sd, rw, "summary", "ttft", "p50_ms")
        t99 = pair(sd, rw, "summary", "ttft", "p99_ms")
        tps = pair(sd, rw, "summary", "output_tokens_per_s")
        ok = t50[0] <= 1.2 * t50[1] and t99[0] <= 1.2 * t99[1] and tps[0] >= tps[1] * 0.99
        ok_all &= ok
        rows.append(
            f"| {load} | {fmt(t50[0])} / {fmt(t50[1])} ({ratio(*t50)}) "
            f"| {fmt(t99[0])} / {fmt(t99[1])} ({ratio(*t99)}) "
            f"| {fmt(tps[0])} / {fmt(tps[1])} ({ratio(*tps)}) "
            f"| {fmt(sd.median('summary', 'itl', 'p99_ms'))} / {fmt(rw.median('summary', 'itl', 'p99_ms'))} "
            f"| {sd.errors()} / {rw.errors()} | {'yes' if ok else 'no'} |"
        )
    report.goals.append(
        (
            "1. Token path overhead: TTFT p50, p99 within 1.2x, tokens/s at least equal",
            "",
            ok_all,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 1. Token path overhead",
                "",
                f"The synthetic engine paced at {rate} tokens/s per stream (a typical model speed), "
                "16-token replies, closed loop, one reused connection per stream; the streams start "
                "spread over one second (`--ramp-up 1`) so that they do not tick in lockstep, and the "
                "first request of each is warm-up. At 1,000 streams both servers are CPU-bound "
                f"({rate * 1000:,} tokens/s asked for): TTFT is then mostly time spent waiting for the "
                "event loop, and output tokens/s (of the replies completed in the run) is what counts. "
                "Each cell: **Seedance / raw websockets (ratio)**. "
                "Goal: TTFT p50 and p99 within 1.2x of the raw server's, output tokens/s at least equal: "
                + verdict(ok_all)
                + ".",
                "",
                "| load | TTFT p50 ms | TTFT p99 ms | output tokens/s | ITL p99 ms | errors | goal |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
                commands(contenders, loads),
            ]
        )
    )
