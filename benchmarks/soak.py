"""``make soak``: mixed traffic against real servers for minutes, watching for leaks.

For each engine (the synthetic engine, then the embedded model) a ``seedance serve`` with one
tenant, its API key and a signed audit log takes traffic from ``--streams`` users at once. Each
user, over and over, picks one of:

- a streamed reply, read to its ``done``;
- a reply cancelled after its first token (``done`` says ``cancelled``);
- a reconnect to its session (the session and its context are still there);
- bad frames (not JSON, an unknown type), each answered with an error, the connection open;
- a streamed reply over the OpenAI API (SSE to ``[DONE]``);
- a connection dropped mid-stream without a close (a dead phone), then a new one.

Every 5 seconds it samples the server's RSS, open file descriptors and event loop tasks (from
``/admin/runtime``, with an admin key of its own), and the p99 TTFT of the requests finished in
those 5 seconds. It passes when, after the warm-up (the first quarter), all of them stay flat
(the last third against the first third, within the slack below), no request failed in a way
its action did not expect, and neither API key nor a prompt appears in the server's log. The
report (tables and plots) goes to ``docs/soak.md``.

    python -m benchmarks.soak --duration 600             # what make soak runs
    python -m benchmarks.soak --duration 60 --engines synthetic
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection, connect

from benchmarks.harness import machine_lines
from benchmarks.svg import line_chart
from seedance.netutil import free_port
from seedance.tenants.keys import add_key

SAMPLE_S = 5.0
WARMUP_SHARE = 0.25
# What "flat" allows between the first and the last third after warm-up.
RSS_SLACK = (1.10, 16 * 1024 * 1024)  # ratio, plus bytes
FDS_SLACK = 16
TASKS_SLACK = (1.25, 16)
P99_SLACK = (2.0, 0.050)  # ratio, plus seconds
ACTIONS = (
    ("stream", 50),
    ("cancel", 10),
    ("reconnect", 10),
    ("bad frames", 10),
    ("http stream", 12),
    ("vanish", 8),
)
SECRET_PROMPT = "soak-prompt-marker"  # in every prompt; must never reach the log


@dataclass
class Sample:
    at_s: float
    rss: int
    fds: int
    tasks: int
    p99_ttft_s: float
    requests: int


@dataclass
class Run:
    engine: str
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)  # secrets found in the log
    verdicts: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.verdicts)


class Traffic:
    """The users: each loops over random actions until ``stop`` is set."""

    def __init__(self, ws_url: str, http_url: str, key: str, max_tokens: int) -> None:
        self.ws_url, self.http_url, self.key = ws_url, http_url, key
        self.max_tokens = max_tokens
        self.headers = {"Authorization": f"Bearer {key}"}
        self.ttfts: list[float] = []  # of requests finished since the last sample
        self.finished = 0
        self.actions: dict[str, int] = {}
        self.unexpected: list[str] = []
        self.stop = asyncio.Event()

    def _fail(self, what: str) -> None:
        if len(self.unexpected) < 50:
            self.unexpected.append(what)

    async def user(self, index: int, http: aiohttp.ClientSession) -> None:
        rng = random.Random(index)
        names = [name for name, _ in ACTIONS]
        weights = [weight for _, weight in ACTIONS]
        ws, session_id = await self._open(None)
        try:
            while not self.stop.is_set():
                action = rng.choices(names, weights)[0]
                self.actions[action] = self.actions.get(action, 0) + 1
                try:
                    ws, session_id = await self._act(action, ws, session_id, http, rng)
                except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                    self._fail(f"{action}: {type(exc).__name__}: {exc}")
                    with contextlib.suppress(Exception):
                        await ws.close()
                    ws, session_id = await self._open(session_id)
                except Exception as exc:  # a closed connection, a frame out of place
                    self._fail(f"{action}: {type(exc).__name__}: {exc}")
                    with contextlib.suppress(Exception):
                        await ws.close()
                    ws, session_id = await self._open(session_id)
        finally:
            with contextlib.suppress(Exception):
                await ws.close()

    async def _open(self, session_id: str | None) -> tuple[ClientConnection, str]:
        query = f"?session_id={session_id}" if session_id else ""
        ws = await connect(
            f"{self.ws_url}{query}",
            additional_headers=self.headers,
            ping_interval=None,
            open_timeout=30,
        )
        hello = await self._recv(ws)
        if hello.get("type") != "session":
            raise RuntimeError(f"expected a session frame, got {hello}")
        if session_id is not None and hello["session_id"] != session_id:
            self._fail(f"reconnect: got session {hello['session_id']}, not {session_id}")
        return ws, str(hello["session_id"])

    async def _recv(self, ws: ClientConnection, timeout: float = 60.0) -> dict[str, Any]:
        while True:
            data = await asyncio.wait_for(ws.recv(), timeout)
            if isinstance(data, bytes):
                if data == b"\x01\x00":  # the server's heartbeat
                    await ws.send(b"\x02\x00")
                continue
            frame: dict[str, Any] = json.loads(data)
            return frame

    def _prompt(self, rng: random.Random) -> str:
        return f"{SECRET_PROMPT} {rng.randrange(10**6)}: tell me something about the sea."

    async def _generate(
        self, ws: ClientConnection, rng: random.Random, max_tokens: int, reset: bool = True
    ) -> tuple[float, dict[str, Any]]:
        """Send a generate; (seconds to the first token or the end, the first frame after
        ``start``)."""
        request = {"prompt": self._prompt(rng), "max_tokens": max_tokens, "reset": reset}
        for _ in range(100):
            sent = time.perf_counter()
            await ws.send(json.dumps(request))
            frame = await self._recv(ws)
            while frame["type"] == "start":
                frame = await self._recv(ws)
            # After a dropped connection, its generation may still be stopping on the
            # session: retry, as the error says a client may.
            if frame["type"] != "error" or frame["error"]["code"] != "session_busy":
                break
            await asyncio.sleep(0.02)
        return time.perf_counter() - sent, frame

    async def _act(
        self,
        action: str,
        ws: ClientConnection,
        session_id: str,
        http: aiohttp.ClientSession,
        rng: random.Random,
    ) -> tuple[ClientConnection, str]:
        if action == "stream":
            ttft, frame = await self._generate(ws, rng, rng.randint(4, self.max_tokens))
            while frame["type"] == "token":
                frame = await self._recv(ws)
            self._done(frame, ("stop", "length"), ttft, action)
        elif action == "cancel":
            ttft, frame = await self._generate(ws, rng, 4 * self.max_tokens)
            if frame["type"] == "token":
                await ws.send(json.dumps({"type": "cancel"}))
                while frame["type"] == "token":
                    frame = await self._recv(ws)
            self._done(frame, ("cancelled", "stop", "length"), ttft, action)
        elif action == "reconnect":
            await ws.close()
            return await self._open(session_id)
        elif action == "bad frames":
            for bad, code in (
                ("{not json", "invalid_json"),
                ('{"type":"nope"}', "invalid_request"),
            ):
                await ws.send(bad)
                frame = await self._recv(ws)
                if frame.get("type") != "error" or frame["error"]["code"] != code:
                    self._fail(f"bad frame {bad!r}: got {frame}")
        elif action == "http stream":
            await self._http_stream(http, rng)
        elif action == "vanish":
            _, frame = await self._generate(ws, rng, 4 * self.max_tokens)
            ws.transport.abort()  # no close frame: the server finds out on its own
            return await self._open(session_id)
        return ws, session_id

    def _done(
        self, frame: dict[str, Any], reasons: tuple[str, ...], ttft: float, action: str
    ) -> None:
        if frame.get("type") == "done" and frame.get("finish_reason") in reasons:
            self.ttfts.append(ttft)
            self.finished += 1
        else:
            self._fail(f"{action}: ended with {frame}")

    async def _http_stream(self, http: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {
            "messages": [{"role": "user", "content": self._prompt(rng)}],
            "max_tokens": rng.randint(4, self.max_tokens),
            "stream": True,
        }
        sent, first, done = time.perf_counter(), None, False
        async with http.post(f"{self.http_url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                self._fail(f"http stream: HTTP {response.status}: {await response.text()}")
                return
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: ") and first is None:
                    first = time.perf_counter()
                if b'"error"' in line:
                    self._fail(f"http stream: {line.decode(errors='replace').strip()}")
        if not done:
            self._fail("http stream: ended without [DONE]")
            return
        self.ttfts.append((first or time.perf_counter()) - sent)
        self.finished += 1


def _proc_figures(pid: int) -> tuple[int, int]:
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def _tasks(http: aiohttp.ClientSession, url: str, admin_key: str) -> int:
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with http.get(f"{url}/admin/runtime", headers=headers) as response:
        body = await response.json()
    return int(body["event_loop_tasks"])


async def _drive(
    run: Run, proc: subprocess.Popen[bytes], port: int, keys: tuple[str, str], streams: int
) -> None:
    key, admin_key = keys
    max_tokens = 64 if run.engine == "synthetic" else 24
    base = f"http://127.0.0.1:{port}"
    traffic = Traffic(f"ws://127.0.0.1:{port}/v2/infer", base, key, max_tokens)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=traffic.headers) as http:
        users = [asyncio.create_task(traffic.user(i, http)) for i in range(streams)]
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < run.duration_s:
            await asyncio.sleep(SAMPLE_S)
            ttfts, traffic.ttfts = traffic.ttfts, []
            rss, fds = _proc_figures(proc.pid)
            p99 = statistics.quantiles(ttfts, n=100)[98] if len(ttfts) >= 2 else float("nan")
            tasks = await _tasks(http, base, admin_key)
            sample = Sample(elapsed, rss, fds, tasks, p99, len(ttfts))
            run.samples.append(sample)
            print(
                f"[soak {run.engine}] {elapsed:5.0f} s: RSS {rss / 2**20:6.1f} MiB, {fds} fds, "
                f"{sample.tasks} tasks, p99 TTFT {p99 * 1000:7.1f} ms, {len(ttfts)} requests",
                file=sys.stderr,
            )
        traffic.stop.set()
        await asyncio.gather(*users, return_exceptions=True)
    run.actions, run.unexpected = traffic.actions, traffic.unexpected


def _judge(run: Run) -> None:
    after = [s for s in run.samples if s.at_s > run.duration_s * WARMUP_SHARE]
    third = max(1, len(after) // 3)
    first, last = after[:third], after[-third:]

    def median(values: list[float]) -> float:
        values = [v for v in values if v == v]  # NaN: a sample with too few requests
        return statistics.median(values) if values else float("nan")

    def check(name: str, a: float, b: float, ratio: float, plus: float, unit: str) -> None:
        ok = b <= a * ratio + plus
        run.verdicts.append((name, ok, f"{a:.{unit}} then {b:.{unit}}"))

    rss_a, rss_b = median([s.rss for s in first]) / 2**20, median([s.rss for s in last]) / 2**20
    check("RSS (MiB)", rss_a, rss_b, RSS_SLACK[0], RSS_SLACK[1] / 2**20, "1f")
    check(
        "open fds",
        median([s.fds for s in first]),
        median([s.fds for s in last]),
        1.0,
        FDS_SLACK,
        "0f",
    )
    tasks_a, tasks_b = median([s.tasks for s in first]), median([s.tasks for s in last])
    check("event loop tasks", tasks_a, tasks_b, TASKS_SLACK[0], TASKS_SLACK[1], "0f")
    p99_a = median([s.p99_ttft_s for s in first]) * 1000
    p99_b = median([s.p99_ttft_s for s in last]) * 1000
    check("p99 TTFT (ms)", p99_a, p99_b, P99_SLACK[0], P99_SLACK[1] * 1000, "1f")
    run.verdicts.append(
        (
            "no unexpected failure",
            not run.unexpected,
            f"{len(run.unexpected)}" + (f": {run.unexpected[0]}" if run.unexpected else ""),
        )
    )
    run.verdicts.append(
        (
            "no secret in the log",
            not run.leaked,
            ", ".join(run.leaked) or "API key and prompts absent",
        )
    )


def soak(engine: str, duration_s: float, streams: int, workdir: Path) -> Run:
    config = workdir / f"{engine}.toml"
    key = add_key(config, "soak").key
    admin_key = add_key(config, "ops", role="admin").key
    port = free_port()
    log_path = workdir / f"{engine}.log"
    argv = [
        str(Path(sys.executable).with_name("seedance")),
        "serve",
        "--engine",
        engine,
        "--port",
        str(port),
        "--config",
        str(config),
        "--audit-file",
        str(workdir / f"{engine}-audit.log"),
        "--log-level",
        "info",
    ]
    if engine == "synthetic":
        argv += ["--synthetic-tokens-per-s", "100", "--synthetic-ttft-ms", "20"]
    run = Run(engine, duration_s)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while b"connect to ws://" not in log_path.read_bytes():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"seedance serve did not start:\n{log_path.read_text()}")
                time.sleep(0.2)
            asyncio.run(_drive(run, proc, port, (key, admin_key), streams))
        finally:
            proc.terminate()
            proc.wait(60)
    text = log_path.read_text(errors="replace")
    if key in text or admin_key in text:
        run.leaked.append("an API key")
    if SECRET_PROMPT in text:
        run.leaked.append("a prompt")
    _judge(run)
    return run


def _ms_or_0(seconds: float) -> float:
    return seconds * 1000 if seconds == seconds else 0.0  # NaN: too few requests to tell


def report(runs: Sequence[Run], out: Path, started: float) -> None:
    figures = out.parent / "bench"
    figures.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Soak",
        "",
        "Generated by `make soak` (`python -m benchmarks.soak`); do not edit by hand. Mixed "
        "traffic (streams, cancels, reconnects, bad frames, OpenAI API streams and connections "
        "dropped mid-stream without a close) from many users at once against `seedance serve` "
        "with a tenant, its API key and an audit log; the server's RSS, open file descriptors "
        "and event loop tasks, and the p99 TTFT of the requests finished, sampled every "
        f"{SAMPLE_S:.0f} s. After the warm-up (the first quarter) each must stay flat: the "
        "median of the last third against that of the first third.",
        "",
        "## Machine",
        "",
        *machine_lines(),
        f"- run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}",
        "",
    ]
    for run in runs:
        verdict = "**pass**" if run.passed else "**fail**"
        actions = ", ".join(f"{name} {count:,}" for name, count in sorted(run.actions.items()))
        xs = [s.at_s for s in run.samples]
        samples = run.samples
        charts = {
            "memory": line_chart(
                f"{run.engine}: server RSS",
                xs,
                [("RSS MiB", [s.rss / 2**20 for s in samples])],
                unit="MiB",
                x_unit="seconds",
            ),
            "handles": line_chart(
                f"{run.engine}: open fds and event loop tasks",
                xs,
                [("fds", [s.fds for s in samples]), ("tasks", [s.tasks for s in samples])],
                x_unit="seconds",
            ),
            "latency": line_chart(
                f"{run.engine}: p99 TTFT of each {SAMPLE_S:.0f} s",
                xs,
                [("p99 TTFT ms", [_ms_or_0(s.p99_ttft_s) for s in samples])],
                unit="ms",
                x_unit="seconds",
            ),
        }
        for name, svg in charts.items():
            (figures / f"soak-{run.engine}-{name}.svg").write_text(svg)
        lines += [
            f"## {run.engine}: {verdict}",
            "",
            f"{run.duration_s:.0f} s; actions: {actions}.",
            "",
            "| check | result | first third, then last third |",
            "|---|---|---|",
            *(
                f"| {name} | {'pass' if ok else 'fail'} | {detail} |"
                for name, ok, detail in run.verdicts
            ),
            "",
            *(f"![{name}](bench/soak-{run.engine}-{name}.svg)" for name in charts),
            "",
            "| s | RSS MiB | fds | tasks | p99 TTFT ms | requests |",
            "|---|---|---|---|---|---|",
            *(
                f"| {s.at_s:.0f} | {s.rss / 2**20:.1f} | {s.fds} | {s.tasks} | "
                f"{s.p99_ttft_s * 1000:.1f} | {s.requests} |"
                for s in run.samples[:: max(1, len(run.samples) // 20)]
            ),
            "",
        ]
        if run.unexpected:
            lines += [
                "Unexpected failures (first ones):",
                "",
                *(f"- {u}" for u in run.unexpected[:10]),
                "",
            ]
    out.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds in all (split)")
    parser.add_argument("--engines", default="synthetic,llamacpp")
    parser.add_argument("--streams", type=int, default=50, help="users at once")
    parser.add_argument("--out", type=Path, default=Path("docs/soak.md"))
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    started = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="seedance-soak-") as tmp:
        for engine in engines:
            runs.append(soak(engine, args.duration / len(engines), args.streams, Path(tmp)))
    report(runs, args.out, started)
    for run in runs:
        for name, ok, detail in run.verdicts:
            print(f"{run.engine}: {name}: {'pass' if ok else 'FAIL'} ({detail})")
    passed = all(run.passed for run in runs)
    print(f"soak: {'pass' if passed else 'FAIL'}; report in {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
