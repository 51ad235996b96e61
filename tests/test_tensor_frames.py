"""A reply's tokens as tensor frames beside its token frames (``generate``'s ``tensors``, docs/
protocol.md section 10), on the real SmolLM2: the ids the model sampled (they decode to the
reply), their log probabilities equal to the JSON ones, a tensor frame right before the token
frame it covers (merged frames included), a resume that goes on with the right ids, and
encryption that seals them."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from seedance.client import connect
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.tensors import decode_tensor
from tests.support.servers import RunningServer, server_config
from tests.support.ws import open_session, recv_json

pytestmark = pytest.mark.model

PROMPT = "Write a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def served() -> Iterator[RunningServer]:
    server = RunningServer(server_config(engine="llamacpp", parallel=2, n_ctx=1024), None).start()
    yield server
    server.stop()


def detokenize(server: RunningServer, ids: list[int]) -> str:
    reply = httpx.post(f"{server.http_url}/detokenize", json={"tokens": ids})
    text: str = reply.json()["prompt"]
    return text


async def test_the_sdk_reads_each_chunks_ids_and_log_probabilities(served: RunningServer) -> None:
    async with connect(served.url) as session:
        stream = session.generate(
            PROMPT,
            max_tokens=40,
            temperature=0,
            logprobs=3,
            tensors=["token_ids", "logprobs", "top_logprobs"],
        )
        async for chunk in stream:
            assert chunk.tensors is not None and chunk.logprobs is not None
            ids = chunk.tensors["token_ids"]
            assert ids.dtype == np.int32 and ids.shape == (chunk.n,)
            expected = np.array([e.logprob for e in chunk.logprobs], dtype=np.float32)
            assert np.array_equal(chunk.tensors["logprobs"], expected)
            tops = [[t.logprob for t in e.top_logprobs] for e in chunk.logprobs]
            assert np.array_equal(chunk.tensors["top_logprobs"], np.array(tops, np.float32))
        done = stream.done
        assert done is not None
    ids = stream.tensor("token_ids")
    assert len(ids) == done.usage.completion_tokens == 40
    assert detokenize(served, ids.tolist()) == stream.text  # the ids the model sampled


async def begin_and_drop(url: str, session_id: str, request: dict[str, Any]) -> list[Any]:
    """Send ``request`` (resumable, with token ids) on a new connection of ``session_id``, read
    its frames until 10 tokens came (tensor frames decoded), and drop the connection."""
    ws, _ = await open_session(url, f"session_id={session_id}")
    await ws.send(json.dumps(request))
    seen: list[Any] = []
    while sum(f.get("n", 1) for f in seen if isinstance(f, dict) and f["type"] == "token") < 10:
        data = await ws.recv()
        seen.append(decode_tensor(data) if data[:1] == b"\x10" else json.loads(data))
    await ws.close()  # mid-reply: it runs on
    return seen


async def read_frames(ws: Any, until: str = "done") -> list[Any]:
    """Text frames as JSON, tensor frames decoded, to the request's end."""
    frames: list[Any] = []
    while True:
        data = await ws.recv()
        if isinstance(data, bytes):
            if data[:1] == b"\x10":
                frames.append(decode_tensor(data))
            elif data == b"\x01\x00":
                await ws.send(b"\x02\x00")
            continue
        frame = json.loads(data)
        frames.append(frame)
        if frame["type"] in (until, "error"):
            return frames


def check_pairs(frames: list[Any], first_seq: int = 0) -> list[int]:
    """Every token frame comes right after its tensor frame (same seq, one id per token), and
    the frames cover the reply from ``first_seq`` without gap; the ids, in order."""
    ids: list[int] = []
    seq = first_seq
    for before, frame in itertools.pairwise(frames):
        if isinstance(frame, dict) and frame["type"] == "token":
            assert not isinstance(before, dict), "a token frame without its tensor frame"
            assert before.name == "token_ids" and before.seq == frame["seq"] == seq
            assert before.array.shape == (frame.get("n", 1),)
            ids += before.array.tolist()
            seq += frame.get("n", 1)
    return ids


