"""Suite 13 of ``make bench``: time to first token over OpenAI's Realtime API (a reused
WebSocket) against Seedance's own ``/v2/infer`` and against the Responses API over HTTP
(Server-Sent Events), side by side on one server.

Each way holds a conversation, as its users do: ``/v2/infer`` one session, Realtime one
connection (an item, then ``response.create``), Responses a chain of ``previous_response_id``
(over one kept-alive HTTP connection, and with a new connection per request). One request at a
time; TTFT is measured by the client from sending the request (``response.create``, the POST)
to the first text. Two engines: the synthetic one (no model time: what each way costs) with the
server and the client pinned to cores of their own, and the embedded SmolLM2 (what a user
sees).

The clients run in a child process on the client core (``python -m benchmarks.openai_suite
HTTP_URL MODEL WAY N``), the server on the server core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from benchmarks.harness import (
    CLIENT_CORE,
    cores,
    fmt,
    machine_lines,
    pin_to,
    ratio,
    servers,
)
from benchmarks.http_suite import _server
from seedance.bench.metrics import percentile

if TYPE_CHECKING:
    from benchmarks.harness import Report

WAYS: tuple[tuple[str, str], ...] = (
    ("v2", "`/v2/infer`, one WebSocket"),
    ("realtime", "Realtime API, one WebSocket"),
    ("responses", "Responses API, HTTP + SSE, kept alive"),
    ("responses-new", "Responses API, HTTP + SSE, a new connection per request"),
)
PROMPT = "Tell me something about the sea"


async def _v2(base: str, model: str, n: int, max_tokens: int) -> list[float]:
    from websockets.asyncio.client import connect

    url = base.replace("http://", "ws://") + f"/v2/infer?model={model}"
    times = []
    async with connect(url, compression=None, ping_interval=None) as ws:
        await ws.recv()  # session
        for i in range(n):
            request = {"prompt": f"{PROMPT} ({i})", "max_tokens": max_tokens, "temperature": 0}
            started = time.perf_counter()
            await ws.send(json.dumps(request))
            first = None
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "token" and first is None:
                    first = time.perf_counter()
                if frame["type"] in ("done", "error"):
                    break
            times.append(((first or time.perf_counter()) - started) * 1000)
    return times


async def _realtime(base: str, model: str, n: int, max_tokens: int) -> list[float]:
    from websockets.asyncio.client import connect

    url = base.replace("http://", "ws://") + f"/v1/realtime?model={model}"
    headers = {"Authorization": "Bearer bench"}
    times = []
    async with connect(url, additional_headers=headers, compression=None, max_size=None) as ws:
        await ws.recv()  # session.created
        update = {"type": "realtime", "output_modalities": ["text"]}
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        for i in range(n):
            content = [{"type": "input_text", "text": f"{PROMPT} ({i})"}]
            item = {"type": "message", "role": "user", "content": content}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            response = {"max_output_tokens": max_tokens}
            started = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create", "response": response}))
            first = None
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_text.delta" and first is None:
                    first = time.perf_counter()
                if event["type"] in ("response.done", "error"):
                    break
            times.append(((first or time.perf_counter()) - started) * 1000)
    return times


async def _responses(base: str, model: str, n: int, max_tokens: int, new: bool) -> list[float]:
    import httpx

    times = []
    previous = None
    kept = httpx.AsyncClient(timeout=60)
    try:
        for i in range(n):
            body: dict[str, Any] = {
                "model": model,
                "input": f"{PROMPT} ({i})",
                "max_output_tokens": max_tokens,
                "stream": True,
                "temperature": 0,
            }
            if previous is not None:
                body["previous_response_id"] = previous
            client = httpx.AsyncClient(timeout=60) if new else kept
            try:
                started = time.perf_counter()
                first = None
                async with client.stream("POST", f"{base}/v1/responses", json=body) as answer:
                    async for line in answer.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        if event["type"] == "response.created":
                            previous = event["response"]["id"]
                        elif event["type"] == "response.output_text.delta" and first is None:
                            first = time.perf_counter()
                times.append(((first or time.perf_counter()) - started) * 1000)
            finally:
                if new:
                    await client.aclose()
    finally:
        await kept.aclose()
    return times


async def run_way(base: str, model: str, way: str, n: int, max_tokens: int) -> list[float]:
    if way == "v2":
        return await _v2(base, model, n, max_tokens)
    if way == "realtime":
        return await _realtime(base, model, n, max_tokens)
    return await _responses(base, model, n, max_tokens, new=way == "responses-new")


def openai_suite(report: Report) -> None:
    setups = [
        (
            _server("synthetic", "synthetic engine", "--engine", "synthetic", pinned=True),
            "synthetic",
            150 if report.quick else 400,
            16,
        ),
        (
            _server("model", "SmolLM2-135M (llamacpp)", "--threads", str(cores()), pinned=False),
            "smollm2-135m",
            8 if report.quick else 20,
            8,
        ),
    ]
    rows: list[str] = []
    commands: list[str] = []
    for contender, model, n, max_tokens in setups:
        results: dict[str, list[float]] = {way: [] for way, _ in WAYS}
        with servers([contender]) as running:
            server = running[contender.key]
            base = server.url.replace("ws://", "http://").removesuffix("/v2/infer")
            for round_ in range(report.rounds):
                order = list(WAYS) if round_ % 2 == 0 else list(reversed(WAYS))
                for way, label in order:
                    report.log(f"[13 openai] {contender.label}, round {round_ + 1}: {label}")
                    argv = [sys.executable, "-m", __name__, base, model, way, str(n)]
                    out = subprocess.run(
                        [*argv, "--max-tokens", str(max_tokens)],
                        capture_output=True,
                        text=True,
                        preexec_fn=pin_to(CLIENT_CORE) if contender.pinned else None,
                        check=True,
                    )
                    results[way] += json.loads(out.stdout)[2:]  # the first two warm up
        commands.append(contender.display())
        base50 = statistics.median(results["v2"])
        base99 = percentile(sorted(results["v2"]), 99)
        for way, label in WAYS:
            times = results[way]
            p50, p99 = statistics.median(times), percentile(sorted(times), 99)
            rows.append(
                f"| {contender.label} | {label} | {fmt(p50, 3)} ({ratio(p50, base50)}) "
                f"| {fmt(p99, 3)} ({ratio(p99, base99)}) | {len(times)} |"
            )
    commands.append("python -m benchmarks.openai_suite HTTP_URL MODEL WAY N --max-tokens T")
    report.sections.append(
        "\n".join(
            [
                "## 13. First token: the Realtime API, `/v2/infer` and the Responses API",
                "",
                "The same server answers the same conversation over `/v2/infer` (one WebSocket "
                "and session), OpenAI's Realtime API (one WebSocket: an item, then "
                "`response.create`) and OpenAI's Responses API over HTTP (a chain of "
                "`previous_response_id`, streaming), one request at a time; the client measures "
                "from sending the request to the first text. With the synthetic engine the model "
                "takes no time, so TTFT is what each way costs; with SmolLM2 it is what a user "
                "sees. Ratios are to `/v2/infer`'s. Each round's first two requests warm up and "
                "are not counted; the ways take turns, the order reversed every other round.",
                "",
                *machine_lines(),
                "",
                "| engine | way | TTFT p50 ms | TTFT p99 ms | requests |",
                "|---|---|---|---|---|",
                *rows,
                "",
                "```",
                *commands,
                "```",
                "",
            ]
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="first-token times of one way to ask")
    parser.add_argument("base", help="http://HOST:PORT")
    parser.add_argument("model")
    parser.add_argument("way", choices=[way for way, _ in WAYS])
    parser.add_argument("n", type=int)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    times = asyncio.run(run_way(args.base, args.model, args.way, args.n, args.max_tokens))
    json.dump(times, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
