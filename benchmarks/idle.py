"""Suite 3 of ``make bench``. Idle connections: what each costs in memory and file descriptors, and the handshakes."""

from __future__ import annotations

import shlex
import statistics
import time
from typing import Any

from benchmarks.harness import Report, Server, fmt, ratio, raw, run_bench, seedance, verdict


def idle(report: Report) -> None:
    big = 2000 if report.quick else 10_000
    hold = "10" if report.quick else "30"
    # The many connections heartbeat every 10 s (more often than the protocol's default
    # 25 s); the 10-connection baseline pings often enough to give a p99 of its own.
    intervals = {10: "0.2", big: "10"}
    contenders = [seedance("Seedance", "seedance"), raw()]
    sizes = (10, big)
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    total = report.rounds * len(sizes) * len(contenders)
    done = 0
    for _ in range(report.rounds):
        for n in sizes:
            for c in contenders:
                done += 1
                report.log(f"[3 idle] {done}/{total}: {c.label}, {n} connections")
                server = Server(c)
                try:
                    run_bench(
                        server.url,
                        ["-c", "1", "-n", "20", "--warmup", "5", "--max-tokens", "8"],
                    )
                    time.sleep(0.5)
                    base = server.rss_bytes()
                    args = [
                        "--idle-connections",
                        str(n),
                        "-d",
                        hold,
                        "--ping-interval",
                        intervals[n],
                    ]
                    result = run_bench(server.url, args, watch=server)
                    result["base_rss"] = base
                    results.setdefault((n, c.key), []).append(result)
                finally:
                    server.stop()

    def per_conn(n: int, key: str) -> float:
        return float(
            statistics.median((r["peak_rss"] - r["base_rss"]) / n for r in results[(n, key)])
        )

    def p99(n: int, key: str) -> float:
        values = [r["heartbeat"]["p99_ms"] or float("nan") for r in results[(n, key)]]
        return float(statistics.median(values))

    def failures(n: int, key: str) -> int:
        return sum(r["failures"] for r in results[(n, key)])

    mem_sd, mem_raw = per_conn(big, "seedance"), per_conn(big, "raw")
    p_small, p_big = p99(10, "seedance"), p99(big, "seedance")
    ok_mem = mem_sd <= 1.5 * mem_raw
    ok_p99 = p_big <= 2 * p_small
    report.goals.append(
        (f"3. Idle: memory per connection within 1.5x of raw ({big:,} connections)", "", ok_mem)
    )
    report.goals.append(
        (
            f"3. Idle: heartbeat p99 with {big:,} connections within 2x of the p99 with 10",
            "",
            ok_p99,
        )
    )
    rows = []
    for c in contenders:
        rows.append(
            f"| {c.label} | {fmt(per_conn(big, c.key) / 1024, 1)} KiB | {fmt(p99(10, c.key), 3)} "
            f"| {fmt(p99(big, c.key), 3)} | {ratio(p99(big, c.key), p99(10, c.key))} "
            f"| {failures(10, c.key) + failures(big, c.key)} |"
        )
    report.sections.append(
        "\n".join(
            [
                "## 3. Idle connections",
                "",
                f"{big:,} open connections (each a session on Seedance) held for {hold} s, each sending a "
                f"heartbeat ping every {intervals[big]} s ({big // int(intervals[big]):,} pings/s in all), "
                f"against 10 connections pinging every {intervals[10]} s; the server also sends its own "
                "heartbeats. Memory is the server's resident set at its peak minus the same server's after "
                "a short warm-up, divided by the connections. "
                f"Goals: memory per connection no more than 1.5x the raw library's ({verdict(ok_mem)}), and "
                f"heartbeat round-trip p99 with {big:,} connections within 2x of the p99 with 10 "
                f"({verdict(ok_p99)}).",
                "",
                f"| server | memory per connection | heartbeat p99 ms, 10 conns | p99 ms, {big:,} conns | ratio | failures |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                "```",
                *(c.display() for c in contenders),
                shlex.join(
                    [
                        "seedance",
                        "bench",
                        "URL",
                        "--idle-connections",
                        "N",
                        "-d",
                        hold,
                        "--ping-interval",
                        "S",
                    ]
                ),
                "```",
            ]
        )
    )
