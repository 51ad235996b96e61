"""The load generator: closed loop (N users back to back) or open loop (a request rate).

- closed loop, ``concurrency=N``: N users, each with its own connection, send their next
  request as soon as the previous reply ends (``ramp_up_s`` spreads their first requests);
- open loop, ``rate=R``: requests arrive at gamma-distributed gaps with mean ``1/R`` and shape
  ``burstiness`` (1 = Poisson, lower = burstier), whatever the server's pace; an arrival takes
  an idle connection or opens one; ``concurrency`` then caps the requests in flight.

The first ``warmup`` requests are run and recorded but excluded from the figures.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TextIO

from seedance.bench.metrics import Sample
from seedance.bench.targets import BenchError, Clock, Conn, Target

# Connections opened at once before a run (more would overflow the server's accept backlog).
CONNECT_PARALLELISM = 256

_WORDS = (
    "time token stream session model latency socket frame signal river light garden market "
    "engine quantum people world year state work life day way man part place case week system "
    "program question number night point home water room mother area money story fact month"
).split()


@dataclass(slots=True)
class LoadSpec:
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    prompt_tokens: int = 32
    max_tokens: int = 64
    new_connection: bool = False
    ramp_up_s: float = 0.0
    give_up_s: float = 10.0  # nothing but lost connections for this long: the target is gone
    seed: int = 0

    def check(self) -> None:
        if self.concurrency is None and self.rate is None:
            raise ValueError("give --concurrency N (closed loop) or --rate R (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("--rate must be above 0")
        if self.burstiness <= 0:
            raise ValueError("--burstiness must be above 0")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give --requests N or --duration S")
        if self.requests is not None and self.requests < 1:
            raise ValueError("--requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be above 0")
        if self.ramp_up_s < 0:
            raise ValueError("--ramp-up must be 0 or more")
        if self.give_up_s <= 0:
            raise ValueError("--give-up-after must be above 0")
        if self.warmup < 0 or self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("--warmup must be >= 0, --prompt-tokens and --max-tokens >= 1")


@dataclass(slots=True)
class LoadResult:
    samples: list[Sample]
    wall_s: float
    client_cpu_s: float
    connections_opened: int
    extra: dict[str, float] = field(default_factory=dict)
    stopped: str | None = None  # why the run ended early (the target stopped answering)


def make_prompt(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words (one word is one token for the synthetic engine)."""
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


class Progress:
    """A live line on a terminal; elsewhere a line every few seconds, and one at the end."""

    def __init__(self, total: int | None, duration_s: float | None, out: TextIO | None) -> None:
        self.total = total
        self.duration_s = duration_s
        self.out = out
        self.done = 0
        self.errors = 0
        self.tokens = 0
        self._tty = bool(out is not None and out.isatty())

    def line(self, elapsed: float) -> str:
        goal = (
            f"/{self.total}"
            if self.total is not None
            else f" in {elapsed:.0f}/{self.duration_s:.0f} s"
        )
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"requests {self.done}{goal} · {self.done / max(elapsed, 1e-9):,.0f} req/s · "
            f"{rate:,.0f} tok/s · errors {self.errors}"
        )

    async def run(self, clock: Clock) -> None:
        if self.out is None:
            return
        interval = 0.25 if self._tty else 5.0
        try:
            while True:
                await asyncio.sleep(interval)
                self.show(clock.now())
        finally:
            self.show(clock.now(), final=True)

    def show(self, elapsed: float, *, final: bool = False) -> None:
        if self.out is None:
            return
        if self._tty:
            self.out.write("\r\x1b[2K" + self.line(elapsed) + ("\n" if final else ""))
        else:
            self.out.write(self.line(elapsed) + "\n")
        self.out.flush()


