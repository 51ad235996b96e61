"""The ``vllm`` engine.

vLLM runs only on CUDA GPUs and is not installed on the machines this suite normally runs on.

- Everywhere: the engine against a stand-in for vLLM's API (``tests/support/fake_vllm``) that
  behaves as each vLLM release from 0.10 to 0.33 does where they differ, and records what the
  engine gave it; and the error a user gets without vLLM.
- Where ``vllm`` imports, a CUDA GPU is present and ``SEEDANCE_VLLM_MODEL`` names a model
  folder: the engine serving that model over real sockets (and ``make gpu-smoke`` on any GPU
  machine); elsewhere skipped with a reason that says so.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from seedance.client import connect
from seedance.config import ConfigError
from seedance.engines.base import GenerationRequest, SamplingParams, TokenDelta
from seedance.engines.local import default_model_path
from seedance.protocol.errors import EngineError, InvalidRequest
from seedance.protocol.messages import ChatMessage
from tests.support.servers import RunningServer, serve_fails, server_config

HAS_VLLM = importlib.util.find_spec("vllm") is not None
MODEL = os.environ.get("SEEDANCE_VLLM_MODEL", "")


@pytest.mark.subprocess
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
    fields = {"model_path": MODEL, "model": "m", "gpu_memory_utilization": 0.5}
    server = RunningServer(server_config(engine="vllm", **fields), None).start()
    yield server
    server.stop()


@pytest.mark.timeout(600)
async def test_vllm_streams_cancels_and_seeds(vllm_server: RunningServer) -> None:
    """vLLM computes a prompt's first run cold and later ones from its prefix cache, which may
    differ slightly: the seeded runs compared follow a warm-up run of the same request."""
    async with connect(vllm_server.url) as session:
        stream = session.generate("What is 2+2?", temperature=0, max_tokens=30)
        seq = 0
        async for chunk in stream:
            assert chunk.seq == seq
            seq += chunk.n
        assert stream.done is not None and stream.done.finish_reason in ("stop", "length")
        assert seq == stream.done.usage.completion_tokens
        poem = {"temperature": 1.0, "seed": 5, "max_tokens": 12, "reset": True}
        await session.complete("Write a poem.", **poem)  # warm-up: the prefix is cached now
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


# ---- the engine against vLLM's API as each release has it (tests/support/fake_vllm)

FAKE = Path(__file__).parent / "support" / "fake_vllm"
#: A release on each side of every change the engine must handle.
RELEASES = ["0.10.0", "0.13.0", "0.14.0", "0.20.0", "0.23.0", "0.26.0", "0.27.0", "0.33.0"]
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the vllm engine's tokenizer needs transformers (pip install 'seedance[test]')",
)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_model import smollm2_tokenizer

    return smollm2_tokenizer(tmp_path_factory.mktemp("smollm2-tokenizer"))


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """``use(version)``: the stand-in imports as ``vllm``, acting as that release."""
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}

    def forget() -> None:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]

    def use(version: str) -> ModuleType:
        forget()
        monkeypatch.setenv("FAKE_VLLM_VERSION", version)
        monkeypatch.syspath_prepend(str(FAKE))
        import vllm

        assert vllm.__file__ is not None and vllm.__file__.startswith(str(FAKE))
        return vllm

    yield use
    forget()
    sys.modules.update(saved)


def make_engine(path: Path, **options: Any) -> Any:
    from seedance.engines.vllm_async import VllmEngine

    return VllmEngine(model_path=path, name="m", max_model_len=2048, **options)


def ask(
    text: str = "Hello", request_id: str = "r1", priority: int = 0, **params: Any
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        messages=(ChatMessage("user", text),),
        params=SamplingParams(**params),
        prompt_tokens=0,
        priority=priority,
    )


async def reply(engine: Any, request: GenerationRequest) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(request)]


@needs_transformers
@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.slow
async def test_a_reply_streams_ends_and_is_never_aborted(
    fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path, version: str
) -> None:
    fake_vllm(version)
    engine = make_engine(tokenizer_folder)
    llm = engine.llm
    deltas = await reply(engine, ask(max_tokens=5, priority=2))
    assert "".join(d.text for d in deltas) == "t0 t1 t2 t3 t4 "
    assert [d.tokens for d in deltas] == [1] * 5
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]
    assert llm.aborted == []  # a finished request is read to its end, not closed at it
    assert engine.unfinished_requests() == 0
    (request,) = llm.requests
    tokens = engine.prompts.tokens([ChatMessage("user", "Hello")], False)
    assert request.prompt["prompt_token_ids"] == tokens
    # vLLM 0.19 on takes tokens_input (TokensPrompt is deprecated from 0.17)
    assert ("type" in request.prompt) == (version >= "0.19")
    assert request.priority == -2  # vLLM serves lower values first
    assert request.params.max_tokens == 5 and request.params.n == 1


@needs_transformers
def test_engine_args(fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path) -> None:
    """--max-running is vLLM's max_num_seqs as well as Seedance's admission cap."""
    fake_vllm("0.33.0")
    engine = make_engine(tokenizer_folder, max_num_seqs=3)
    args = engine.llm.args
    assert (args.scheduling_policy, args.enable_prefix_caching) == ("priority", True)
    assert args.max_num_seqs == engine.max_concurrency == 3
    assert (args.model, args.served_model_name, args.max_model_len) == (
        str(tokenizer_folder),
        "m",
        2048,
    )
    assert engine.info.context_length == 2048


@needs_transformers
@pytest.mark.parametrize("version", ["0.10.0", "0.13.0", "0.33.0"])
async def test_two_live_requests_with_the_same_id_both_run(
    fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path, version: str
) -> None:
    fake_vllm(version)
    engine = make_engine(tokenizer_folder)
    engine.llm.step_s = 0.002  # both are live at once
    a, b = await asyncio.gather(*(reply(engine, ask(max_tokens=4)) for _ in range(2)))
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    ids = [r.request_id for r in engine.llm.requests]
    assert len(set(ids)) == 2 and all(i.startswith("r1.") for i in ids)


@needs_transformers
@pytest.mark.parametrize("version", ["0.13.0", "0.20.0", "0.27.0", "0.33.0"])
async def test_a_request_vllm_refuses_is_an_invalid_request(
    fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path, version: str
) -> None:
    """vLLM's validation errors are ValueErrors up to 0.26 and VLLMClientErrors from 0.27."""
    fake_vllm(version)
    engine = make_engine(tokenizer_folder)
    engine.llm.refuse = "This model's maximum context length is 2048 tokens."
    with pytest.raises(InvalidRequest, match="vLLM refused the request: This model's maximum"):
        await reply(engine, ask())
    engine.llm.refuse = None
    # SamplingParams validates itself as it is made (here: a bad generation_config default)
    engine.model_defaults = {"top_p": 0.0}
    request = ask()
    unset = GenerationRequest(
        request.request_id,
        request.messages,
        SamplingParams(unset=frozenset({"top_p"})),
        request.prompt_tokens,
    )
    with pytest.raises(InvalidRequest, match=r"top_p must be in \(0, 1\]"):
        await reply(engine, unset)
    assert engine.unfinished_requests() == 0


