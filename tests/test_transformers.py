"""The ``transformers`` engine on the CPU with the embedded SmolLM2 GGUF, over real sockets.

transformers dequantizes the GGUF on load (about 40 s here), so one server (4 parallel
sequences) serves every test that needs the model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

NEEDS = "the transformers engine needs seedance[transformers]"
pytest.importorskip("torch", reason=NEEDS)
pytest.importorskip("transformers", reason=NEEDS)

import torch  # noqa: E402

from seedance.client import connect  # noqa: E402
from seedance.client.session import TokenChunk  # noqa: E402
from seedance.config import ConfigError  # noqa: E402
from seedance.engines.hf.engine import TransformersEngine  # noqa: E402
from seedance.engines.registry import create_engine  # noqa: E402
from seedance.protocol.errors import SeedanceError  # noqa: E402
from seedance.protocol.messages import ChatMessage  # noqa: E402
from tests.support.servers import (  # noqa: E402
    RunningServer,
    one_process_only,
    serve_fails,
    server_config,
)
from tests.support.ws import assert_contiguous, read  # noqa: E402

PARALLEL = 4
N_CTX_SEQ = 1024
RISK = json.loads((Path(__file__).parents[1] / "benchmarks" / "risk_schema.json").read_text())
pytestmark = [pytest.mark.timeout(300), pytest.mark.model]


@pytest.fixture
def hf(transformers_server: RunningServer) -> RunningServer:
    """The session's transformers server (conftest.py): PARALLEL rows of N_CTX_SEQ tokens."""
    return transformers_server


def engine_of(server: RunningServer) -> TransformersEngine:
    engine = server.engine
    assert isinstance(engine, TransformersEngine)
    return engine


async def eventually_idle(engine: TransformersEngine, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.stats.running or engine.stats.waiting:
        assert asyncio.get_running_loop().time() < deadline, engine.stats
        await asyncio.sleep(0.02)


@one_process_only("reads the transformers engine in the server's process")
async def test_what_is_two_plus_two(hf: RunningServer) -> None:
    async with connect(hf.url) as session:
        assert session.model == "smollm2-135m"
        stream = session.generate("What is 2+2?", temperature=0, max_tokens=30)
        chunks = await read(stream)
    done = stream.done
    assert done is not None and done.finish_reason == "stop"
    assert "4" in stream.text, stream.text
    assert_contiguous(chunks, done.usage.completion_tokens)
    engine = engine_of(hf)
    assert engine.info.engine == "transformers"
    expected = engine.prompt_tokens([ChatMessage("user", "What is 2+2?")], 0)
    assert stream.start is not None and stream.start.prompt_tokens == expected
    assert done.usage.prompt_tokens == expected


@one_process_only("reads the transformers engine in the server's process")
async def test_concurrent_streams_are_batched_and_equal_their_runs_alone(hf: RunningServer) -> None:
    topics = ["cats", "the sea", "trains", "rain"]

    async def ask(i: int, topic: str) -> tuple[str, list[TokenChunk], int]:
        async with connect(hf.url) as session:
            stream = session.generate(
                f"Write one sentence about {topic}.", temperature=0.8, seed=100 + i, max_tokens=12
            )
            chunks = await read(stream)
            assert stream.done is not None, stream.text
            return stream.text, chunks, stream.done.usage.completion_tokens

    engine = engine_of(hf)
    steps_before = engine.stats.steps
    together = await asyncio.gather(*(ask(i, t) for i, t in enumerate(topics)))
    batched_steps = engine.stats.steps - steps_before
    for text, chunks, completion in together:
        assert text and completion > 0
        assert_contiguous(chunks, completion)
    assert batched_steps < sum(c for _, _, c in together) / 2  # decoded together
    alone = [await ask(i, t) for i, t in enumerate(topics)]
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]


