"""The Open Inference Protocol over HTTP (``/v2/models/{name}/infer`` and its kin), driven by the
unchanged ``tritonclient[http]`` and ``kserve`` clients over real sockets: embeddings from the
packaged all-MiniLM-L6-v2 checked against sentence-transformers, text from the synthetic engine
and from the real SmolLM2 checked against the completions API, binary data both ways, and every
refusal in the protocol's shape."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from tritonclient.utils import InferenceServerException

from seedance.config_loader import load_access
from seedance.tenants.keys import add_key
from tests.support.servers import RunningServer, one_process_only, server_config
from tests.support.vectors import cosine
from tests.support.waits import eventually

pytestmark = pytest.mark.model

EMBEDDER = "all-minilm-l6-v2"
SENTENCES = ["The sea is calm tonight.", "Otters hold hands while they sleep.", "été"]


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oip") / "audit.log"


@pytest.fixture(scope="module")
def served(audit_log: Path) -> Iterator[RunningServer]:
    """The synthetic text engine and the embedding model, on one server."""
    config = server_config(engine="synthetic", embedding_model=EMBEDDER, audit_file=str(audit_log))
    server = RunningServer(config, None).start()
    yield server
    server.stop()


def triton_client(server: RunningServer) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.http_url.removeprefix("http://"))


def texts(name: str, values: list[str], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=object), binary)
    return tensor


def test_health_and_metadata_as_tritonclient_reads_them(served: RunningServer) -> None:
    client = triton_client(served)
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    assert client.is_model_ready(EMBEDDER) and client.is_model_ready("synthetic")
    embedder = client.get_model_metadata(EMBEDDER)
    assert embedder["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    assert [i["name"] for i in embedder["inputs"]] == ["text", "input_ids"]
    text = client.get_model_metadata("synthetic")
    assert text["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert [o["name"] for o in text["outputs"]] == ["text_output", "finish_reason"]
    with pytest.raises(InferenceServerException) as missing:
        client.get_model_metadata("nope")
    assert missing.value.status() == "404" and "not served here" in missing.value.message()
    assert not client.is_model_ready("nope")


def test_embeddings_in_binary_and_json_equal_the_reference(
    served: RunningServer, reference: Any
) -> None:
    client = triton_client(served)
    binary = client.infer(EMBEDDER, [texts("text", SENTENCES)])
    vectors = binary.as_numpy("embedding")
    assert vectors.dtype == np.float32 and vectors.shape == (3, 384)
    assert binary.get_response()["outputs"][0]["parameters"] == {"binary_data_size": 3 * 384 * 4}
    assert (cosine(vectors, reference.encode(SENTENCES)) >= 0.9999).all()
    as_json = client.infer(
        EMBEDDER,
        [texts("text", SENTENCES, binary=False)],
        outputs=[triton.InferRequestedOutput("embedding", binary_data=False)],
    )
    assert "data" in as_json.get_response()["outputs"][0]
    assert np.array_equal(as_json.as_numpy("embedding"), vectors)  # float32 round-trips in JSON
    openai = httpx.post(f"{served.http_url}/v1/embeddings", json={"input": SENTENCES}).json()
    assert np.array_equal(np.array([d["embedding"] for d in openai["data"]], "<f4"), vectors)
    tokens = reference.tokenizer(SENTENCES[1])["input_ids"]
    ids = triton.InferInput("input_ids", [1, len(tokens)], "INT32")
    ids.set_data_from_numpy(np.array([tokens], dtype=np.int32))
    by_ids = client.infer(EMBEDDER, [ids]).as_numpy("embedding")
    assert cosine(by_ids[0], vectors[1]) >= 0.9999
    compressed = triton_client(served).infer(
        EMBEDDER, [texts("text", SENTENCES)], request_compression_algorithm="gzip"
    )
    assert np.array_equal(compressed.as_numpy("embedding"), vectors)


async def test_the_kserve_client_infers_with_binary_data(served: RunningServer) -> None:
    config = RESTConfig(protocol="v2", retries=0, timeout=30)
    async with InferenceRESTClient(config) as client:
        assert await client.is_server_live(served.http_url)
        assert await client.is_server_ready(served.http_url)
        assert await client.is_model_ready(served.http_url, EMBEDDER)
        given = InferInput("text", [2], "BYTES")
        given.set_data_from_numpy(np.array([b"sea", b"otters"], dtype=object), binary_data=True)
        request = InferRequest(EMBEDDER, [given], request_id="k-1")
        response = await client.infer(served.http_url, request, model_name=EMBEDDER)
    assert response.id == "k-1" and response.model_name == EMBEDDER
    assert response.outputs[0].as_numpy().shape == (2, 384)


def test_text_in_text_out_as_the_completions_api_writes_it(served: RunningServer) -> None:
    client = triton_client(served)
    reply = client.infer(
        "synthetic", [texts("text_input", ["Once upon a time"])], parameters={"max_tokens": 6}
    )
    text = reply.as_numpy("text_output")[0].decode()
    assert reply.as_numpy("finish_reason").tolist() == [b"length"]
    completion = httpx.post(
        f"{served.http_url}/v1/completions",
        json={"model": "synthetic", "prompt": "Once upon a time", "max_tokens": 6},
    ).json()
    assert text == completion["choices"][0]["text"] and text
    # Sampling fields as one-element tensors, as Triton's TensorRT-LLM models take them.
    limit = triton.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([3], dtype=np.int32))
    stop = texts("stop", ["zzz"])
    short = client.infer(
        "synthetic",
        [texts("text_input", ["Hi"]), limit, stop],
        outputs=[triton.InferRequestedOutput("text_output", binary_data=False)],
    )
    response = short.get_response()
    assert [o["name"] for o in response["outputs"]] == ["text_output"]
    assert len(response["outputs"][0]["data"][0].split()) == 3


@pytest.mark.parametrize(
    ("model", "body", "status", "message"),
    [
        ("synthetic", {"inputs": []}, 400, "inputs: expected a non-empty list"),
        ("synthetic", {"inputs": [{"name": "x", "shape": [1], "datatype": "FLOAT", "data": [1]}]},
         400, "unknown datatype 'FLOAT'"),
        ("synthetic", {"inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES",
                                   "data": ["hi"]}]}, 400, "has no input prompt"),
        ("synthetic", {"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES",
                                   "data": ["a", "b"]}]}, 400, "one prompt per request"),
        ("synthetic", {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                   "data": ["a"]}], "parameters": {"max_tokens": 0}},
         400, "max_tokens must be between 1"),
        ("synthetic", {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                   "data": ["a"]}], "parameters": {"top_k": 3}},
         400, "parameters: top_k not supported"),
        ("synthetic", {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                   "data": ["a"]}], "outputs": [{"name": "logits"}]},
         400, "has no output 'logits'"),
        (EMBEDDER, {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]},
                               {"name": "input_ids", "shape": [1, 1], "datatype": "INT64",
                                "data": [101]}]}, 400, "takes one input: text or input_ids"),
        (EMBEDDER, {"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "FP32",
                                "data": [1.5]}]}, 400, "input_ids: token ids"),
        (EMBEDDER, {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                "data": ["sea " * 300]}]}, 400, "input[0] takes"),
        ("nope", {"inputs": []}, 404, "'nope' is not served here"),
    ],
)  # fmt: skip
def test_bad_requests_get_the_protocols_error_naming_the_field(
    served: RunningServer, model: str, body: dict[str, Any], status: int, message: str
) -> None:
    reply = httpx.post(f"{served.http_url}/v2/models/{model}/infer", json=body)
    assert reply.status_code == status and message in reply.json()["error"], reply.text
    assert set(reply.json()) == {"error"}


def test_the_rest_of_v2_answers_in_the_protocols_shape(served: RunningServer) -> None:
    url = served.http_url
    assert httpx.get(f"{url}/v2/models/synthetic/versions/1").json() == {
        "error": "model synthetic has no version '1'; it serves no versions (leave it out)"
    }
    missing = httpx.post(f"{url}/v2/repository/index")
    assert missing.status_code == 404 and "not an endpoint" in missing.json()["error"]
    head = b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", '
    head += b'"parameters": {"binary_data_size": 9}}]}'
    cut = httpx.post(  # 9 bytes said, 7 sent
        f"{url}/v2/models/{EMBEDDER}/infer",
        content=head + b"\x03\x00\x00\x00sea",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    assert cut.status_code == 400 and "binary_data_size" in cut.json()["error"], cut.text
    bomb = gzip.compress(b" " * 4_000_000)
    big = httpx.post(
        f"{url}/v2/models/{EMBEDDER}/infer", content=bomb, headers={"Content-Encoding": "gzip"}
    )
    assert big.status_code == 413 and set(big.json()) == {"error"}
    assert httpx.get(f"{url}/v2/infer").status_code == 426  # the WebSocket endpoint, as before


async def test_an_infer_is_audited_like_every_request(
    served: RunningServer, audit_log: Path
) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01"}
    triton_client(served).infer(EMBEDDER, [texts("text", ["audit this"])], headers=headers)

    def records() -> list[dict[str, Any]]:
        lines = audit_log.read_text().splitlines() if audit_log.exists() else []
        return [
            r for r in map(json.loads, lines)
            if r["kind"] == "request" and r.get("trace_id") == trace
        ]  # fmt: skip

    await eventually(records, 5, "the infer's audit record")
    record = records()[-1]
    assert record["model"] == EMBEDDER and record["api"] == "http"
    assert record["request_id"].startswith("oip-") and record["outcome"] == "embedded"
    assert record["prompt_tokens"] == 4  # [CLS] audit this [SEP]


def test_a_tenants_server_refuses_without_a_key_in_the_protocols_shape(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    path = tmp_path / "seedance.toml"
    key = add_key(path, "acme").key
    server = make_server(config_file=str(path), access=load_access(path))
    client = triton_client(server)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("synthetic", [texts("text_input", ["hi"])])
    assert refused.value.status() == "401"
    keyed = client.infer(
        "synthetic",
        [texts("text_input", ["hi"])],
        headers={"Authorization": f"Bearer {key}"},
        parameters={"max_tokens": 2},
    )
    assert keyed.as_numpy("finish_reason").tolist() == [b"length"]


@one_process_only("reads the engine in the server's process")
def test_the_embedded_model_answers_as_its_completions_do(
    make_server: Callable[..., RunningServer],
) -> None:
    """The real SmolLM2 on llama.cpp, greedy: the same text through both APIs."""
    server = make_server(engine="llamacpp", n_ctx=1024)
    prompt = "The capital of France is"
    reply = triton_client(server).infer(
        server.engine.info.name,
        [texts("text_input", [prompt])],
        parameters={"max_tokens": 12, "temperature": 0.0},
    )
    completion = httpx.post(
        f"{server.http_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
        timeout=60,
    ).json()
    assert reply.as_numpy("text_output")[0].decode() == completion["choices"][0]["text"]
