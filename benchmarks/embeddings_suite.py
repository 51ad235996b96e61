"""Suite 16 of ``make bench``: embeddings. ``/v1/embeddings`` on all-MiniLM-L6-v2
(``--embedding-model all-minilm-l6-v2``) against sentence-transformers on the same model folder
in one process, the bare floor: no server, no HTTP, no JSON, the same forward passes.

64-token inputs (the model's special tokens included), batches of 1 and 32 inputs per request,
8 concurrent clients (each sends its next request when the last is answered, ``base64`` vectors
as the ``openai`` package asks for them); the floor encodes the same inputs with ``batch_size``
1 and 32, one batch after another. Goal: Seedance's inputs/s at least 0.9x the floor's at both
batch sizes. Nothing is pinned: PyTorch uses every core in both.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Contender, fmt, ratio, servers, verdict

if TYPE_CHECKING:
    from benchmarks.harness import Report

MODEL = "all-minilm-l6-v2"
INPUT_TOKENS = 64
CLIENTS = 8
BATCHES = (1, 32)
WORDS = "sea otter tide harbour ledger risk transfer review current wave stone salt".split()


def inputs_of(tokenizer: Any, count: int, seed: int) -> list[str]:
    """``count`` texts of exactly :data:`INPUT_TOKENS` tokens each, specials included."""
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < count:
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < INPUT_TOKENS:
            words.append(rng.choice(WORDS) + str(rng.randrange(100)))
        while len(tokenizer(" ".join(words))["input_ids"]) > INPUT_TOKENS:
            words.pop()
        text = " ".join(words)
        if len(tokenizer(text)["input_ids"]) == INPUT_TOKENS:
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
    ours: dict[int, list[dict[str, float]]] = {b: [] for b in BATCHES}
    floor: dict[int, list[float]] = {b: [] for b in BATCHES}
    with servers([contender]) as running:
        url = running[contender.key].url + "/embeddings"
        asyncio.run(_load(url, texts, 1, 1.0))  # warm-up
        for round_ in range(report.rounds):
            for batch in BATCHES:
                report.log(f"[16 embeddings] round {round_ + 1}: Seedance, batch {batch}")
                ours[batch].append(asyncio.run(_load(url, texts, batch, seconds)))
    _floor(reference, texts, 1, 1.0)  # warm-up, the server gone
    for round_ in range(report.rounds):
        for batch in BATCHES:
            report.log(f"[16 embeddings] round {round_ + 1}: sentence-transformers, batch {batch}")
            floor[batch].append(_floor(reference, texts, batch, seconds))
    rows, ok = [], True
    for batch in BATCHES:
        mine = statistics.median(r["inputs_per_s"] for r in ours[batch])
        bare = statistics.median(floor[batch])
        p50 = statistics.median(r["p50_ms"] for r in ours[batch])
        errors = sum(int(r["errors"]) for r in ours[batch])
        ok &= mine >= 0.9 * bare and errors == 0
        rows.append(
            f"| {batch} | {fmt(mine, 1)} | {fmt(bare, 1)} | {ratio(mine, bare)} | "
            f"{fmt(p50, 1)} | {errors} |"
        )
    report.goals.append(
        ("16. Embeddings: at least 0.9x sentence-transformers' inputs/s at batch 1 and 32", "", ok)
    )
    report.sections.append(
        "\n".join(
            [
                "## 16. Embeddings",
                "",
                f"`/v1/embeddings` on all-MiniLM-L6-v2 against sentence-transformers on the same "
                f"folder in one process (the floor: no server, no HTTP, no JSON). "
                f"{INPUT_TOKENS}-token inputs, {CLIENTS} concurrent clients, each sending its "
                "next request when its last is answered (`base64` vectors, as the `openai` "
                "package asks); the floor encodes one batch after another. Goal: at least 0.9x "
                "the floor's inputs/s at both batch sizes: " + verdict(ok) + ".",
                "",
                "| inputs per request | Seedance inputs/s | sentence-transformers inputs/s "
                "| ratio | Seedance p50 ms per request | errors |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                "Commands (PORT filled in by the runner):",
                "",
                "```",
                contender.display(),
                "```",
                "",
            ]
        )
    )