@one_process_only("reads the transformers engine in the server's process")
async def test_cancel_frees_a_row_for_a_waiting_request(hf: RunningServer) -> None:
    engine = engine_of(hf)
    cancelled_before = engine.stats.requests_cancelled
    prompt = "Tell me a very long story about a dragon."
    sessions = [connect(hf.url) for _ in range(PARALLEL + 1)]
    opened = [await s.__aenter__() for s in sessions]
    try:
        long = [
            s.generate(prompt, temperature=0.5, seed=i, max_tokens=500)
            for i, s in enumerate(opened[:PARALLEL])
        ]
        iterators = [aiter(stream) for stream in long]
        for it in iterators:  # every row is taken
            await anext(it)
        waiting = opened[PARALLEL].generate("What is 2+2?", temperature=0, max_tokens=10)
        await asyncio.sleep(0.5)
        assert waiting.start is None or not waiting._parts  # it waits for a free row
        await long[0].cancel()
        assert (await long[0].collect()).finish_reason == "cancelled"
        done = await waiting.collect()
        assert done.finish_reason in ("stop", "length") and waiting.text
        before = len(long[1]._parts)
        await anext(iterators[1])  # the others went on, and still do
        assert len(long[1]._parts) > before
        for stream in long[1:]:
            await stream.cancel()
            await stream.collect()
    finally:
        for s in sessions:
            await s.__aexit__(None, None, None)
    await eventually_idle(engine)
    assert engine.stats.requests_cancelled == cancelled_before + PARALLEL


async def test_multibyte_characters_arrive_whole(hf: RunningServer) -> None:
    async with connect(hf.url) as session:
        stream = session.generate(
            "Reply in Chinese: hello, how are you?", temperature=0, max_tokens=20
        )
        chunks = await read(stream)
    text = "".join(c.text for c in chunks)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text
    # Only a reply cut by max_tokens inside a character may end with U+FFFD.
    assert stream.done is not None
    if stream.done.finish_reason == "length":
        text = text.removesuffix("\ufffd")
    assert "\ufffd" not in text


async def test_stop_string_split_across_tokens(hf: RunningServer) -> None:
    async with connect(hf.url) as session:
        plain = await session.complete("What is 2+2?", temperature=0, max_tokens=30, reset=True)
        assert plain.text is not None and "classic math" in plain.text, plain.text
        stream = session.generate(
            "What is 2+2?", temperature=0, max_tokens=30, stop="ic ma", reset=True
        )
        chunks = await read(stream)
    assert stream.done is not None and stream.done.finish_reason == "stop"
    assert stream.text == plain.text[: plain.text.index("ic ma")]
    assert_contiguous(chunks, stream.done.usage.completion_tokens)


async def test_max_tokens_seed_and_top_p(hf: RunningServer) -> None:
    async with connect(hf.url) as session:
        poem = {"temperature": 1.0, "max_tokens": 8, "reset": True}
        a = await session.complete("Write a poem.", seed=7, **poem)
        b = await session.complete("Write a poem.", seed=7, **poem)
        c = await session.complete("Write a poem.", seed=8, **poem)
        assert a.finish_reason == "length" and a.usage.completion_tokens == 8
        assert a.text == b.text
        assert a.text != c.text
        greedy = await session.complete("Name a fruit.", temperature=0, max_tokens=8, reset=True)
        narrow = await session.complete(
            "Name a fruit.", temperature=1.5, top_p=1e-6, seed=3, max_tokens=8, reset=True
        )
        assert narrow.text == greedy.text


async def test_a_prompt_longer_than_the_context_is_context_overflow(hf: RunningServer) -> None:
    async with connect(hf.url) as session:
        with pytest.raises(SeedanceError) as info:
            await session.complete("word " * (N_CTX_SEQ + 50), max_tokens=5)
        assert info.value.code == "context_overflow"
        assert (await session.complete("What is 2+2?", temperature=0, max_tokens=5)).text