async def test_merged_frames_and_a_resume_carry_exactly_their_tokens_ids(
    served: RunningServer,
) -> None:
    request = {
        "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "request_id": "t1",
        "resumable": True, "tensors": ["token_ids"],
    }  # fmt: skip
    seen = await begin_and_drop(served.url, "tensor-resume", request)
    first_ids = check_pairs(seen)
    while True:  # until the log holds tokens to send at once (merged) on the resume
        again, hello = await open_session(served.url, "session_id=tensor-resume")
        active = hello["active"]
        if active["state"] == "done" or active["next_seq"] >= len(first_ids) + 8:
            break
        await again.close()
        await asyncio.sleep(0.2)
    async with again:
        assert active["request_id"] == "t1"
        after = len(first_ids) - 1
        await again.send(json.dumps({"type": "resume", "request_id": "t1", "after_seq": after}))
        rest = await read_frames(again)
    rest_ids = check_pairs(rest, first_seq=after + 1)
    done = rest[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 48
    ids = first_ids + rest_ids
    text = "".join(
        f["token"] for f in [*seen, *rest] if isinstance(f, dict) and f["type"] == "token"
    )
    assert len(ids) == 48 and detokenize(served, ids) == text
    merged = [f for f in rest if isinstance(f, dict) and f.get("n", 1) > 1]
    assert merged, "a resume sends what was logged in as few frames as it likes"


async def test_tensor_frames_are_sealed_on_an_encrypted_connection(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    server = make_server(engine="llamacpp", n_ctx=1024, e2e_key=identity[0])
    async with connect(server.url, e2e=identity[1]) as session:
        stream = session.generate(PROMPT, max_tokens=12, temperature=0, tensors=["token_ids"])
        await stream.collect()
    assert len(stream.tensor("token_ids")) == 12
    assert detokenize(server, stream.tensor("token_ids").tolist()) == stream.text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensors": ["token_ids"], "stream": False}, "not with stream false"),
        ({"tensors": ["logprobs"]}, "logprobs needs the logprobs field"),
        ({"tensors": ["top_logprobs"], "logprobs": 0}, "top_logprobs needs logprobs of 1"),
        ({"tensors": ["token_ids", "token_ids"]}, "each at most once"),
        ({"tensors": ["hidden_state"]}, "tensors"),
    ],
)
async def test_bad_tensor_fields_are_refused_by_name(
    served: RunningServer, fields: dict[str, Any], message: str
) -> None:
    async with connect(served.url) as session:
        with pytest.raises(InvalidRequest, match=message):
            await session.generate("hi", max_tokens=2, **fields).collect()


async def test_an_engine_without_token_ids_says_so(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server()  # the synthetic engine
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt": "hi", "tensors": ["token_ids"]}))
        error = await recv_json(ws)
    assert "synthetic engine of model synthetic gives no token ids" in error["error"]["message"]


async def test_a_prompt_of_token_ids_as_a_tensor_or_a_list(served: RunningServer) -> None:
    """``prompt_ids`` (a JSON list, or a tensor frame named by ``prompt_tensor``) and the
    completions API's token-array prompt continue the same tokens: the same greedy reply, and
    the session's context is left as it was."""
    text = "The capital of France is"
    async with httpx.AsyncClient(base_url=served.http_url, timeout=60) as http:
        ids = (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]
    async with connect(served.url, session_id="token-prompts") as session:
        as_tensor = await session.generate(
            prompt_ids=np.array(ids, dtype=np.int32), max_tokens=12, temperature=0, stream=False
        ).collect()
        as_list = await session.complete(prompt_ids=ids, max_tokens=12, temperature=0)
        assert as_tensor.text == as_list.text and as_tensor.usage.prompt_tokens == len(ids)
        assert session.info.context_turns == 0
    async with httpx.AsyncClient(base_url=served.http_url, timeout=60) as http:
        body = {"prompt": ids, "max_tokens": 12, "temperature": 0}
        completion = (await http.post("/v1/completions", json=body)).json()
    assert completion["choices"][0]["text"] == as_list.text
    assert completion["usage"]["prompt_tokens"] == len(ids)
    async with connect(served.url, session_id="token-prompts") as again:
        assert again.info.context_turns == 0  # nothing of either kept
    async with connect(served.url) as session:
        with pytest.raises(InvalidRequest, match=r"prompt_ids\[1\]: 99999999 is not a token"):
            await session.complete(prompt_ids=[1, 99999999], max_tokens=2)
        with pytest.raises(InvalidRequest, match="exactly one of prompt, messages and prompt_ids"):
            await session.complete("hi", prompt_ids=[1], max_tokens=2)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        with pytest.raises(InvalidRequest, match="cannot offer tools"):
            await session.complete(prompt_ids=[1], tools=[tool], max_tokens=2)


async def test_an_engine_without_token_ids_refuses_a_prompt_of_them(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server()
    async with connect(server.url) as session:
        with pytest.raises(InvalidRequest, match="synthetic engine of model synthetic takes no"):
            await session.complete(prompt_ids=[1, 2], max_tokens=2)
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"prompt_tensor": "ids", "request_id": "p1"}))
        error = await recv_json(ws)
    assert "prompt_tensor: no tensor frame 'ids' was sent" in error["error"]["message"]