@needs_transformers
@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("repetition", "stop"),
        ("abort", None),
        ("error", None),
        ("a reason from a later vLLM", None),
    ],
)
async def test_finish_reasons(
    fake_vllm: Callable[[str], ModuleType],
    tokenizer_folder: Path,
    reason: str,
    finish: str | None,
) -> None:
    """A request vLLM aborted or failed is an engine error, never a clean ``stop``."""
    fake_vllm("0.33.0")
    engine = make_engine(tokenizer_folder)
    engine.llm.script = lambda prompt, params: [("a", [1], None), ("b", [2], reason)]
    if finish is None:
        with pytest.raises(EngineError, match="retry"):
            await reply(engine, ask())
    else:
        deltas = await reply(engine, ask())
        assert [(d.text, d.tokens, d.finish_reason) for d in deltas] == [
            ("a", 1, None),
            ("b", 1, finish),
        ]


@needs_transformers
async def test_deltas_without_text_carry_their_tokens_to_the_next_text(
    fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path
) -> None:
    """vLLM sends token ids with no text for a held-back stop string or a cut character."""
    fake_vllm("0.33.0")
    engine = make_engine(tokenizer_folder)
    script = [("", [1]), ("", [2]), ("é", [3]), ("", [4]), ("x", [5]), ("", [6])]
    engine.llm.script = lambda prompt, params: [
        (text, ids, "stop" if i == len(script) - 1 else None)
        for i, (text, ids) in enumerate(script)
    ]
    deltas = await reply(engine, ask())
    assert [(d.text, d.tokens, d.finish_reason) for d in deltas] == [
        ("é", 3, None),
        ("x", 2, None),
        ("", 1, "stop"),
    ]