@one_process_only("reads the transformers engine in the server's process")
async def test_a_failed_prefill_fails_only_its_request(
    hf: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_of(hf)
    model = engine.loop.model
    real = type(model).__call__
    broken = {"left": 1}

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids")
        if broken["left"] and ids is not None and ids.shape[1] > 1:  # a prefill, not a step
            broken["left"] -= 1
            raise RuntimeError("injected failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", flaky)
    async with connect(hf.url) as session:
        with pytest.raises(SeedanceError) as info:
            await session.complete("What is 2+2?", temperature=0, max_tokens=5)
        assert info.value.code == "engine_error"
        assert (await session.complete("What is 2+2?", temperature=0, max_tokens=5)).text
    assert engine.health().ok


async def test_the_openai_package_drives_it(hf: RunningServer) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{hf.http_url}/v1", api_key="none", max_retries=0)
    stream = await api.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "What is 2+2?"}],
        temperature=0,
        max_tokens=30,
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert "4" in text, text
    completion = await api.completions.create(
        model="smollm2-135m", prompt="The capital of France is", temperature=0, max_tokens=6
    )
    assert "Paris" in completion.choices[0].text, completion.choices[0].text


async def test_replies_bound_to_a_schema(hf: RunningServer) -> None:
    """Two schema-bound replies in one batch (their masks on the logits' rows), through the
    official package's ``parse``, and one free reply beside them."""
    import jsonschema
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=50_000_000)

    api = openai.AsyncOpenAI(base_url=f"{hf.http_url}/v1", api_key="none", max_retries=0)
    parsed, free, risky = await asyncio.gather(
        api.chat.completions.parse(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Describe Paris."}],
            response_format=City,
            max_tokens=80,
        ),
        api.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            temperature=0,
            max_tokens=20,
        ),
        api.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Describe a risky card payment as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": RISK}},
            max_tokens=300,
            temperature=0.7,
            seed=3,
        ),
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    assert "4" in (free.choices[0].message.content or "")
    assert risky.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(risky.choices[0].message.content or ""), RISK)


async def test_a_tool_call_parses_and_is_valid(hf: RunningServer) -> None:
    import jsonschema
    import openai

    from tests.test_tools import QUESTION, TIME, WEATHER

    api = openai.AsyncOpenAI(base_url=f"{hf.http_url}/v1", api_key="none", max_retries=0)
    reply = await api.chat.completions.create(
        model="smollm2-135m",
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    for call in reply.choices[0].message.tool_calls or ():
        tool = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])  # type: ignore[index]


@one_process_only("reads the transformers engine in the server's process")
async def test_logprobs_equal_a_reference_forward_pass(hf: RunningServer) -> None:
    """Each token's log probability and its 3 likeliest alternatives, against log-softmax in
    float64 over the logits of a plain forward pass of the same model over the whole text."""
    import httpx
    import openai

    question = [{"role": "user", "content": "What is the capital of France?"}]
    api = openai.AsyncOpenAI(base_url=f"{hf.http_url}/v1", api_key="none", max_retries=0)
    reply = await api.chat.completions.create(
        model="smollm2-135m",
        messages=question,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{hf.http_url}/tokenize", json={"messages": question})
    ids = answer.json()["tokens"]
    engine = engine_of(hf)
    pieces = engine.loop.pieces
    with torch.inference_mode():
        for got in content:
            logits = engine.loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            best = torch.topk(logprobs, 3).indices.tolist()
            assert got.token == pieces[best[0]].decode("utf-8", "replace")
            assert got.logprob == pytest.approx(float(logprobs[best[0]]), abs=1e-3)
            assert [t.token for t in got.top_logprobs] == [
                pieces[t].decode("utf-8", "replace") for t in best
            ]
            expected = [float(logprobs[t]) for t in best]
            assert [t.logprob for t in got.top_logprobs] == pytest.approx(expected, abs=1e-3)
            ids.append(best[0])


def test_load_errors_are_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    stderr = serve_fails("--engine", "transformers", "--model-path", str(missing), timeout_s=120)
    assert f"model not found: {missing}" in stderr
    empty = tmp_path / "empty-model"
    empty.mkdir()
    stderr = serve_fails("--engine", "transformers", "--model-path", str(empty), timeout_s=120)
    assert f"transformers cannot load {empty}" in stderr


def test_cuda_without_a_gpu_is_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        create_engine(server_config(engine="transformers", device="cuda"))


async def test_ignore_eos_goes_on_to_max_tokens(hf: RunningServer) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{hf.http_url}/v1", api_key="none", max_retries=0)
    whole = await api.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "What is 2+2? Answer with one number."}],
        temperature=0,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert whole.usage.completion_tokens == 40
