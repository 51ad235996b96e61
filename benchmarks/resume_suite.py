"""Suite 9 of ``make bench``: resuming a stream after its connection dropped.

Clients, several at once, each ask for a ``resumable`` reply, drop the socket (no close frame)
after a few tokens, connect again to the same session, send ``resume`` after the last token
they hold, and read the rest. Measured: from the start of the new connection to the first
replayed token (a new TCP and WebSocket handshake, the ``session`` frame, the ``resume`` and its
answer), and whether every reply ended whole, each token once. No peer resumes a stream, so
there is nothing to compare with side by side; the figure to read is the resume latency
against a fresh request's time to first token, measured in the same run.

The clients run in a child process pinned to the client core
(``python -m benchmarks.resume_suite URL``), the server on the server core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from benchmarks.harness import CLIENT_CORE, fmt, pin_to, seedance, servers
from seedance.bench.metrics import percentile

if TYPE_CHECKING:
    from benchmarks.harness import Report

TOKENS_PER_S = "200"
MAX_TOKENS = 200
DROP_AFTER = 20


async def _trial(url: str, index: int) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    session = f"resume-{os.getpid()}-{index}"
    target = f"{url}?session_id={session}"
    request = {"prompt": f"story {index}", "max_tokens": MAX_TOKENS, "resumable": True}
    last_seq = -1
    started = time.perf_counter()
    first_token = None
    async with connect(target, ping_interval=None, compression=None) as ws:
        hello = json.loads(await ws.recv())
        await ws.send(json.dumps({**request, "request_id": "r"}))
        while last_seq < DROP_AFTER:
            frame = json.loads(await ws.recv())
            if frame["type"] == "token":
                first_token = first_token or time.perf_counter()
                last_seq = frame["seq"] + frame.get("n", 1) - 1
        ws.transport.abort()
    reconnect = time.perf_counter()
    replayed = None
    seqs_ok = True
    async with connect(target, ping_interval=None, compression=None) as ws:
        await ws.recv()  # session
        resume = {"type": "resume", "request_id": "r", "after_seq": last_seq}
        await ws.send(json.dumps({**resume, "epoch": hello["epoch"]}))
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "token":
                replayed = replayed or time.perf_counter()
                seqs_ok &= frame["seq"] == last_seq + 1
                last_seq = frame["seq"] + frame.get("n", 1) - 1
            elif frame["type"] in ("done", "error"):
                break
    whole = seqs_ok and frame.get("usage", {}).get("completion_tokens") == last_seq + 1
    return {
        "ttft_ms": ((first_token or reconnect) - started) * 1000,
        "resume_ms": ((replayed or time.perf_counter()) - reconnect) * 1000,
        "whole": whole and last_seq + 1 == MAX_TOKENS,
    }


async def _clients(url: str, trials: int, concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> dict[str, Any]:
        async with gate:
            return await _trial(url, index)

    return list(await asyncio.gather(*(one(i) for i in range(trials))))


def resume_suite(report: Report) -> None:
    trials = 100 if report.quick else 400
    concurrency = 20
    contender = seedance("Seedance", "seedance", "--synthetic-tokens-per-s", TOKENS_PER_S)
    with servers([contender]) as running:
        url = running["seedance"].url
        report.log(f"[9 resume] {trials} drops and resumes, {concurrency} at once")
        out = subprocess.run(
            [sys.executable, "-m", __name__, url, str(trials), str(concurrency)],
            capture_output=True,
            text=True,
            preexec_fn=pin_to(CLIENT_CORE),
            check=True,
        )
    results = json.loads(out.stdout)
    resume = [r["resume_ms"] for r in results]
    ttft = [r["ttft_ms"] for r in results]
    whole = sum(r["whole"] for r in results)
    ok = whole == len(results)
    report.goals.append(
        ("9. Resume: every dropped reply ends whole, each token once", f"{whole}/{trials}", ok)
    )
    report.sections.append(
        "\n".join(
            [
                "## 9. Resuming a dropped stream",
                "",
                f"{trials} clients, {concurrency} at once, each ask for a resumable reply of "
                f"{MAX_TOKENS} tokens (synthetic engine at {TOKENS_PER_S} tokens/s), drop the "
                f"socket after token {DROP_AFTER} with no close frame, connect again to the "
                "same session and resume after the last token they hold. Resume latency: from "
                "the start of the new connection to the first replayed token (TCP and "
                "WebSocket handshake, the session frame, the resume and its answer). A fresh "
                "request's time to first token is measured in the same run.",
                "",
                "| | p50 ms | p99 ms |",
                "|---|---|---|",
                f"| resume latency | {fmt(statistics.median(resume), 2)} "
                f"| {fmt(percentile(sorted(resume), 99), 2)} |",
                f"| first token of a new request | {fmt(statistics.median(ttft), 2)} "
                f"| {fmt(percentile(sorted(ttft), 99), 2)} |",
                "",
                f"Replies that ended whole, every token once, in order: {whole} of {trials}.",
                "",
                "```",
                contender.display(),
                f"python -m benchmarks.resume_suite URL {trials} {concurrency}",
                "```",
                "",
            ]
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="resume trials against a Seedance server")
    parser.add_argument("url")
    parser.add_argument("trials", type=int)
    parser.add_argument("concurrency", type=int)
    args = parser.parse_args()
    results = asyncio.run(_clients(args.url, args.trials, args.concurrency))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
