"""OpenAI's Responses API (``/v1/responses``), driven by the official ``openai`` package over
real sockets: with the embedded model where the issue asks for it, the synthetic engine where
a test needs an exact reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types import responses as types

from seedance.engines.synthetic import SyntheticEngine
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.test_openai_api import eventually


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


# --------------------------------------------------------------------------- the embedded model


@pytest.mark.model
async def test_a_conversation_goes_on_by_previous_response_id_across_connections(
    smollm: RunningServer,
) -> None:
    first_client, second_client = client(smollm), client(smollm)  # two connection pools
    stream = await first_client.responses.create(
        model="smollm2-135m",
        input="My name is Ada and I live in Lisbon.",
        instructions="Answer in one short sentence.",
        max_output_tokens=24,
        temperature=0,
        stream=True,
    )
    kinds = []
    async for event in stream:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            first = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert first.output_text and first.usage is not None
    second = await second_client.responses.create(
        model="smollm2-135m",
        input="Where do I live?",
        previous_response_id=first.id,
        max_output_tokens=24,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage is not None and first.usage is not None
    # The first exchange is in the second prompt (the instructions are not: they were its own).
    assert second.usage.input_tokens >= first.usage.total_tokens
    await first_client.close()
    await second_client.close()


@pytest.mark.model
async def test_a_background_response_resumes_by_sequence_number_with_every_event_once(
    smollm: RunningServer,
) -> None:
    api = client(smollm)
    stream = await api.responses.create(
        model="smollm2-135m",
        input="Tell me a story about a lighthouse keeper.",
        max_output_tokens=120,
        background=True,
        stream=True,
    )
    seen: list[Any] = []
    async for event in stream:
        seen.append(event)
        if event.sequence_number >= 12:
            break
    await stream.close()  # the connection drops; a background response runs on
    response_id = seen[0].response.id
    rest = await api.responses.retrieve(
        response_id, stream=True, starting_after=seen[-1].sequence_number
    )
    seen += [event async for event in rest]
    numbers = [event.sequence_number for event in seen]
    assert numbers == sorted(set(numbers))  # each once, in order
    kinds = [event.type for event in seen]
    for once in (
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kinds.count(once) == 1, once
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = await api.responses.retrieve(response_id)
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == final.output_text and final.status in ("completed", "incomplete")
    assert seen[-1].response.output_text == text
    # The SDK's own helper replays from the start and skips what it was told it has.
    async with api.responses.stream(response_id=response_id, starting_after=numbers[5]) as helper:
        replayed = [event.sequence_number async for event in helper]
    # (From the log, the tokens it holds come as one delta: the numbers differ, the end not.)
    assert replayed == sorted(set(replayed)) and replayed[0] > numbers[5]
    assert replayed[-1] == numbers[-1]
    await api.close()


# --------------------------------------------------------------------------- exact replies


async def test_a_response_is_stored_retrieved_continued_and_deleted(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([SyntheticEngine(echo=True)])
    api = client(server)
    first = await api.responses.create(model="synthetic", input="hello world")
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "completed" and first.output_text == "hello world"
    assert first.usage is not None and first.usage.output_tokens == 2
    assert first.usage.total_tokens == first.usage.input_tokens + 2
    again = await api.responses.retrieve(first.id)
    assert again.model_dump() == first.model_dump()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "second"}]}]
    second = await api.responses.create(
        model="synthetic", input=items, previous_response_id=first.id, metadata={"k": "v"}
    )
    assert second.output_text == "second" and second.metadata == {"k": "v"}
    assert second.usage is not None and second.usage.input_tokens > first.usage.total_tokens
    assert (await api.responses.delete(first.id)) is None
    with pytest.raises(openai.NotFoundError, match=f"no response {first.id}"):
        await api.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id: no stored response"):
        await api.responses.create(model="synthetic", input="x", previous_response_id=first.id)
    unstored = await api.responses.create(model="synthetic", input="gone", store=False)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)
    await api.close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "x", "colour": "red"}, "unknown field `colour`"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].function.name"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be between 1 and"),
        ({"input": "x", "background": True, "store": False}, "must be stored"),
        ({"input": [{"type": "function_call"}]}, "input[0].call_id: required"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type: 'reasoning'"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
            "input[0].arguments: a JSON object",
        ),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "previous_response_id": "no such"}, "not a response id"),
    ],
)
async def test_bad_requests_get_a_clear_error(
    server: RunningServer, body: dict[str, Any], message: str
) -> None:
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{server.http_url}/v1/responses", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


@one_process_only("reads the server's requests in its process")
async def test_cancel_stops_a_background_response_and_only_that(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([slow_engine(tokens_per_s=50)])
    api = client(server)
    running = await api.responses.create(
        model="synthetic", input="x", background=True, max_output_tokens=1000
    )
    assert running.status in ("queued", "in_progress") and running.background
    await eventually(lambda: server.engine.stats.tokens_generated >= 3)
    cancelled = await api.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.usage is not None
    assert 3 <= cancelled.usage.output_tokens < 1000
    assert (await api.responses.retrieve(running.id)).status == "cancelled"
    # A foreground response stops when its client leaves; it cannot be cancelled by id.
    stream = await api.responses.create(
        model="synthetic", input="z", stream=True, max_output_tokens=500
    )
    async for event in stream:
        if event.type == "response.created":
            with pytest.raises(openai.BadRequestError, match="not a background response"):
                await api.responses.cancel(event.response.id)
            break
    await stream.close()
    await api.close()


@one_process_only("reads the server's requests in its process")
async def test_a_foreground_stream_stops_when_its_client_leaves(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([slow_engine(tokens_per_s=100)])
    api = client(server)
    stream = await api.responses.create(
        model="synthetic", input="x", stream=True, max_output_tokens=1000
    )
    async for event in stream:
        if event.type == "response.output_text.delta":
            break
    await stream.close()
    engine = server.engine
    await eventually(lambda: engine.stats.requests_aborted == 1)
    assert engine.stats.tokens_generated < 1000
    await api.close()


# --------------------------------------------------------------------------- the event reference

#: The events of one text response, in order (OpenAI's streaming reference).
REFERENCE_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]

_EVENT_TYPES: dict[str, type[Any]] = {
    "response.created": types.ResponseCreatedEvent,
    "response.in_progress": types.ResponseInProgressEvent,
    "response.output_item.added": types.ResponseOutputItemAddedEvent,
    "response.content_part.added": types.ResponseContentPartAddedEvent,
    "response.output_text.delta": types.ResponseTextDeltaEvent,
    "response.output_text.done": types.ResponseTextDoneEvent,
    "response.content_part.done": types.ResponseContentPartDoneEvent,
    "response.output_item.done": types.ResponseOutputItemDoneEvent,
    "response.completed": types.ResponseCompletedEvent,
    "response.incomplete": types.ResponseIncompleteEvent,
}

#: Objects inside the events, by the field that holds them.
_NESTED: dict[str, type[Any]] = {
    "response": types.Response,
    "usage": types.ResponseUsage,
    "item": types.ResponseOutputMessage,
    "part": types.ResponseOutputText,
}


def check_fields(value: dict[str, Any], model: type[Any], where: str) -> None:
    """Every field the OpenAI type requires is there, and none it does not know."""
    fields = model.model_fields
    required = {name for name, field in fields.items() if field.is_required()}
    assert required <= value.keys(), f"{where}: missing {sorted(required - value.keys())}"
    assert value.keys() <= fields.keys(), f"{where}: extra {sorted(value.keys() - fields.keys())}"
    for name, nested in _NESTED.items():
        inner = value.get(name)
        if isinstance(inner, dict):
            check_fields(inner, nested, f"{where}.{name}")
    for i, message in enumerate(value.get("output") or []):
        check_fields(message, types.ResponseOutputMessage, f"{where}.output[{i}]")
    for i, part in enumerate(value.get("content") or []):
        check_fields(part, types.ResponseOutputText, f"{where}.content[{i}]")


async def test_the_events_match_openais_reference_field_by_field(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([SyntheticEngine(echo=True)])
    body = {"model": "synthetic", "input": "one two three", "stream": True}
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", f"{server.http_url}/v1/responses", json=body) as answer,
    ):
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in answer.aiter_lines()]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names == [event["type"] for event in events]  # each event: its name, then its data
    order = [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]
    assert order == REFERENCE_ORDER
    for event in events:
        check_fields(event, _EVENT_TYPES[event["type"]], event["type"])
    numbers = [event["sequence_number"] for event in events]
    assert numbers == sorted(set(numbers))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "one two three" == events[-1]["response"]["output"][0]["content"][0]["text"]
    async with httpx.AsyncClient() as http:
        stored = await http.get(f"{server.http_url}/v1/responses/{events[0]['response']['id']}")
    check_fields(stored.json(), types.Response, "GET /v1/responses/{id}")
