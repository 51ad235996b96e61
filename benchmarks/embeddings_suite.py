"""Suite 16 of ``make bench``: embeddings. ``/v1/embeddings`` on all-MiniLM-L6-v2
(``--embedding-model all-minilm-l6-v2``) against llama.cpp's ``llama-server --embedding`` on the
same model (converted to GGUF by the converter of the llama.cpp it is built from: its vectors
match sentence-transformers' to a cosine of 0.99999), and sentence-transformers on the same
folder in one process, the bare floor: no server, no HTTP, no JSON, the same forward passes.

64-token inputs (the model's special tokens included), batches of 1 and 32 inputs per request,
8 concurrent clients (each sends its next request when the last is answered, ``base64`` vectors
as the ``openai`` package asks for them); the floor encodes the same inputs with ``batch_size``
1 and 32, one batch after another. Goals: Seedance's inputs/s at least llama-server's, and at
least 0.9x the floor's, at both batch sizes. Nothing is pinned: PyTorch and llama.cpp use every
core.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Contender, cores, fmt, ratio, servers, verdict
from benchmarks.llama_server import ensure_built, ensure_gguf, is_built

if TYPE_CHECKING:
    from benchmarks.harness import Report

MODEL = "all-minilm-l6-v2"
INPUT_TOKENS = 64
CLIENTS = 8
BATCHES = (1, 32)
WORDS = "sea otter tide harbour ledger risk transfer review current wave stone salt".split()


def inputs_of(tokenizer: Any, count: int, seed: int, tokens: int = INPUT_TOKENS) -> list[str]:
    """``count`` texts of exactly ``tokens`` tokens each, specials included."""
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < count:
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
            words.append(rng.choice(WORDS) + str(rng.randrange(100)))
        while len(tokenizer(" ".join(words))["input_ids"]) > tokens:
            words.pop()
        text = " ".join(words)
        if len(tokenizer(text)["input_ids"]) == tokens:
            texts.append(text)
    return texts


async def _load(url: str, texts: list[str], batch: int, seconds: float) -> dict[str, float]:
    """:data:`CLIENTS` closed-loop clients for ``seconds``: inputs/s and request latencies."""
    import aiohttp

    latencies: list[float] = []
    done = 0
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(index: int, http: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        at = index * batch
        while time.perf_counter() < deadline:
            chunk = [texts[(at + i) % len(texts)] for i in range(batch)]
            at += batch * CLIENTS
            body = {"model": MODEL, "input": chunk, "encoding_format": "base64"}
            sent = time.perf_counter()
            async with http.post(url, json=body) as reply:
                await reply.read()
                if reply.status != 200:
                    errors += 1
                    continue
            latencies.append(time.perf_counter() - sent)
            done += batch

    started = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(i, http) for i in range(CLIENTS)))
    elapsed = time.perf_counter() - started
    return {
        "inputs_per_s": done / elapsed,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "errors": errors,
    }


def _floor(model: Any, texts: list[str], batch: int, seconds: float) -> float:
    """sentence-transformers' inputs/s, encoding ``batch`` at a time for ``seconds``."""
    done, at = 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        chunk = [texts[(at + i) % len(texts)] for i in range(batch * 4)]
        at += len(chunk)
        model.encode(chunk, batch_size=batch)
        done += len(chunk)
    return done / (time.perf_counter() - started)


