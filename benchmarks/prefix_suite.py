"""Suite 24 of ``make bench``: gateway mode's routing by prefix against round-robin and
least-loaded routing, in front of the same three upstreams, in one run.

The upstreams are ``seedance serve`` with the embedded SmolLM2 (one thread each; each keeps a
conversation's or a shared prefix's KV cells and restores them from its host-memory cache, so
a prompt that begins like an earlier one prefills only the rest; the cache, ``--cache-ram``,
holds about a third of the trace's system prompts, as one replica's KV memory holds a part of
a fleet's prefixes). A trace of conversations
over a few long shared system prompts (a support desk's, a trading desk's) goes through a
gateway per routing (``--upstream-routing prefix|load|round-robin``), a few users at once, two
turns each: the first token's time of every request, the errors, and the share of prompt
tokens the upstreams' caches served (their ``seedance_engine_prompt_cached_tokens_total`` over
``seedance_engine_prompt_tokens_total``). Each run has system prompts of its own, so no run
finds what another left in the caches; the routings take turns, in alternating order.

Goals (the issue's): TTFT p50 at least 30% below round-robin's and below least-loaded's, p99
no worse than least-loaded's, no error.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import Contender, fmt, servers, verdict

if TYPE_CHECKING:
    from benchmarks.harness import Report

ROUTINGS = ("prefix", "load", "round-robin")
UPSTREAMS = 3
WORDS = (
    "account order ticket refund market price risk client desk policy limit trade report "
    "shipment invoice balance portfolio exposure hedge settlement customer answer escalate "
    "polite brief accurate never always check confirm"
).split()


def _upstream(key: str, cache_mb: int) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--port", "{port}", "--log-level", "warning", "--threads", "1"]
    argv += ["--parallel", "4", "--cache-ram", str(cache_mb)]
    contender = Contender(key, f"upstream {key}", argv, "/v1")
    contender.pinned = False
    return contender


def _gateway(routing: str, upstreams: list[str]) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--engine", "openai", "--upstream", ",".join(upstreams)]
    argv += ["--upstream-routing", routing, "--port", "{port}", "--log-level", "warning"]
    contender = Contender(routing, f"gateway, {routing}", argv, "/v1")
    contender.pinned = False
    return contender


def _system_prompts(seed: int, count: int, words: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"You are assistant {seed}-{i}. " + " ".join(rng.choice(WORDS) for _ in range(words))
        for i in range(count)
    ]


def _cache(urls: list[str]) -> tuple[float, float, list[float]]:
    """Prompt tokens and cached tokens, summed over the upstreams' /metrics, and each
    upstream's requests."""
    prompted = cached = 0.0
    requests = []
    for url in urls:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        served = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "seedance_engine_prompt_tokens_total":
                    prompted += sample.value
                elif sample.name == "seedance_engine_prompt_cached_tokens_total":
                    cached += sample.value
                elif sample.name == "seedance_requests_total":
                    served += sample.value
        requests.append(served)
    return prompted, cached, requests


