"""Log probabilities of reply tokens: each API's shape through the official ``openai`` package
and the Python SDK, over real sockets, and the figures equal to a reference computed in
float64 from the model's own logits (llama.cpp's, for the same tokens, through a bare context;
transformers' in test_transformers.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from seedance.client import connect
from seedance.engines.llamacpp.native import ContextShape, LlamaContext, LlamaModel
from seedance.engines.local import default_model_path
from seedance.protocol.errors import InvalidRequest
from tests.support.servers import THREADS, RunningServer, server_config

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOP = 5


@pytest.fixture(scope="module")
def single() -> Iterator[RunningServer]:
    """The embedded model on llama.cpp, one sequence, as the reference decodes it."""
    server = RunningServer(server_config(engine="llamacpp", parallel=1, n_ctx=2048), None).start()
    yield server
    server.stop()


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


def reference(prompt: list[int], steps: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Greedy decoding of ``prompt`` in a bare llama.cpp context: per step the chosen token's
    text and log probability and the :data:`TOP` likeliest, by log-softmax in float64."""
    model = LlamaModel(default_model_path())
    ctx = LlamaContext(model, ContextShape(1, 2048, 512, THREADS))
    out = []
    try:
        ctx.clear_batch()
        for pos, token in enumerate(prompt):
            index = ctx.add(token, pos, 0, pos == len(prompt) - 1)
        for step in range(steps):
            assert ctx.decode() == 0
            logits = np.array(ctx.logits(index), dtype=np.float64)
            logprobs = logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))
            order = sorted(range(len(logprobs)), key=lambda t: -logprobs[t])[:TOP]
            chosen = order[0]
            if model.is_eog(chosen):
                break
            text = model.piece(chosen).decode("utf-8", "replace")
            tops = [(model.piece(t).decode("utf-8", "replace"), logprobs[t]) for t in order]
            out.append((text, float(logprobs[chosen]), tops))
            ctx.clear_batch()
            index = ctx.add(chosen, len(prompt) + step, 0, True)
    finally:
        ctx.close()
        model.close()
    return out


async def test_chat_logprobs_equal_the_reference(single: RunningServer) -> None:
    async with httpx.AsyncClient() as http:
        prompt = (
            await http.post(f"{single.http_url}/tokenize", json={"messages": QUESTION})
        ).json()
    expected = reference(prompt["tokens"], 12)
    api = client(single)
    ask: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 12}
    ask.update(temperature=0, logprobs=True, top_logprobs=TOP)
    reply = await api.chat.completions.create(**ask)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(expected) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for got, (text, logprob, tops) in zip(content, expected, strict=True):
        assert got.token == text and got.bytes == list(text.encode())
        assert got.logprob == pytest.approx(logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [t for t, _ in tops]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [v for _, v in tops], abs=1e-5
        )
    assert "".join(t.token for t in content) == reply.choices[0].message.content

    # Streamed: the same entries, each chunk with those of its tokens.
    stream = await api.chat.completions.create(**ask, stream=True)
    streamed: list[Any] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


async def test_completions_responses_and_v2_infer_shapes(single: RunningServer) -> None:
    api = client(single)
    legacy = await api.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[1] == len(lp.tokens[0])
    assert "".join(lp.tokens) == legacy.choices[0].text

    response = await api.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    )
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs and len(part.logprobs) == 6  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 3 for entry in part.logprobs)  # type: ignore[union-attr]
    deltas = []
    async with api.responses.stream(
        model=MODEL,
        input="What is the capital of France?",
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
    ) as events:
        async for event in events:
            if event.type == "response.output_text.delta":
                deltas += event.logprobs
    assert [d.token for d in deltas] == [e.token for e in part.logprobs]  # type: ignore[union-attr]

    async with connect(single.url) as session:
        stream = session.generate(
            "What is the capital of France?", max_tokens=6, temperature=0, logprobs=1
        )
        chunks = [chunk async for chunk in stream]
        assert sum(len(c.logprobs or []) for c in chunks) == 6
        assert [e.token for e in stream.logprobs] == [e.token for e in part.logprobs]  # type: ignore[union-attr]
        whole = await session.complete(
            "What is the capital of France?", max_tokens=6, temperature=0, logprobs=0
        )
        assert whole.logprobs is not None and len(whole.logprobs) == 6
        assert all(entry.top_logprobs == [] for entry in whole.logprobs)
        with pytest.raises(InvalidRequest, match="logprobs must be between 0 and 20"):
            await session.complete("x", logprobs=21)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "between 0 and 20"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ],
)
def test_bad_logprobs_get_a_400_naming_the_field(
    single: RunningServer, body: dict[str, Any], param: str, words: str
) -> None:
    answer = httpx.post(
        f"{single.http_url}/v1/chat/completions", json={"messages": QUESTION, **body}, timeout=30
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_an_engine_without_logprobs_says_so(server: RunningServer) -> None:
    answer = httpx.post(
        f"{server.http_url}/v1/chat/completions",
        json={"messages": QUESTION, "logprobs": True},
        timeout=30,
    )
    assert answer.status_code == 400
    assert (
        "synthetic engine of model synthetic gives no log probabilities"
        in answer.json()["error"]["message"]
    )