def embeddings_suite(report: Report) -> None:
    from sentence_transformers import SentenceTransformer

    from seedance.engines.embeddings import model_folder

    seconds = 4.0 if report.quick else 10.0
    folder, _ = model_folder(MODEL)
    reference = SentenceTransformer(str(folder), device="cpu")
    texts = inputs_of(reference.tokenizer, 256, seed=16)
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--engine", "synthetic", "--embedding-model", MODEL]
    argv += ["--port", "{port}", "--log-level", "warning"]
    contender = Contender("seedance", "Seedance /v1/embeddings", argv, "/v1", pinned=False)
    peer = _llama_server(folder, report)
    contenders = [contender] if peer is None else [contender, peer]
    served: dict[str, dict[int, list[dict[str, float]]]] = {
        c.key: {b: [] for b in BATCHES} for c in contenders
    }
    floor: dict[int, list[float]] = {b: [] for b in BATCHES}
    with servers(contenders) as running:
        urls = {c.key: running[c.key].url + "/embeddings" for c in contenders}
        for url in urls.values():
            asyncio.run(_load(url, texts, 1, 1.0))  # warm-up
        for round_ in range(report.rounds):
            for c in contenders if round_ % 2 == 0 else contenders[::-1]:
                for batch in BATCHES:
                    report.log(f"[16 embeddings] round {round_ + 1}: {c.label}, batch {batch}")
                    result = asyncio.run(_load(urls[c.key], texts, batch, seconds))
                    served[c.key][batch].append(result)
    ours, theirs = served["seedance"], served.get("llama")
    _floor(reference, texts, 1, 1.0)  # warm-up, the server gone
    for round_ in range(report.rounds):
        for batch in BATCHES:
            report.log(f"[16 embeddings] round {round_ + 1}: sentence-transformers, batch {batch}")
            floor[batch].append(_floor(reference, texts, batch, seconds))
    rows, ok, ok_peer = [], True, True
    nothing: list[dict[str, float]] = [{"inputs_per_s": math.nan, "p50_ms": math.nan, "errors": 0}]
    for batch in BATCHES:
        mine = statistics.median(r["inputs_per_s"] for r in ours[batch])
        peer_runs = nothing if theirs is None else theirs[batch]
        peer_rate = statistics.median(r["inputs_per_s"] for r in peer_runs)
        bare = statistics.median(floor[batch])
        p50 = [statistics.median(r["p50_ms"] for r in s) for s in (ours[batch], peer_runs)]
        errors = [sum(int(r["errors"]) for r in s) for s in (ours[batch], peer_runs)]
        ok &= mine >= 0.9 * bare and errors[0] == 0
        ok_peer &= mine >= peer_rate and errors[0] == 0
        rows.append(
            f"| {batch} | {fmt(mine, 1)} | {fmt(peer_rate, 1)} ({ratio(mine, peer_rate)}) "
            f"| {fmt(bare, 1)} ({ratio(mine, bare)}) | {fmt(p50[0], 1)} / {fmt(p50[1], 1)} "
            f"| {errors[0]} / {errors[1]} |"
        )
    if peer is not None:
        goal = "16. Embeddings: at least llama-server --embedding's inputs/s at batch 1 and 32"
        report.goals.append((goal, "", ok_peer))
    report.goals.append(
        ("16. Embeddings: at least 0.9x sentence-transformers' inputs/s at batch 1 and 32", "", ok)
    )
    left_out = "left out (a quick run does not build llama-server)"
    report.sections.append(
        "\n".join(
            [
                "## 16. Embeddings",
                "",
                f"`/v1/embeddings` on all-MiniLM-L6-v2 against `llama-server --embedding` on "
                "the same model (converted to GGUF, float32, by the converter of the llama.cpp "
                "it is built from) and sentence-transformers on the same folder in one process "
                f"(the floor: no server, no HTTP, no JSON). {INPUT_TOKENS}-token inputs, "
                f"{CLIENTS} concurrent clients, each sending its next request when its last is "
                "answered (`base64` vectors, as the `openai` package asks); the floor encodes "
                "one batch after another. Goals: at least llama-server's inputs/s at both batch "
                f"sizes: {verdict(ok_peer) if peer else left_out}; at least 0.9x the floor's: "
                f"{verdict(ok)}.",
                "",
                "| inputs per request | Seedance inputs/s | llama-server inputs/s | "
                "sentence-transformers inputs/s | p50 ms per request, Seedance / llama-server "
                "| errors |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                "Commands (PORT filled in by the runner):",
                "",
                "```",
                *(c.display() for c in contenders),
                "```",
                "",
            ]
        )
    )


def _llama_server(folder: Path, report: Report) -> Contender | None:
    """``llama-server --embedding`` on the model, mean pooling as sentence-transformers pools
    (8 slots, a batch as large as 32 inputs of 64 tokens, every core); a quick run leaves it
    out when it is not built yet (a build takes minutes)."""
    from benchmarks.llama_suite import _repack

    if report.quick and not is_built():
        report.log("[16 embeddings] llama-server is not built: left out of a quick run")
        return None
    binary = ensure_built(report.log)
    model = ensure_gguf(folder, MODEL, report.log)
    argv = [str(binary), "-m", str(model), "--port", "{port}", "--embedding", "--pooling", "mean"]
    argv += ["-t", str(cores()), "--parallel", str(CLIENTS), "-c", "16384"]
    argv += ["-b", "4096", "-ub", "4096", "--log-disable"]
    argv += [] if _repack() else ["--no-repack"]
    return Contender("llama", "llama-server --embedding", argv, "/v1", pinned=False)
