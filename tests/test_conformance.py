"""The engine contract, over real sockets, for every engine that can run here.

What a client relies on whatever the engine: ``seq`` and ``n`` of the token frames add up to
the reply's ``usage``, ``max_tokens`` holds, a stop string cuts the reply exactly where it
starts, a seed gives the same reply again, a cancel ends the reply and frees the engine, and
concurrent requests all complete. Model-specific behaviour (what the model answers, batching
figures) stays in each engine's own test module.

The engines: ``synthetic``; ``openai`` (gateway mode, in front of a synthetic Seedance);
``llamacpp`` and ``transformers`` on the embedded SmolLM2 (marked ``model``); ``synthetic`` and
``llamacpp`` again in a process of their own (``--engine-process``); ``vllm`` where a
GPU and ``SEEDANCE_VLLM_MODEL`` are at hand. A third-party engine runs the same suite with
``SEEDANCE_CONFORMANCE_ENGINES=NAME[,NAME...]`` (each served with the settings ``seedance
serve`` reads from ``SEEDANCE_*`` variables).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from seedance.client import connect
from seedance.config import ServerConfig
from seedance.config_loader import load_config
from tests.support.servers import RunningServer, one_process_only, server_config
from tests.support.waits import eventually
from tests.support.ws import assert_contiguous, read

PROMPT = "Tell me about the sea."
#: Paced engines, so that a cancel arrives while the reply runs.
SYNTHETIC = {"engine": "synthetic", "tokens_per_s": 200.0}


def _engines() -> list[Any]:
    kinds: list[Any] = [
        "synthetic",
        "synthetic in its own process",
        "gateway",
        pytest.param("llamacpp", marks=pytest.mark.model),
        pytest.param("llamacpp in its own process", marks=pytest.mark.model),
    ]
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        for kind in ("transformers", "transformers in its own process"):
            kinds.append(pytest.param(kind, marks=[pytest.mark.model, pytest.mark.slow]))
    if os.environ.get("SEEDANCE_VLLM_MODEL") and importlib.util.find_spec("vllm"):
        kinds.append(pytest.param("vllm", marks=pytest.mark.model))
    extra = os.environ.get("SEEDANCE_CONFORMANCE_ENGINES", "")
    kinds += [name.strip() for name in extra.split(",") if name.strip()]
    return kinds


def _config(kind: str) -> ServerConfig:
    if kind.endswith(" in its own process"):  # --engine-process
        engine = kind.partition(" ")[0]
        return _config(engine).replace(engine_process=True)
    if kind == "synthetic":
        return server_config(**SYNTHETIC)
    if kind == "llamacpp":
        return server_config(engine="llamacpp", parallel=4, n_ctx=4 * 1024)
    if kind == "transformers":  # as the transformers_server fixture's
        return server_config(engine="transformers", device="cpu", parallel=4, n_ctx=4 * 1024)
    if kind == "vllm":
        model = os.environ["SEEDANCE_VLLM_MODEL"]
        return server_config(engine="vllm", model_path=model, gpu_memory_utilization=0.5)
    return load_config({"engine": kind}, dict(os.environ))  # a third-party engine


@pytest.fixture(scope="module", params=_engines())
def served(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """A server on each engine in turn (one at a time: a model's memory goes with it)."""
    kind: str = request.param
    if kind == "transformers":  # shared with test_transformers.py (slow to load)
        yield request.getfixturevalue("transformers_server")
        return
    started: list[RunningServer] = []
    if kind == "gateway":
        upstream = RunningServer(server_config(**SYNTHETIC), None).start()
        started.append(upstream)
        served = server_config(engine="openai", upstream=(f"{upstream.http_url}/v1",))
    else:
        served = _config(kind)
    started.append(RunningServer(served, None).start())
    yield started[-1]
    for server in reversed(started):
        server.stop()


async def _reply(server: RunningServer, **params: Any) -> tuple[Any, list[Any]]:
    async with connect(server.url) as session:
        stream = session.generate(PROMPT, reset=True, **params)
        chunks = await read(stream)
    assert stream.done is not None
    return stream, chunks


async def test_token_frames_add_up_to_the_usage(served: RunningServer) -> None:
    stream, chunks = await _reply(served, temperature=0, seed=1, max_tokens=16)
    done = stream.done
    assert done.finish_reason in ("stop", "length")
    assert_contiguous(chunks, done.usage.completion_tokens)
    assert stream.text == "".join(c.text for c in chunks)
    assert stream.start is not None and stream.start.prompt_tokens == done.usage.prompt_tokens
    if done.finish_reason == "length":
        assert done.usage.completion_tokens == 16


async def test_max_tokens_holds(served: RunningServer) -> None:
    stream, chunks = await _reply(served, temperature=0, seed=1, max_tokens=3)
    assert_contiguous(chunks, stream.done.usage.completion_tokens)
    assert stream.done.usage.completion_tokens <= 3
    assert stream.done.finish_reason == "length" or stream.done.usage.completion_tokens < 3


async def test_a_stop_string_cuts_the_reply_where_it_starts(served: RunningServer) -> None:
    whole, _ = await _reply(served, temperature=0, seed=1, max_tokens=24)
    text = whole.text
    stop = text[len(text) // 2 :][:3]
    if len(text) < 8 or not stop.strip():
        pytest.skip(f"the reply is too short to cut: {text!r}")
    cut, chunks = await _reply(served, temperature=0, seed=1, max_tokens=24, stop=stop)
    assert cut.done.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert_contiguous(chunks, cut.done.usage.completion_tokens)


async def test_a_seed_gives_the_same_reply_again(served: RunningServer) -> None:
    await _reply(served, temperature=0.9, seed=5, max_tokens=8)  # warm-up (prefix caches)
    a, _ = await _reply(served, temperature=0.9, seed=5, max_tokens=8)
    b, _ = await _reply(served, temperature=0.9, seed=5, max_tokens=8)
    assert a.text == b.text


@one_process_only("reads the engine in the server's process")
async def test_a_cancel_ends_the_reply_and_frees_the_engine(served: RunningServer) -> None:
    async with connect(served.url) as session:
        long = session.generate(PROMPT, temperature=0.7, seed=2, max_tokens=1000, reset=True)
        await anext(aiter(long))
        await long.cancel()
        done = await long.collect()
        assert done.finish_reason == "cancelled"
        assert done.usage.completion_tokens < 1000
        after = await session.complete(PROMPT, temperature=0, seed=1, max_tokens=4)
        assert after.finish_reason in ("stop", "length")
    engine = served.engine
    await eventually(lambda: not engine.unfinished_requests(), what="the engine is free")


async def test_concurrent_requests_all_complete(served: RunningServer) -> None:
    async def ask(i: int) -> int:
        stream, chunks = await _reply(served, temperature=0.8, seed=i, max_tokens=8)
        assert_contiguous(chunks, stream.done.usage.completion_tokens)
        return int(stream.done.usage.completion_tokens)

    counts = await asyncio.gather(*(ask(i) for i in range(6)))
    assert all(0 < n <= 8 for n in counts)
