"""Suite 4 of ``make bench``. The design document's table: 50 and 500 clients, whole replies."""

from __future__ import annotations

from benchmarks.harness import Report, commands, fmt, pair, ratio, raw, seedance, servers, verdict


def design_table(report: Report) -> None:
    duration = "3" if report.quick else "6"
    contenders = [seedance("Seedance", "seedance"), raw()]
    loads = [
        (
            f"{n} clients",
            ["-c", str(n), "-d", duration, "--max-tokens", "16", "--prompt-tokens", "32"],
        )
        for n in (50, 500)
    ]
    claims = {"50 clients": (218, 142), "500 clients": (1943, 287)}
    with servers(contenders) as running:
        cells = report.alternate(running, loads, "4 design table")
    rows = []
    ok_all = True
    for load, _ in loads:
        sd, rw = cells[(load, "seedance")], cells[(load, "raw")]
        rps = pair(sd, rw, "summary", "requests_per_s")
        p99 = pair(sd, rw, "summary", "e2el", "p99_ms")
        ok = rps[0] >= 0.8 * rps[1] and p99[0] <= 1.25 * p99[1]
        ok_all &= ok
        claim = claims[load]
        rows.append(
            f"| {load} | {fmt(rps[0])} | {fmt(p99[0])} | {fmt(rps[1])} | {fmt(p99[1])} "
            f"| {ratio(*rps)} | {ratio(*p99)} | {claim[0]:,} / {claim[1]} | {'yes' if ok else 'no'} |"
        )
    report.goals.append(
        (
            "4. Design table: at least 0.8x the raw server's req/s, p99 within 1.25x (50 and 500 clients)",
            "",
            ok_all,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 4. The design document's table",
                "",
                "50 and 500 concurrent clients, 16-token replies, the synthetic engine without delays; "
                "latency is the whole reply (E2EL). The design document claimed the figures in the "
                "*design* column (req/s / p99 ms). Goal: at least 0.8x the raw server's requests/s with "
                "p99 within 1.25x of its p99: " + verdict(ok_all) + ".",
                "",
                "| load | Seedance req/s | Seedance p99 ms | raw req/s | raw p99 ms | req/s ratio | p99 ratio | design | goal |",
                "|---|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                commands(contenders, loads),
            ]
        )
    )