@needs_transformers
async def test_a_closed_stream_aborts_the_request_in_vllm(
    fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path
) -> None:
    fake_vllm("0.13.0")
    engine = make_engine(tokenizer_folder)
    engine.llm.step_s = 0.005
    stream: AsyncGenerator[TokenDelta, None] = engine.generate(ask(max_tokens=100))
    await anext(stream)
    assert engine.unfinished_requests() == 1
    await stream.aclose()  # cancel, disconnect or shutdown
    assert engine.llm.aborted == [engine.llm.requests[0].request_id]
    assert engine.unfinished_requests() == 0


@needs_transformers
async def test_the_models_generation_config_fills_what_the_client_left_out(
    fake_vllm: Callable[[str], ModuleType], tokenizer_folder: Path
) -> None:
    """As ``vllm serve`` does: the model's defaults for settings Seedance's APIs do not have,
    and for temperature and top_p where the client left them to the server (OpenAI API)."""
    vllm = fake_vllm("0.20.0")
    from vllm.v1.engine.async_llm import AsyncLLM

    AsyncLLM.generation_config = {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    try:
        engine = make_engine(tokenizer_folder)
    finally:
        AsyncLLM.generation_config = {}
    assert vllm.__version__ == "0.20.0"
    await reply(engine, ask(temperature=1.0, top_p=0.9))  # the WebSocket API: always set
    await reply(engine, ask(temperature=1.0, top_p=0.9, unset=frozenset({"temperature"})))
    given = [(r.params.temperature, r.params.top_p, r.params.top_k) for r in engine.llm.requests]
    assert given == [(1.0, 0.9, 20), (0.3, 0.9, 20)]


def test_the_openai_api_leaves_unset_temperature_to_the_model() -> None:
    from seedance.protocol.codec import FrameLimits
    from seedance.protocol.openai import decode_chat

    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}'
    request = decode_chat(body, FrameLimits())
    assert request.unset == frozenset({"temperature"})
    assert SamplingParams.of(request.generate, request.unset).unset == {"temperature"}


@needs_transformers
@pytest.mark.slow
async def test_gguf_files(
    fake_vllm: Callable[[str], ModuleType],
    tokenizer_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM reads GGUF itself up to 0.23 (the tokenizer from the file), from 0.24 only with
    vllm-gguf-plugin (with the model's config and tokenizer beside the file)."""
    gguf = default_model_path()
    fake_vllm("0.23.0")
    engine = make_engine(gguf)
    assert engine.llm.args.model == str(gguf)
    assert await reply(engine, ask(max_tokens=2))
    assert engine.info.version == f"{gguf.name} (vLLM 0.23.0)"

    fake_vllm("0.24.0")
    with pytest.raises(ConfigError, match=r"only with its plugin \(pip install vllm-gguf-plugin"):
        make_engine(gguf)
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "vllm_gguf_plugin.py").write_text("")
    monkeypatch.syspath_prepend(str(plugin))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(gguf)
    with pytest.raises(ConfigError, match=r"needs the model's Hugging Face config\.json"):
        make_engine(folder / "model.gguf")
    for item in os.listdir(tokenizer_folder):
        (folder / item).symlink_to(tokenizer_folder / item)
    (folder / "config.json").write_text("{}")
    assert await reply(make_engine(folder / "model.gguf"), ask(max_tokens=2))
    with pytest.raises(ConfigError, match="model not found"):
        make_engine(tmp_path / "missing.gguf")