async def open_connections(target: Target, count: int, progress: TextIO | None) -> list[Conn]:
    """Open ``count`` connections, a bounded number at a time."""
    gate = asyncio.Semaphore(CONNECT_PARALLELISM)
    opened = 0

    async def one() -> Conn:
        nonlocal opened
        async with gate:
            conn = await target.connect()
            opened += 1
            if progress is not None and progress.isatty() and opened % 100 == 0:
                progress.write(f"\r\x1b[2Kconnecting {opened}/{count}")
                progress.flush()
            return conn

    results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    conns = [r for r in results if isinstance(r, Conn)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        raise failures[0]
    if progress is not None and progress.isatty() and count >= 100:
        progress.write("\r\x1b[2K")
    return conns


async def run_load(
    target: Target, spec: LoadSpec, *, progress_out: TextIO | None = sys.stderr
) -> LoadResult:
    spec.check()
    await target.prepare()
    try:
        return await _Run(target, spec, progress_out).run()
    finally:
        await target.close()


#: Errors that mean the connection (or the target) is gone, not that one request failed.
LOST: Final = ("disconnected", "connect_failed", "handshake_failed", "http_failed")
_BACKOFF_S: Final = (0.05, 2.0)  # the first wait after a lost connection, and the longest


def lost(error: str | None) -> bool:
    return error is not None and error.startswith(LOST)


class _Run:
    def __init__(self, target: Target, spec: LoadSpec, out: TextIO | None) -> None:
        self.target = target
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.clock = Clock()
        self.samples: list[Sample] = []
        self.total = None if spec.requests is None else spec.requests + spec.warmup
        self.progress = Progress(self.total, spec.duration_s, out)
        self.out = out
        self.connections_opened = 0
        self.deadline: float | None = None
        self.failing_since: float | None = None  # first lost connection since a success
        self.lost_in_a_row = 0
        self.stopped: str | None = None

    def _next_sample(self, user: int) -> Sample | None:
        """The next request to run, or None when the run is over."""
        index = len(self.samples)
        if self.stopped is not None:
            return None
        if self.total is not None and index >= self.total:
            return None
        if self.deadline is not None and self.clock.now() >= self.deadline:
            return None
        sample = Sample(index=index, user=user, warmup=index < self.spec.warmup)
        self.samples.append(sample)
        return sample

    async def _one(self, conn: Conn, sample: Sample) -> None:
        prompt = make_prompt(self.rng, self.spec.prompt_tokens)
        try:
            await conn.request(sample, prompt, self.spec.max_tokens, self.clock)
        except BenchError as exc:
            sample.error = exc.code
            self._lost(exc)
        except Exception as exc:  # a client-side failure is a result too, not a crash
            sample.error = type(exc).__name__
        if sample.error is None:
            self.progress.done += 1
            self.progress.tokens += sample.tokens
            self.failing_since, self.lost_in_a_row = None, 0
        else:
            self.progress.errors += 1

    def _lost(self, exc: BenchError) -> None:
        """Note a lost connection; after ``give_up_s`` of nothing else, end the run."""
        if not lost(exc.code):
            return
        now = self.clock.now()
        self.lost_in_a_row += 1
        if self.failing_since is None:
            self.failing_since = now
        elif now - self.failing_since >= self.spec.give_up_s and self.stopped is None:
            self.stopped = (
                f"{self.target.name} stopped answering: {self.lost_in_a_row} lost connections "
                f"and no reply for {now - self.failing_since:.0f} s (last: {exc.code}, {exc}); "
                "the run ends early"
            )

    async def _back_off(self) -> None:
        """Wait before the next try after lost connections, longer each time in a row."""
        if self.lost_in_a_row:
            first, longest = _BACKOFF_S
            await asyncio.sleep(min(longest, first * 2 ** min(self.lost_in_a_row - 1, 16)))

    async def _reconnect(self) -> Conn | None:
        """A new connection for a user whose connection was lost (None: the run is over)."""
        while self.stopped is None and (self.deadline is None or self.clock.now() < self.deadline):
            await self._back_off()
            try:
                conn = await self.target.connect()
            except BenchError as exc:
                self._lost(exc)
                continue
            self.connections_opened += 1
            return conn
        return None

    async def run(self) -> LoadResult:
        spec = self.spec
        cpu0 = time.process_time()
        ticker: asyncio.Task[None] | None = None
        try:
            if spec.rate is None:
                assert spec.concurrency is not None
                conns: list[Conn] = []
                if not spec.new_connection:
                    conns = await open_connections(self.target, spec.concurrency, self.out)
                    self.connections_opened += len(conns)
                self._start_clock()
                ticker = asyncio.create_task(self.progress.run(self.clock))
                await asyncio.gather(
                    *(
                        self._closed_user(user, conns[user] if conns else None)
                        for user in range(spec.concurrency)
                    )
                )
            else:
                self._start_clock()
                ticker = asyncio.create_task(self.progress.run(self.clock))
                await self._open_loop(spec.rate)
        finally:
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
        return LoadResult(
            samples=self.samples,
            wall_s=self.clock.now(),
            client_cpu_s=time.process_time() - cpu0,
            connections_opened=self.connections_opened,
            stopped=self.stopped,
        )

    def _start_clock(self) -> None:
        self.clock = Clock()
        if self.spec.duration_s is not None:
            self.deadline = self.spec.duration_s

    async def _fresh(self, sample: Sample) -> Conn | None:
        """A new connection for one request (its opening counts in the request's times)."""
        sample.sent = self.clock.now()
        try:
            conn = await self.target.connect()
        except BenchError as exc:
            sample.error = exc.code
            self.progress.errors += 1
            self._lost(exc)
            await self._back_off()
            return None
        self.connections_opened += 1
        return conn

    async def _closed_user(self, user: int, conn: Conn | None) -> None:
        try:
            if self.spec.ramp_up_s and self.spec.concurrency:
                # Users start spread over the ramp-up, so their requests are not in lockstep.
                await asyncio.sleep(self.spec.ramp_up_s * user / self.spec.concurrency)
            while (sample := self._next_sample(user)) is not None:
                if conn is None:
                    fresh = await self._fresh(sample)
                    if fresh is None:
                        continue
                    try:
                        await self._one(fresh, sample)
                    finally:
                        await fresh.close()
                    if lost(sample.error):
                        await self._back_off()
                else:
                    await self._one(conn, sample)
                    if lost(sample.error):  # the connection is gone: a new one, in a while
                        await conn.close()
                        conn = await self._reconnect()
                        if conn is None:
                            break
        finally:
            if conn is not None:
                await conn.close()

    async def _open_loop(self, rate: float) -> None:
        spec = self.spec
        idle: deque[Conn] = deque()
        gate = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
        tasks: set[asyncio.Task[None]] = set()
        shape = spec.burstiness
        scale = 1.0 / (rate * shape)
        arrival = 0.0
        users = 0

        async def serve(sample: Sample) -> None:
            try:
                if not spec.new_connection and idle:
                    conn = idle.pop()
                else:
                    fresh = await self._fresh(sample)
                    if fresh is None:
                        return
                    conn = fresh
                await self._one(conn, sample)
                if spec.new_connection or sample.error is not None:
                    await conn.close()
                else:
                    idle.append(conn)
            finally:
                if gate is not None:
                    gate.release()

        try:
            while True:
                arrival += self.rng.gammavariate(shape, scale)
                delay = arrival - self.clock.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                if gate is not None:
                    await gate.acquire()
                sample = self._next_sample(users)
                if sample is None:
                    if gate is not None:
                        gate.release()
                    break
                users += 1
                sample.sent = self.clock.now()
                task = asyncio.create_task(serve(sample))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in idle), return_exceptions=True)


async def hold_idle(
    target: Target,
    connections: int,
    duration_s: float,
    ping_interval_s: float,
    *,
    progress_out: TextIO | None = sys.stderr,
    on_held: Callable[[], None] | None = None,
) -> tuple[list[float], int]:
    """Hold ``connections`` open for ``duration_s``; each sends a heartbeat every
    ``ping_interval_s`` (staggered). Returns the round trips (s) and the failures."""
    await target.prepare()
    try:
        conns = await open_connections(target, connections, progress_out)
        if on_held is not None:
            on_held()
        rtts: list[float] = []
        failures = 0
        loop = asyncio.get_running_loop()
        end = loop.time() + duration_s

        async def pinger(conn: Conn, offset: float) -> None:
            nonlocal failures
            await asyncio.sleep(offset)
            while loop.time() < end:
                try:
                    rtts.append(await conn.heartbeat())
                except BenchError:
                    failures += 1
                    return
                await asyncio.sleep(ping_interval_s)

        rng = random.Random(0)
        await asyncio.gather(*(pinger(c, rng.uniform(0, ping_interval_s)) for c in conns))
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        return rtts, failures
    finally:
        await target.close()
