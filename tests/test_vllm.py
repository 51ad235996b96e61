"""The ``vllm`` engine.

vLLM runs only on CUDA GPUs and is not installed on the machines this suite normally runs on:
the tests that serve a model run only where ``vllm`` imports, a CUDA GPU is present and
``SEEDANCE_VLLM_MODEL`` names a Hugging Face model folder; elsewhere they are skipped with a
reason that says so. The error a user gets without vLLM is tested everywhere else.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from seedance.client import connect
from seedance.config import ServerConfig
from tests.conftest import RunningServer, serve_fails

HAS_VLLM = importlib.util.find_spec("vllm") is not None
MODEL = os.environ.get("SEEDANCE_VLLM_MODEL", "")


def test_without_vllm_the_engine_says_how_to_install_it(tmp_path: Path) -> None:
    if HAS_VLLM:
        pytest.skip("vLLM is installed here")
    stderr = serve_fails("--engine", "vllm", "--model-path", str(tmp_path))
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "--engine vllm needs vLLM" in lines[0]
    assert "pip install 'seedance[vllm]'" in lines[0]


def _why_not() -> str | None:
    if not HAS_VLLM:
        return "vLLM is not installed (it runs only on CUDA GPUs: pip install 'seedance[vllm]')"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and there is none here"
    if not MODEL:
        return "set SEEDANCE_VLLM_MODEL to a Hugging Face model folder to test vLLM"
    return None


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[RunningServer]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    config = ServerConfig(engine="vllm", model_path=MODEL, model="m", gpu_memory_utilization=0.5)
    server = RunningServer(config, None).start()
    yield server
    server.stop()


@pytest.mark.timeout(600)
async def test_vllm_streams_cancels_and_seeds(vllm_server: RunningServer) -> None:
    async with connect(vllm_server.url) as session:
        stream = session.generate("What is 2+2?", temperature=0, max_tokens=30)
        seq = 0
        async for chunk in stream:
            assert chunk.seq == seq
            seq += chunk.n
        assert stream.done is not None and stream.done.finish_reason in ("stop", "length")
        assert seq == stream.done.usage.completion_tokens
        poem = {"temperature": 1.0, "seed": 5, "max_tokens": 12, "reset": True}
        a = await session.complete("Write a poem.", **poem)
        b = await session.complete("Write a poem.", **poem)
        assert a.text == b.text and a.usage.completion_tokens == 12
        long = session.generate("Tell me a long story.", temperature=0.7, max_tokens=2000)
        await anext(aiter(long))
        await long.cancel()
        assert (await long.collect()).finish_reason == "cancelled"

    async def ask(i: int) -> int:
        async with connect(vllm_server.url) as other:
            done = await other.complete(f"Count to {i}.", max_tokens=16)
            return done.usage.completion_tokens

    assert all(n > 0 for n in await asyncio.gather(*(ask(i) for i in range(16))))
