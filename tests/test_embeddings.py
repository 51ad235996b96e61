"""``/v1/embeddings`` on the packaged all-MiniLM-L6-v2, beside a text model, driven by the
official ``openai`` package over real sockets; the vectors checked against sentence-transformers
on the same model folder."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from seedance.client import connect
from seedance.protocol.e2e import ClientHandshake, load_pinned
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.tensors import Tensor, encode_tensor
from tests.support.servers import RunningServer, one_process_only, server_config
from tests.support.vectors import cosine
from tests.support.waits import eventually
from tests.support.ws import generate, open_session, recv_json, wait_closed

pytestmark = pytest.mark.model

MODEL = "all-minilm-l6-v2"
SENTENCES = [
    "The sea is calm tonight.",
    "Otters hold hands while they sleep.",
    "A risk engine flags the transfer for review.",
    "été",
]


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embeddings") / "audit.log"


@pytest.fixture(scope="module")
def served(audit_log: Path) -> Iterator[RunningServer]:
    """The synthetic text engine and the embedding model, on one server."""
    config = server_config(
        engine="synthetic", embedding_model=MODEL, embedding_batch=64, audit_file=str(audit_log)
    )
    server = RunningServer(config, None).start()
    yield server
    server.stop()


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


async def test_vectors_equal_sentence_transformers(served: RunningServer, reference: Any) -> None:
    api = client(served)
    expected = reference.encode(SENTENCES)
    for encoding in ("float", "base64"):
        reply = await api.embeddings.create(
            model=MODEL,
            input=SENTENCES,
            encoding_format=encoding,  # type: ignore[arg-type]
        )
        vectors: list[Any] = [d.embedding for d in sorted(reply.data, key=lambda d: d.index)]
        if encoding == "base64":  # little-endian float32, as OpenAI sends it
            vectors = [np.frombuffer(base64.b64decode(v), dtype="<f4") for v in vectors]
        assert len(vectors) == len(SENTENCES) and len(vectors[0]) == 384
        assert (cosine(vectors, expected) >= 0.9999).all()
        assert reply.model == MODEL and reply.usage.prompt_tokens == reply.usage.total_tokens
    # Unasked, the openai package asks for base64 and decodes it itself.
    default = await api.embeddings.create(model=MODEL, input=SENTENCES[0])
    assert cosine(default.data[0].embedding, expected[0]) >= 0.9999
    assert default.usage.prompt_tokens == len(reference.tokenizer(SENTENCES[0])["input_ids"])


async def test_token_ids_embed_as_their_text(served: RunningServer, reference: Any) -> None:
    ids = reference.tokenizer(SENTENCES[1])["input_ids"]
    api = client(served)
    one = await api.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    several = await api.embeddings.create(
        model=MODEL, input=[ids, ids[:4]], encoding_format="float"
    )
    expected = reference.encode(SENTENCES[1])
    assert cosine(one.data[0].embedding, expected) >= 0.9999
    assert cosine(several.data[0].embedding, expected) >= 0.9999
    assert len(several.data) == 2 and one.usage.prompt_tokens == len(ids)


@one_process_only("reads the embedding engine's passes in its process")
async def test_concurrent_requests_share_forward_passes(served: RunningServer) -> None:
    engine = served.state.models[MODEL].engine
    api = client(served)
    before = engine.passes
    batch = [f"input {i} of a batch about the sea" for i in range(32)]
    replies = await asyncio.gather(
        *[api.embeddings.create(model=MODEL, input=batch, encoding_format="float")
          for _ in range(8)]
    )  # fmt: skip
    assert all(len(r.data) == 32 for r in replies)
    assert all(r.data[5].embedding == replies[0].data[5].embedding for r in replies)
    assert engine.passes - before < 8  # 256 inputs in fewer passes than requests


@one_process_only("reads the embedding engine's passes in its process")
async def test_a_request_larger_than_a_pass_is_split(served: RunningServer, reference: Any) -> None:
    engine = served.state.models[MODEL].engine
    before = engine.passes
    texts = [f"{i} {SENTENCES[i % 4]}" for i in range(150)]  # --embedding-batch is 64
    reply = await client(served).embeddings.create(
        model=MODEL, input=texts, encoding_format="float"
    )
    assert engine.passes - before >= 3
    vectors = [d.embedding for d in sorted(reply.data, key=lambda d: d.index)]
    assert (cosine(vectors, reference.encode(texts)) >= 0.9999).all()


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"model": MODEL, "input": []}, "at least one input"),
        ({"model": MODEL, "input": ["a", 3]}, "not a mix"),
        ({"model": MODEL, "input": ["fine", "sea " * 300]}, "input[1] takes"),
        ({"model": MODEL, "input": [[1, 2], [99999999]]}, "input[1]: 99999999 is not a token"),
        ({"model": MODEL, "input": [""]}, "input[0] is empty"),
        ({"model": MODEL, "input": "x", "dimensions": 100}, "dimensions: model"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "x", "extra": 1}, "extra"),
        ({"model": "synthetic", "input": "x"}, "generates text and has no embeddings"),
    ],
)
def test_bad_input_is_refused_by_name(
    served: RunningServer, body: dict[str, Any], names: str
) -> None:
    answer = httpx.post(f"{served.http_url}/v1/embeddings", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert names in answer.json()["error"]["message"]


async def test_chat_on_an_embedding_model_is_refused(served: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        await client(served).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{served.http_url}/v1/models")).json()["data"]
    assert {m["id"]: m["context_length"] for m in models} == {"synthetic": 32768, MODEL: 256}


async def test_an_answer_is_audited_with_its_tokens(served: RunningServer, audit_log: Path) -> None:
    reply = await client(served).embeddings.create(model=MODEL, input=["audit me", "and me"])

    def records() -> list[dict[str, Any]]:
        lines = audit_log.read_text().splitlines() if audit_log.exists() else []
        return [
            r for r in map(json.loads, lines)
            if r["kind"] == "request" and r.get("prompt_tokens") == reply.usage.prompt_tokens
        ]  # fmt: skip

    await eventually(records, 5, "the embeddings request's audit record")
    record = records()[-1]
    assert record["outcome"] == "embedded" and record["model"] == MODEL
    assert record["engine"] == "embeddings" and record["request_id"].startswith("emb-")


def test_tokenize_gives_the_ids_the_model_embeds(served: RunningServer, reference: Any) -> None:
    url = f"{served.http_url}/tokenize"
    tokens = httpx.post(url, json={"model": MODEL, "prompt": SENTENCES[2]}).json()
    assert tokens["tokens"] == reference.tokenizer(SENTENCES[2])["input_ids"]
    assert tokens["max_model_len"] == 256
    chat = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 400 and "without a chat template" in chat.json()["error"]["message"]


async def test_the_embed_frame_of_v2_infer(served: RunningServer, reference: Any) -> None:
    """The same request over a session's WebSocket, beside a reply streaming on it."""
    async with connect(served.url) as session:
        stream = session.generate("tell me about the sea", max_tokens=64)
        frame, done = await asyncio.gather(session.embed(SENTENCES, model=MODEL), stream.collect())
        assert done.usage.completion_tokens == 64
        assert frame.model == MODEL and frame.request_id.startswith("e-")
        assert (cosine(frame.data, reference.encode(SENTENCES)) >= 0.9999).all()
        packed = await session.embed(SENTENCES[0], encoding_format="base64")  # the first served
        assert isinstance(packed.data[0], str)
        vector = np.frombuffer(base64.b64decode(packed.data[0]), dtype="<f4")
        assert cosine(vector, reference.encode(SENTENCES[0])) >= 0.9999
        assert packed.usage.prompt_tokens == len(reference.tokenizer(SENTENCES[0])["input_ids"])
        with pytest.raises(InvalidRequest, match="generates text and has no embeddings"):
            await session.embed("x", model="synthetic")
        with pytest.raises(InvalidRequest, match=r"input\[1\] takes"):
            await session.embed(["fine", "sea " * 300])
        again = await session.complete("still open?", max_tokens=4)  # a refusal closes nothing
        assert again.usage.completion_tokens == 4


