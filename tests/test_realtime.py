"""OpenAI's Realtime API (``/v1/realtime``, GA and beta) and the Responses API's WebSocket mode,
driven by the official ``openai`` package over real sockets; the events compared field by field
with the package's own types (OpenAI's published reference)."""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import realtime as ga_types
from openai.types.beta import realtime as beta_types
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosedError

from seedance.config_loader import load_access
from seedance.engines.synthetic import SyntheticEngine
from seedance.tenants.keys import add_key
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.waits import eventually
from tests.test_responses import client
from tests.test_tools import FLAT


def clients(server: RunningServer) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    """A GA client, and a beta one (which needs the ws:// base spelled out)."""
    ws_base = f"ws://127.0.0.1:{server.port}/v1"
    beta = openai.AsyncOpenAI(
        base_url=f"{server.http_url}/v1", websocket_base_url=ws_base, api_key="none"
    )
    return client(server), beta


USER = {"type": "message", "role": "user"}
DELTAS = ("response.output_text.delta", "response.text.delta")


def user(text: str) -> dict[str, Any]:
    return {**USER, "content": [{"type": "input_text", "text": text}]}


async def until_done(connection: Any, on_delta: Callable[[Any], Any] | None = None) -> Any:
    """The events up to ``response.done``; returns that event's response."""
    async for event in connection:
        if event.type in ("response.output_text.delta", "response.text.delta") and on_delta:
            await on_delta(event)
        if event.type == "error":
            raise AssertionError(event.error)
        if event.type == "response.done":
            return event.response
    raise AssertionError("the connection ended before response.done")


# --------------------------------------------------------------------------- the embedded model


@pytest.mark.model
@pytest.mark.parametrize("flavour", ["ga", "beta"])
async def test_a_text_session_with_instructions_two_turns_and_a_cancel(
    smollm: RunningServer, flavour: str
) -> None:
    ga, beta = clients(smollm)
    api = ga if flavour == "ga" else beta
    manager = (
        ga.realtime.connect(model="smollm2-135m")
        if flavour == "ga"
        else beta.beta.realtime.connect(model="smollm2-135m")
    )
    async with manager as connection:
        session_fields: dict[str, Any] = {"instructions": "You are terse. Answer in one line."}
        if flavour == "ga":
            session_fields |= {"type": "realtime", "output_modalities": ["text"]}
            session_fields["max_output_tokens"] = 40
        else:
            session_fields |= {"modalities": ["text"], "max_response_output_tokens": 40}
        await connection.session.update(session=session_fields)  # type: ignore[arg-type]
        await connection.conversation.item.create(item=user("My name is Ada."))  # type: ignore[arg-type]
        await connection.response.create()
        first = await until_done(connection)
        assert first.status in ("completed", "incomplete")
        assert first.output[0].content[0].text
        await connection.conversation.item.create(item=user("What is my name?"))  # type: ignore[arg-type]
        await connection.response.create()
        second = await until_done(connection)
        assert second.usage.input_tokens > first.usage.total_tokens  # the first turn is in it
        # A cancel mid-response.
        await connection.conversation.item.create(item=user("Write a long poem about the sea."))  # type: ignore[arg-type]
        limit = "max_output_tokens" if flavour == "ga" else "max_response_output_tokens"
        await connection.response.create(response={limit: 400})  # type: ignore[arg-type]
        deltas = 0

        async def cancel_at_first(event: Any) -> None:
            nonlocal deltas
            deltas += 1
            if deltas == 1:
                await connection.response.cancel()

        cancelled = await until_done(connection, cancel_at_first)
        assert cancelled.status == "cancelled"
        assert cancelled.status_details.reason == "client_cancelled"
        assert 1 <= cancelled.usage.output_tokens < 400
    await api.close()


# --------------------------------------------------------------------------- the reference

GA_ORDER = [
    "session.created",
    "session.updated",
    "conversation.item.added",
    "conversation.item.done",
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]
BETA_ORDER = [
    "session.created",
    "session.updated",
    "conversation.item.created",
    "response.created",
    "response.output_item.added",
    "conversation.item.created",
    "response.content_part.added",
    "response.text.delta",
    "response.text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.done",
]


