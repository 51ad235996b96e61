"""Replies bound to a JSON Schema: the official ``openai`` package (``response_format``,
``chat.completions.parse``, the Responses API's ``text.format``) and the ``schema`` field of
``/v2/infer``, against the embedded SmolLM2 on llama.cpp over real sockets; every reply parsed
and validated against its schema. Bad schemas get a 400 naming the field."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from seedance.client import connect
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.schemas import closed, output_schema
from tests.support.servers import RunningServer, server_config
from tests.support.waits import eventually

#: The benchmark's schema (benchmarks/structured_suite.py): 12 fields, nested, bounded.
RISK = json.loads((Path(__file__).parents[1] / "benchmarks" / "risk_schema.json").read_text())


class Person(pydantic.BaseModel):
    """Every field bounded: a sampled reply ends well within ``max_tokens``."""

    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    hobbies: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("structured") / "audit.log"


@pytest.fixture(scope="module")
def smollm_audited(audit_log: Path) -> Iterator[RunningServer]:
    """The embedded model on llama.cpp (two sequences), with an audit log."""
    config = server_config(engine="llamacpp", parallel=2, n_ctx=4096, audit_file=str(audit_log))
    server = RunningServer(config, None).start()
    yield server
    server.stop()


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


async def model_of(api: openai.AsyncOpenAI) -> str:
    return (await api.models.list()).data[0].id


pytestmark = pytest.mark.model


async def test_parse_with_a_pydantic_model(smollm_audited: RunningServer) -> None:
    api = client(smollm_audited)
    reply = await api.chat.completions.parse(
        model=await model_of(api),
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        max_tokens=120,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)  # the SDK parsed and validated it


async def test_two_streams_at_once_each_valid_for_the_nested_schema(
    smollm_audited: RunningServer, audit_log: Path
) -> None:
    """Two requests decoded in one batch: their masks are computed together."""
    api = client(smollm_audited)
    model = await model_of(api)

    async def one(prompt: str, seed: int) -> tuple[str, str | None]:
        stream = await api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "risk", "schema": RISK, "strict": True},
            },
            max_tokens=300,
            temperature=0.8,
            seed=seed,
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    replies = await asyncio.gather(
        one("Describe a risky card payment as JSON.", 1),
        one("Assess this wire transfer of 9,000 EUR to a new payee.", 2),
    )
    for text, finish in replies:
        assert finish == "stop"
        document = json.loads(text)
        jsonschema.validate(document, RISK)
        assert list(document) == list(RISK["properties"])  # in the schema's order
    text = output_schema(closed(RISK), "schema").text  # strict: as the engine got it
    digest = hashlib.sha256(text.encode()).hexdigest()
    await eventually(lambda: digest in schema_hashes(audit_log), what="the schema's hash")


def records_of(audit_log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in audit_log.read_text().splitlines()]


def schema_hashes(audit_log: Path) -> set[str]:
    """The ``schema_sha256`` of the request records written so far."""
    return {r["schema_sha256"] for r in records_of(audit_log) if "schema_sha256" in r}


async def test_json_object_and_the_responses_api(smollm_audited: RunningServer) -> None:
    api = client(smollm_audited)
    model = await model_of(api)
    reply = await api.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Return a JSON object with the name and age of a person."}
        ],
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)

    schema = Person.model_json_schema()
    response = await api.responses.create(
        model=model,
        input="Invent a person.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
        max_output_tokens=120,
    )
    assert response.status == "completed"
    person = json.loads(response.output_text)
    jsonschema.validate(person, schema)
    assert set(person) <= set(schema["properties"])  # strict: no property of its own
    assert response.text is not None and response.text.format.type == "json_schema"


async def test_the_schema_field_of_v2_infer(smollm_audited: RunningServer) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,  # else a small model goes on with properties of its own
    }
    async with connect(smollm_audited.url) as session:
        done = await session.complete("What is the weather in Paris?", schema=schema, max_tokens=60)
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text or ""), schema)
        with pytest.raises(
            InvalidRequest, match=r"schema: this schema cannot be enforced.*uniqueItems"
        ):
            await session.complete("x", schema={"type": "array", "uniqueItems": True})
        with pytest.raises(InvalidRequest, match=r"schema\['type'\]: not a valid JSON Schema"):
            await session.complete("x", schema={"type": "objekt"})


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                }
            },
            "response_format.json_schema.schema",
            "response_format.json_schema.schema['type']: not a valid JSON Schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required for json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": []},
                }
            },
            "response_format.json_schema.schema",
            "must be a JSON Schema (an object)",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml' is not supported"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {}}},
                }
            },
            "response_format",
            'Unimplemented keys: ["not"]',
        ),
    ],
)
def test_bad_schemas_get_a_400_naming_the_field(
    smollm_audited: RunningServer, body: dict[str, Any], param: str, words: str
) -> None:
    answer = httpx.post(
        f"{smollm_audited.http_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], **body},
        timeout=30,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_an_engine_that_cannot_bind_replies_says_so(server: RunningServer) -> None:
    answer = httpx.post(
        f"{server.http_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
        },
        timeout=30,
    )
    assert answer.status_code == 400
    assert (
        "synthetic engine of model synthetic cannot bind its replies to a schema"
        in (answer.json()["error"]["message"])
    )


def test_strict_closes_objects_that_say_nothing_of_other_properties() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "object", "properties": {}, "additionalProperties": True},
            "d": {"type": "array", "items": {"type": "object", "properties": {"e": {}}}},
        },
        "$defs": {"f": {"type": "object", "properties": {"g": {"const": {"properties": 1}}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True
    assert out["properties"]["d"]["items"]["additionalProperties"] is False
    assert out["$defs"]["f"]["additionalProperties"] is False
    assert out["$defs"]["f"]["properties"]["g"] == {"const": {"properties": 1}}  # data, untouched


async def test_the_audit_counts_tool_calls(smollm_audited: RunningServer, audit_log: Path) -> None:
    from tests.test_tools import QUESTION, WEATHER

    api = client(smollm_audited)
    reply = await api.chat.completions.create(
        model=await model_of(api),
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    await eventually(lambda: reply.id in audit_log.read_text(), what="the request's record")
    mine = [r for r in records_of(audit_log) if r.get("request_id") == reply.id]
    assert mine[-1]["tool_calls"] == 1