async def test_embeddings_as_a_tensor_frame(served: RunningServer, reference: Any) -> None:
    """``encoding_format: tensor``: one binary frame, read by the SDK as a float32 array with
    no copy; token ids go up as a tensor frame too."""
    async with connect(served.url) as session:
        answer = await session.embed_array(SENTENCES, model=MODEL)
        assert answer.vectors.dtype == np.float32 and answer.vectors.shape == (4, 384)
        assert not answer.vectors.flags.writeable  # a view of the frame
        floats = await session.embed(SENTENCES, model=MODEL)
        assert np.array_equal(answer.vectors, np.asarray(floats.data, dtype=np.float32))
        assert answer.usage == floats.usage and answer.model == MODEL
        ids = np.array(reference.tokenizer(SENTENCES[1])["input_ids"], dtype=np.int32)
        by_ids = await session.embed_array(ids)
        assert by_ids.vectors.shape == (1, 384) and by_ids.usage.prompt_tokens == len(ids)
        assert cosine(by_ids.vectors[0], reference.encode(SENTENCES[1])) >= 0.9999
        two = await session.embed_array(np.stack([ids, ids]).astype(np.int64))
        assert two.vectors.shape == (2, 384)


async def test_bad_tensor_frames_get_an_error_and_nothing_else_changes(
    served: RunningServer,
) -> None:
    ws, _ = await open_session(served.url)
    async with ws:
        ids = encode_tensor(Tensor("e1", "ids", np.array([101, 102], dtype="<i4")))
        await ws.send(ids)
        await ws.send(json.dumps({"type": "embed", "request_id": "e1", "input_tensor": "idz"}))
        error = await recv_json(ws)
        assert error["request_id"] == "e1" and "no tensor frame 'idz'" in error["error"]["message"]
        await ws.send(encode_tensor(Tensor("e2", "ids", np.ones(2, dtype="<f4"))))
        await ws.send(json.dumps({"type": "embed", "request_id": "e2", "input_tensor": "ids"}))
        error = await recv_json(ws)
        assert "must hold token ids: integers" in error["error"]["message"]
        await ws.send(ids.replace(b"e1", b"r3"))  # a tensor the generate does not use
        frames = await generate(ws, prompt="hi", request_id="r3", max_tokens=2)
        assert "'ids' sent for this request, which does not use them" in str(frames[-1])
        await ws.send(ids[:-1])  # cut short
        error = await recv_json(ws)
        assert error["error"]["code"] == "invalid_request" and "frame carries 7" in str(error)
        await ws.send(ids.replace(b"e1", b"e4"))
        await ws.send(json.dumps({"type": "embed", "request_id": "e4", "input_tensor": "ids"}))
        answer = await recv_json(ws)
        assert answer["type"] == "embeddings" and len(answer["data"][0]) == 384
        frames = await generate(ws, prompt="still here", max_tokens=2)
        assert frames[-1]["type"] == "done"


async def test_tensor_frames_are_sealed_on_an_encrypted_connection(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    server = make_server(embedding_model=MODEL, e2e_key=identity[0])
    async with connect(server.url, e2e=identity[1]) as session:
        ids = np.array([101, 7592, 102], dtype=np.int32)
        answer = await session.embed_array(ids)
        plain = await session.embed([ids.tolist()])
        assert np.array_equal(answer.vectors, np.asarray(plain.data, dtype=np.float32))
    ws, _ = await open_session(server.url, "e2e=" + ClientHandshake(load_pinned(identity[1])).param)
    async with ws:  # a tensor frame in the clear is refused: it would carry data unsealed
        await ws.send(encode_tensor(Tensor("e1", "input_ids", ids)))
        code, _ = await wait_closed(ws)
        assert code == 4400