async def _trace(url: str, prompts: list[str], conversations: int, users: int) -> dict[str, Any]:
    """``conversations`` of two turns over ``prompts``, ``users`` at a time: TTFTs (all, and
    of each turn), errors."""
    import aiohttp

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(conversations):
        queue.put_nowait(i)
    ttfts: list[float] = []
    turns: tuple[list[float], list[float]] = ([], [])
    errors: list[str] = []
    model = ""

    async def ask(session: aiohttp.ClientSession, messages: list[dict[str, str]], turn: int) -> str:
        body = {"model": model, "messages": messages, "max_tokens": 16, "stream": True}
        sent, text, first = time.perf_counter(), "", None
        async with session.post(f"{url}/chat/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
            async for line in reply.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if delta and first is None:
                    first = time.perf_counter() - sent
                text += delta
        ttfts.append(first if first is not None else time.perf_counter() - sent)
        turns[turn].append(ttfts[-1])
        return text

    async def user(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            messages = [
                {"role": "system", "content": prompts[i % len(prompts)]},
                {"role": "user", "content": f"Customer {i} asks about order {i * 7}."},
            ]
            try:
                messages.append({"role": "assistant", "content": await ask(session, messages, 0)})
                messages.append({"role": "user", "content": "And when will it arrive?"})
                await ask(session, messages, 1)
            except Exception as exc:  # counted, and the trace goes on
                errors.append(f"{type(exc).__name__}: {exc}")

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        await asyncio.gather(*(user(session) for _ in range(users)))
    return {"ttfts": ttfts, "turns": turns, "errors": errors}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prefix_suite(report: Report) -> None:
    # The full run's system prompts are about 4.8 KB (660 tokens, 15 MB of SmolLM2's KV cells:
    # an agent's instructions and tools); the quick run's are 1.2 KB (3.9 MB). Each upstream
    # keeps 128 MiB (16) of saved states in host memory, about 8 prompts' cells: the three
    # together hold all of them, one does not, as a fleet's prefixes outgrow one replica's KV
    # memory (a GPU's KV cache, here the host cache of --cache-ram).
    conversations, users, prompts, words, cache_mb = (
        (40, 6, 8, 180, 16) if report.quick else (200, 8, 20, 650, 128)
    )
    upstreams = [_upstream(f"u{i}", cache_mb) for i in range(UPSTREAMS)]
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in ROUTINGS}
    with servers(upstreams) as running:
        urls = [s.url for s in running.values()]
        with servers([_gateway(r, urls) for r in ROUTINGS]) as gateways:
            for round_ in range(report.rounds):
                order = ROUTINGS if round_ % 2 == 0 else ROUTINGS[::-1]
                for routing in order:
                    report.log(f"[24 prefix routing] {routing}, round {round_ + 1}")
                    seed = 1000 * round_ + ROUTINGS.index(routing)
                    before = _cache(urls)
                    began = time.perf_counter()
                    run = asyncio.run(
                        _trace(
                            gateways[routing].url,
                            _system_prompts(seed, prompts, words),
                            conversations,
                            users,
                        )
                    )
                    run["seconds"] = time.perf_counter() - began
                    after = _cache(urls)
                    prompted = after[0] - before[0]
                    run["hit"] = (after[1] - before[1]) / prompted if prompted else float("nan")
                    run["spread"] = [b - a for a, b in zip(before[2], after[2], strict=True)]
                    results[routing].append(run)

    def figure(routing: str, what: str) -> float:
        runs = results[routing]
        if what == "hit":
            return float(statistics.median(r["hit"] for r in runs))
        if what in ("first", "second"):  # each turn's p50
            turn = 0 if what == "first" else 1
            return float(statistics.median(_p(r["turns"][turn], 0.5) * 1000 for r in runs))
        q = 0.5 if what == "p50" else 0.99
        return float(statistics.median(_p(r["ttfts"], q) * 1000 for r in runs))

    def spread(routing: str) -> str:
        """Each upstream's requests in the last run, most first."""
        return " / ".join(f"{n:.0f}" for n in sorted(results[routing][-1]["spread"])[::-1])

    sample = _system_prompts(0, 1, words)
    p50 = {r: figure(r, "p50") for r in ROUTINGS}
    p99 = {r: figure(r, "p99") for r in ROUTINGS}
    errors = {r: sum(len(run["errors"]) for run in results[r]) for r in ROUTINGS}
    ok = (
        p50["prefix"] <= 0.7 * p50["round-robin"]
        and p50["prefix"] < p50["load"]
        and p99["prefix"] <= p99["load"]
        and not any(errors.values())
    )
    report.goals.append(
        (
            "24. Routing by prefix: TTFT p50 30% below round-robin and below least-loaded, "
            "p99 no worse than least-loaded, no error",
            "",
            ok,
        )
    )
    rows = [
        f"| {r} | {fmt(p50[r], 0)} | {fmt(figure(r, 'first'), 0)} | "
        f"{fmt(figure(r, 'second'), 0)} | {fmt(p99[r], 0)} | {figure(r, 'hit'):.0%} | "
        f"{spread(r)} | {errors[r]} | "
        f"{fmt(statistics.median(run['seconds'] for run in results[r]), 1)} |"
        for r in ROUTINGS
    ]
    first_error = next((e for r in ROUTINGS for run in results[r] for e in run["errors"]), None)
    report.sections.append(
        "\n".join(
            [
                "## 24. Gateway mode: routing by prefix",
                "",
                f"Three upstreams (`seedance serve`, the embedded SmolLM2, one thread, four "
                f"sequences and `--cache-ram {cache_mb}` MiB each: about 8 system prompts' "
                f"saved cells, the three together hold every prompt, one does not) behind "
                f"three gateways (`--upstream-routing prefix`, `load`, "
                f"`round-robin`), nothing pinned. A trace of {conversations} conversations over "
                f"{prompts} system prompts of about {len(sample[0]) / 1000:.1f} KB, two turns "
                f"each (16-token replies), {users} users at once; each run with system prompts "
                f"of its own, "
                f"{report.rounds} round(s), the routings in alternating order; medians. Goal: "
                f"TTFT p50 at least 30% below round-robin's and below least-loaded's, p99 no "
                f"worse than least-loaded's, no error: {verdict(ok)}.",
                "",
                "| routing | TTFT p50 ms | first turns' p50 | second turns' p50 | TTFT p99 ms | "
                "prompt tokens from the upstreams' caches | requests per upstream | errors | "
                "seconds per run |",
                "|---|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                *([f"First error: `{first_error}`", ""] if first_error else []),
            ]
        )
    )
