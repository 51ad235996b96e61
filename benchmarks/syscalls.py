"""The syscall budget: system calls, kernel time and bytes written per delivered token.

Suite 2's fan-out load (the synthetic engine unpaced, 1,000 streams of 128-token replies, the
server pinned to core 0 and the load generator to core 1), with the server's system calls
counted by the kernel while it runs (``perf stat`` on the ``syscalls`` tracepoints: counted in
the kernel, nothing slowed; ``strace -c`` where perf may not, which slows every call), and its
CPU time and bytes written read from ``/proc``. Run from the repository's root:

    python -m benchmarks.syscalls [--streams 1000] [--seconds 8] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import Contender, Server, cpu, fan_out_loads, run_bench, seedance

#: The calls a serving loop makes, each counted on its own (the rest: ``other``).
CALLS = (
    "write",
    "writev",
    "sendto",
    "sendmsg",
    "read",
    "recvfrom",
    "epoll_pwait",
    "epoll_wait",
    "epoll_ctl",
    "getpid",
    "accept4",
    "futex",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("extra", nargs="*", help="more `seedance serve` flags")
    args = parser.parse_args(argv)
    contender = seedance("Seedance", "seedance", *args.extra)
    figures = measure(contender, args.streams, args.seconds)
    print(table(figures, args.streams, contender))
    return 0


def measure(contender: Contender, streams: int, seconds: int) -> dict[str, float]:
    """Counts over one fan-out run: per call, and the totals the table divides."""
    _, load = fan_out_loads(False)[0]
    load = [*load]
    load[load.index("-c") + 1], load[load.index("-d") + 1] = str(streams), str(seconds)
    server = Server(contender)
    try:
        pid = server.proc.pid
        counter = _counter(pid)
        before = _proc(pid)
        result = run_bench(server.url, load)
        after = _proc(pid)
        counter.send_signal(2)  # SIGINT: perf and strace print their counts and end
        _, report = counter.communicate(timeout=30)
    finally:
        server.stop()
    counts = _counts(report)
    summary = result["summary"]
    return {
        **counts,
        "tokens": float(summary["output_tokens"]),
        "frames": float(summary["chunks"]),
        "tokens_per_s": float(summary["delivered_tokens_per_s"]),
        **{key: after[key] - before[key] for key in after},
    }


def _counter(pid: int) -> subprocess.Popen[str]:
    if shutil.which("perf") and _perf_allowed(pid):
        events = ",".join(["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{c}" for c in CALLS)])
        argv = ["perf", "stat", "-x", ",", "-e", events, "-p", str(pid)]
    elif shutil.which("strace"):
        argv = ["strace", "-c", "-f", "-p", str(pid)]
    else:
        raise SystemExit("neither perf nor strace is installed")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attached
    return proc


def _perf_allowed(pid: int) -> bool:
    probe = subprocess.run(
        ["perf", "stat", "-e", "raw_syscalls:sys_enter", "-p", str(pid), "sleep", "0.1"],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


def _counts(report: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in report.splitlines():
        perf = line.split(",")
        if len(perf) > 3 and perf[2].startswith(("syscalls:", "raw_syscalls:")):
            name = perf[2].removeprefix("syscalls:sys_enter_")
            counts["all" if name.startswith("raw_") else name] = float(perf[0] or 0)
            continue
        strace = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if strace:
            counts[strace.group(2)] = float(strace.group(1))
    counts.setdefault("all", sum(counts.values()))
    return counts


def _proc(pid: int) -> dict[str, float]:
    """The server's CPU seconds (user, system) and bytes written so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = 100.0
    io = dict(
        line.split(": ")
        for line in Path(f"/proc/{pid}/io").read_text().splitlines()
        if ": " in line
    )
    return {
        "user_s": int(fields[11]) / tick,
        "system_s": int(fields[12]) / tick,
        "written": float(io["wchar"]),
    }


def table(figures: dict[str, float], streams: int, contender: Contender) -> str:
    tokens, frames = figures["tokens"], figures["frames"]
    listed = sum(figures.get(c, 0.0) for c in CALLS)
    rows = [
        f"| {name} | {figures.get(name, 0.0):,.0f} | {figures.get(name, 0.0) / tokens:.4f} "
        f"| {figures.get(name, 0.0) / frames:.3f} |"
        for name in CALLS
        if figures.get(name)
    ]
    other = figures["all"] - listed
    cpu_s = figures["user_s"] + figures["system_s"]
    return "\n".join(
        [
            f"{streams} streams, `{contender.display()}`, {cpu()}: "
            f"{figures['tokens_per_s']:,.0f} tokens/s delivered, {tokens:,.0f} tokens in "
            f"{frames:,.0f} frames ({tokens / frames:.1f} tokens a frame)",
            "",
            "| system call | calls | per token | per frame |",
            "|---|---|---|---|",
            *rows,
            f"| other | {other:,.0f} | {other / tokens:.4f} | {other / frames:.3f} |",
            f"| **all** | {figures['all']:,.0f} | {figures['all'] / tokens:.4f} "
            f"| {figures['all'] / frames:.3f} |",
            "",
            f"CPU: {cpu_s:.2f} s ({figures['system_s'] / cpu_s:.0%} in the kernel), "
            f"{cpu_s / tokens * 1e6:.2f} µs a token; bytes written: "
            f"{figures['written'] / tokens:.1f} a token, {figures['written'] / frames:.0f} a frame.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