def event_types(union: Any) -> dict[str, type[Any]]:
    """The package's server event classes by their ``type``."""
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    found = {}
    for cls in typing.get_args(union):
        (literal,) = typing.get_args(cls.model_fields["type"].annotation)
        found[literal] = cls
    return found


def check(value: dict[str, Any], model: type[Any], where: str, beta: bool) -> None:
    """Every field the type requires is there, none it does not know; nested objects too."""
    fields = model.model_fields
    required = {name for name, field in fields.items() if field.is_required()}
    assert required <= value.keys(), f"{where}: missing {sorted(required - value.keys())}"
    assert value.keys() <= fields.keys(), f"{where}: extra {sorted(value.keys() - fields.keys())}"
    types = beta_types if beta else ga_types
    nested: dict[str, type[Any]] = {
        "session": beta_types.Session if beta else ga_types.RealtimeSessionCreateRequest,
        "response": types.RealtimeResponse,
        "usage": beta_types.RealtimeResponseUsage if beta else ga_types.RealtimeResponseUsage,
    }
    for name, inner_model in nested.items():
        inner = value.get(name)
        if isinstance(inner, dict):
            check(inner, inner_model, f"{where}.{name}", beta)
    items = [value["item"]] if isinstance(value.get("item"), dict) else []
    if isinstance(value.get("output"), list):  # a response's (a call's output is text)
        items += value["output"]
    for item in items:
        if beta:
            item_model: type[Any] = beta_types.ConversationItem
        elif item["type"] == "function_call":
            item_model = ga_types.RealtimeConversationItemFunctionCall
        elif item["type"] == "function_call_output":
            item_model = ga_types.RealtimeConversationItemFunctionCallOutput
        elif item["role"] == "assistant":
            item_model = ga_types.RealtimeConversationItemAssistantMessage
        else:
            item_model = ga_types.RealtimeConversationItemUserMessage
        check(item, item_model, f"{where}.item", beta)
    for name in ("part", "error"):
        if isinstance(value.get(name), dict):
            check(value[name], fields[name].annotation, f"{where}.{name}", beta)


@pytest.mark.parametrize("flavour", ["ga", "beta"])
async def test_the_events_match_openais_reference_field_by_field(
    make_server: Callable[..., RunningServer], flavour: str
) -> None:
    server = make_server([SyntheticEngine(echo=True)])
    beta = flavour == "beta"
    headers = {"Authorization": "Bearer none"}
    if beta:
        headers["OpenAI-Beta"] = "realtime=v1"
        session = {"modalities": ["text"], "instructions": "x", "temperature": 0.8}
    else:
        session = {"type": "realtime", "output_modalities": ["text"], "instructions": "x"}
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=synthetic"
    events = []
    async with ws_connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": user("one two")}))
        await ws.send(json.dumps({"type": "response.create"}))
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(await ws.recv()))
        await ws.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": "", "event_id": "e1"})
        )
        error = json.loads(await ws.recv())
    known = event_types(beta_types.RealtimeServerEvent if beta else ga_types.RealtimeServerEvent)
    names = [event["type"] for event in events]
    order = [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]
    assert order == (BETA_ORDER if beta else GA_ORDER)
    for event in [*events, error]:
        check(event, known[event["type"]], event["type"], beta)
    ids = [event["event_id"] for event in events]
    assert len(set(ids)) == len(ids)
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "one two"
    delta = "response.text.delta" if beta else "response.output_text.delta"
    assert "".join(e["delta"] for e in events if e["type"] == delta) == "one two"
    assert error["error"]["event_id"] == "e1" and "not supported" in error["error"]["message"]


# --------------------------------------------------------------------------- tools

TOOLS_ORDER = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


