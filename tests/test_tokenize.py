"""The conventions tools expect of an OpenAI-compatible server: ``GET /health``, ``/v1/models``
with each model's context, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's bodies and
llama-server's), over real sockets, with the embedded model's own tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from seedance.engines.local import default_model_path
from tests.support.servers import RunningServer, one_process_only

TEXT = "Héllo there, sea otters! <|im_start|> 12345 \u00e9t\u00e9"


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", json=body, timeout=30)


@pytest.fixture(scope="module")
def reference() -> Any:
    """llama.cpp's own tokenizer of the embedded model, through llama-cpp-python's ``Llama``
    (vocabulary only): what the tokens must be."""
    import llama_cpp

    return llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)


def test_health_and_models_as_tools_expect(server: RunningServer) -> None:
    health = httpx.get(f"{server.http_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = httpx.get(f"{server.http_url}/v1/models").json()["data"]
    assert models[0]["id"] == "synthetic"
    assert models[0]["context_length"] == models[0]["max_model_len"] == 32768


def test_an_engine_without_a_tokenizer_says_so(server: RunningServer) -> None:
    answer = post(server, "/tokenize", {"prompt": "hello"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert "synthetic engine, which has no tokenizer of its own" in error["message"]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({}, "none was given"),
        ({"prompt": "a", "content": "b"}, "not prompt and content"),
        ({"prompt": "a", "chat_template": "x"}, "chat_template"),
        ({"content": "a", "add_special_tokens": True}, "add_special_tokens goes with prompt"),
        ({"prompt": "a", "add_special": True}, "add_special goes with content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"prompt": 3}, "$.prompt"),
    ],
)
def test_bad_tokenize_bodies_are_refused_by_name(
    server: RunningServer, body: dict[str, Any], names: str
) -> None:
    answer = post(server, "/tokenize", body)
    assert answer.status_code == 400, answer.text
    assert names in answer.json()["error"]["message"]


@pytest.mark.model
@one_process_only("reads the engine in the server's process")
async def test_tokenize_is_llama_cpps_own_tokenizer(smollm: RunningServer, reference: Any) -> None:
    plain = post(smollm, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    # special-token text is read as the token, as vLLM's and llama-server's /tokenize read it
    assert plain["tokens"] == reference.tokenize(TEXT.encode(), add_bos=False, special=True)
    im_start = reference.tokenize(b"<|im_start|>", add_bos=False, special=True)
    assert len(im_start) == 1 and im_start[0] in plain["tokens"]
    assert plain["count"] == len(plain["tokens"])
    assert plain["max_model_len"] == smollm.engine.info.context_length == 2048
    special = post(smollm, "/tokenize", {"prompt": TEXT}).json()  # vLLM's default: BOS
    assert special["tokens"] == reference.tokenize(TEXT.encode(), add_bos=True, special=True)
    # llama-server's body: content, no BOS unless add_special
    content = post(smollm, "/tokenize", {"content": TEXT}).json()
    assert content["tokens"] == plain["tokens"]


@pytest.mark.model
async def test_a_chat_prompt_counts_what_the_chat_request_reports(smollm: RunningServer) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a sea creature."},
    ]
    counted = post(smollm, "/tokenize", {"messages": messages}).json()
    api = openai.AsyncOpenAI(base_url=f"{smollm.http_url}/v1", api_key="none", max_retries=0)
    reply = await api.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=1)
    assert reply.usage is not None and counted["count"] == reply.usage.prompt_tokens
    text = post(smollm, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    bare = post(smollm, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare.json()["count"] < counted["count"]


@pytest.mark.model
def test_detokenize_inverts_tokenize_with_pieces(smollm: RunningServer) -> None:
    tokens = post(smollm, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    back = post(smollm, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": TEXT, "content": TEXT}
    strs = post(smollm, "/tokenize", {"prompt": "sea otters", "return_token_strs": True}).json()
    assert "".join(strs["token_strs"]) == "sea otters" and len(strs["token_strs"]) == strs["count"]
    pieces = post(smollm, "/tokenize", {"content": "sea otters", "with_pieces": True}).json()
    assert [p["piece"] for p in pieces["tokens"]] == strs["token_strs"]
    assert [p["id"] for p in pieces["tokens"]] == strs["tokens"]


@pytest.mark.model
@one_process_only("reads the engine in the server's process")
def test_a_token_outside_the_vocabulary_is_refused_by_index(smollm: RunningServer) -> None:
    vocab = smollm.engine.tokenizer().vocab_size
    answer = post(smollm, "/detokenize", {"tokens": [1, 2, vocab]})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert f"tokens[2]: {vocab} is not a token of model smollm2-135m" in message
    assert post(smollm, "/detokenize", {"tokens": [-1]}).status_code == 400
    unknown = post(smollm, "/tokenize", {"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.model
@pytest.mark.slow
def test_the_transformers_engine_tokenizes_as_llama_cpp(
    transformers_server: RunningServer, reference: Any
) -> None:
    """Both engines serve the same GGUF: transformers' tokenizer of it gives llama.cpp's
    tokens, and a chat prompt counts the same."""
    plain = post(transformers_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert plain.json()["tokens"] == reference.tokenize(TEXT.encode(), add_bos=False, special=True)
    back = post(transformers_server, "/detokenize", {"tokens": plain.json()["tokens"]}).json()
    assert back["prompt"] == TEXT
    messages = [{"role": "user", "content": "Name a sea creature."}]
    counted = post(transformers_server, "/tokenize", {"messages": messages}).json()
    chat = reference.tokenize(
        b"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        b"Face<|im_end|>\n<|im_start|>user\nName a sea creature.<|im_end|>\n"
        b"<|im_start|>assistant\n",
        add_bos=False,
        special=True,
    )
    assert counted["tokens"] == chat