@pytest.mark.model
@pytest.mark.parametrize("flavour", ["ga", "beta"])
async def test_the_tool_loop_on_realtime(smollm: RunningServer, flavour: str) -> None:
    """Session tools; the reply's call as a function_call item with its arguments streamed;
    the result as a function_call_output item; then the answer. Every event checked against
    the package's types."""
    beta = flavour == "beta"
    headers = {"Authorization": "Bearer none"}
    session: dict[str, Any] = {"tools": FLAT, "tool_choice": "required", "temperature": 0.6}
    if beta:
        headers["OpenAI-Beta"] = "realtime=v1"
        session["modalities"] = ["text"]
    else:
        session |= {"type": "realtime", "output_modalities": ["text"]}
        del session["temperature"]
    url = f"ws://127.0.0.1:{smollm.port}/v1/realtime?model=smollm2-135m"
    known = event_types(beta_types.RealtimeServerEvent if beta else ga_types.RealtimeServerEvent)

    async def until_done(ws: Any) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(await ws.recv()))
            assert events[-1]["type"] != "error", events[-1]
            check(events[-1], known[events[-1]["type"]], events[-1]["type"], beta)
        return events

    async with ws_connect(url, additional_headers=headers) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        updated = json.loads(await ws.recv())
        assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather", "get_time"]
        item = user("What is the weather in Paris?")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        # One call: sampled freely, the model sometimes adds a second, which is valid but
        # not the event sequence checked here.
        forced = {"type": "function", "name": "get_weather"}
        response = {"tool_choice": forced, "parallel_tool_calls": False}
        await ws.send(json.dumps({"type": "response.create", "response": response}))
        events = [e for e in await until_done(ws) if not e["type"].startswith("conversation.item.")]
        names = [e["type"] for e in events]
        order = [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]
        assert order == [name for name in TOOLS_ORDER if not name.startswith("conversation.")]
        (call,) = events[-1]["response"]["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert call["status"] == "completed" and call["call_id"].startswith("call_")
        deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
        assert "".join(e["delta"] for e in deltas) == call["arguments"]
        assert all(e["call_id"] == call["call_id"] for e in deltas)
        jsonschema.validate(json.loads(call["arguments"]), FLAT[0]["parameters"])
        result = {
            "type": "function_call_output",
            "call_id": call["call_id"],
            "output": '{"temperature": 18}',
        }
        await ws.send(json.dumps({"type": "conversation.item.create", "item": result}))
        await ws.send(json.dumps({"type": "response.create", "response": {"tool_choice": "none"}}))
        answer = (await until_done(ws))[-1]["response"]
        assert answer["status"] in ("completed", "incomplete")
        assert (
            answer["output"][0]["type"] == "message" and answer["output"][0]["content"][0]["text"]
        )
        # The call and its result are in the conversation: the answer's prompt holds both (the
        # tools' description does not: tool_choice none).
        called = events[-1]["response"]["usage"]
        assert answer["usage"]["input_tokens"] > called["output_tokens"] + 10


# --------------------------------------------------------------------------- refusals


async def test_every_refusal_is_an_error_event_and_the_session_goes_on(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([slow_engine(tokens_per_s=50)])
    ga, _ = clients(server)
    async with ga.realtime.connect(model="synthetic") as connection:
        async for created in connection:
            assert created.type == "session.created"
            break

        async def refused(event: dict[str, Any]) -> str:
            await connection.send(event)  # type: ignore[arg-type]
            async for answer in connection:
                assert answer.type == "error", answer
                return str(answer.error.message)
            raise AssertionError("closed")

        assert "audio is not supported" in await refused(
            {
                "type": "session.update",
                "session": {"type": "realtime", "output_modalities": ["audio"]},
            }
        )
        assert "no response in progress" in await refused({"type": "response.cancel"})
        assert "conversation is empty" in await refused({"type": "response.create"})
        assert "unknown client event" in await refused({"type": "response.steer"})
        audio_item = {**USER, "content": [{"type": "input_audio", "audio": ""}]}
        assert "'input_audio' is not supported (text only" in await refused(
            {"type": "conversation.item.create", "item": audio_item}
        )
        await connection.conversation.item.create(item=user("go"))  # type: ignore[arg-type]
        async for event in connection:
            if event.type == "conversation.item.done":
                break
        await connection.response.create(response={"max_output_tokens": 200})
        async for event in connection:
            if event.type == "response.output_text.delta":
                break
        assert "in progress" in await refused({"type": "response.create"})
        await connection.response.cancel()
        assert (await until_done(connection)).status == "cancelled"
    model_error = None
    async with ga.realtime.connect(model="nope") as connection:
        async for event in connection:
            model_error = event
            break
    assert model_error is not None and model_error.type == "error"
    assert model_error.error.code == "model_not_found"
    await ga.close()


async def test_browsers_authenticate_by_subprotocol(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    path = tmp_path / "seedance.toml"
    key = add_key(path, "acme").key
    server = make_server(config_file=str(path), access=load_access(path))
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=synthetic"
    offered = ["realtime", f"openai-insecure-api-key.{key}", "openai-beta.realtime-v1"]
    async with ws_connect(url, subprotocols=offered) as ws:  # type: ignore[arg-type]
        assert ws.subprotocol == "realtime"
        created = json.loads(await ws.recv())
    assert created["type"] == "session.created" and "modalities" in created["session"]  # beta
    async with ws_connect(url, subprotocols=["realtime", "openai-insecure-api-key.sk-bad"]) as ws:  # type: ignore[list-item]
        refused = json.loads(await ws.recv())
        assert refused["type"] == "error" and refused["error"]["code"] == "unauthorized"


@one_process_only("reads the server's connections in its process")
async def test_a_revoked_key_shuts_its_realtime_and_responses_sockets(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """Like a /v2/infer connection's: the response under way is cancelled, an error event
    (unauthorized) goes out, the socket closes 4401; another tenant's socket stays open."""
    path = tmp_path / "seedance.toml"
    admin = add_key(path, "ops", role="admin").key
    acme, other = add_key(path, "acme"), add_key(path, "globex").key
    server = make_server(
        [slow_engine(tokens_per_s=20)], config_file=str(path), access=load_access(path)
    )
    base = f"ws://127.0.0.1:{server.port}/v1"

    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with (
        ws_connect(f"{base}/realtime?model=synthetic", additional_headers=bearer(acme.key)) as rt,
        ws_connect(f"{base}/responses", additional_headers=bearer(acme.key)) as responses,
        ws_connect(f"{base}/responses", additional_headers=bearer(other)) as bystander,
    ):
        assert json.loads(await rt.recv())["type"] == "session.created"
        await rt.send(json.dumps({"type": "conversation.item.create", "item": user("go")}))
        await rt.send(json.dumps({"type": "response.create"}))
        while json.loads(await rt.recv())["type"] not in DELTAS:  # a response under way
            pass
        await responses.send(
            json.dumps({"type": "response.create", "input": "long", "model": "synthetic"})
        )
        while json.loads(await responses.recv())["type"] != "response.output_text.delta":
            pass
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            revoked = await http.post(f"/admin/keys/{acme.id}/revoke", headers=bearer(admin))
            assert revoked.status_code == 200
        for ws in (rt, responses):
            events = []
            with pytest.raises(ConnectionClosedError):  # to the close
                while True:
                    events.append(json.loads(await ws.recv()))
            errors = [e for e in events if e["type"] == "error"]
            assert errors and errors[-1]["error"]["code"] == "unauthorized", events
            assert "revoked" in errors[-1]["error"]["message"]
            assert ws.close_code == 4401
        await eventually(
            lambda: (
                not server.state.generations
                and [
                    s.principal.name
                    for s in server.state.peers
                    if s.kind == "realtime" or s.kind == "responses"
                ]
                == ["globex"]
            ),
            5,
            "the responses cancelled and the sockets gone",
        )
        await bystander.send(
            json.dumps({"type": "response.create", "input": "hi", "model": "synthetic"})
        )
        assert json.loads(await bystander.recv())["type"] == "response.created"


# --------------------------------------------------------------------------- Responses over WS


async def test_the_responses_websocket_mode_runs_one_response_at_a_time(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server([SyntheticEngine(echo=True, tokens_per_s=200)])
    ga, _ = clients(server)
    async with ga.responses.connect() as connection:
        await connection.response.create(model="synthetic", input="hello socket")
        events = []
        async for event in connection:
            events.append(event)
            if event.type == "response.completed":
                break
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        first = events[-1].response
        assert first.output_text == "hello socket"
        await connection.response.create(
            model="synthetic", input="again", previous_response_id=first.id, stream_id="lane"
        )
        await connection.response.create(model="synthetic", input="too soon")
        seen = []
        async for event in connection:
            seen.append(event)
            if event.type == "response.completed":
                break
    error = next(e for e in seen if e.type == "error")
    assert "one at a time" in error.error.message and error.status == 400
    completed = seen[-1]
    assert completed.stream_id == "lane" and completed.response.output_text == "again"
    assert completed.response.usage.input_tokens > first.usage.total_tokens
    await ga.close()
