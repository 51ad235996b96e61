"""Tool calling on Chat Completions with the generic format, against the embedded SmolLM2 on
llama.cpp, driven by the official ``openai`` package over real sockets: calls that parse, with
arguments valid for the tool's schema, streamed as OpenAI streams them; a whole tool loop
(call, result, answer); bad tools refused by name. The format's own pieces (the reader of
streamed calls, the grammar) are checked without a model at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from seedance.client import connect
from seedance.engines.template import ChatTemplate
from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import ChatMessage, ToolCallTurn
from seedance.protocol.responses import CallEvents
from seedance.protocol.tools import BadToolCall, CallReader, parse_calls, parse_tools
from tests.support.servers import RunningServer, server_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
        "strict": True,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
#: What every call of the model here asks: the question and both tools.
ASK: dict[str, Any] = {"model": "smollm2-135m", "messages": QUESTION, "tools": [WEATHER, TIME]}


def client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


def schema_of(name: str) -> dict[str, Any]:
    tool = WEATHER if name == "get_weather" else TIME
    return tool["function"]["parameters"]  # type: ignore[index, return-value]


@pytest.mark.model
async def test_a_required_call_parses_and_the_loop_ends_in_an_answer(smollm: RunningServer) -> None:
    api = client(smollm)
    reply = await api.chat.completions.create(
        **ASK,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    async with httpx.AsyncClient() as http:  # counted in the metrics
        metrics = (await http.get(f"{smollm.http_url}/metrics")).text
    lines = metrics.splitlines()
    counted = [line for line in lines if line.startswith("seedance_tool_calls_total")]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1

    # The loop: the call and its result go back; the model answers in text.
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    answer = await api.chat.completions.create(
        model="smollm2-135m",
        messages=history,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.model
async def test_the_tool_loop_on_v2_infer(smollm: RunningServer) -> None:
    """/v2/infer: the call in the ``done`` frame, the result in a ``tool`` message of the next
    request, the answer in text; the session keeps the call as a call."""
    async with connect(smollm.url, session_id="tools-v2") as session:
        called = await session.complete(
            "What is the weather in Paris?",
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=80,
        )
        assert called.finish_reason == "stop" and called.tool_calls
        (call,) = called.tool_calls
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
        result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}
        answer = await session.complete(
            messages=[result],
            tools=[WEATHER, TIME],
            tool_choice="none",
            temperature=0,
            max_tokens=40,
        )
        assert answer.text and answer.tool_calls is None
        with pytest.raises(InvalidRequest, match="ended inside a tool call"):
            await session.complete(
                "And in Oslo?", tools=[WEATHER], tool_choice="required", max_tokens=4
            )
        with pytest.raises(InvalidRequest, match=r"tools\[0\].function.name"):
            await session.complete("x", tools=[{"type": "function", "function": {}}])


@pytest.mark.model
async def test_a_named_call_streams_as_openai_streams_it(smollm: RunningServer) -> None:
    api = client(smollm)
    stream = await api.chat.completions.create(
        **ASK,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.7,
        seed=5,
        max_tokens=80,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    pieces = 0
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # a call, not text
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            if part.id:
                entry["id"] = part.id
            if part.function and part.function.name:
                entry["name"] = part.function.name
            if part.function and part.function.arguments:
                entry["arguments"] += part.function.arguments
                pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls and pieces > 1  # the arguments came in parts
    for entry in calls.values():
        assert entry["name"] == "get_time" and entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), schema_of("get_time"))


@pytest.mark.model
async def test_auto_gives_text_or_a_valid_call(smollm: RunningServer) -> None:
    api = client(smollm)
    for content in ("Hello! How are you?", "What is the weather in Paris? Use the tool."):
        reply = await api.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": content}],
            tools=[WEATHER],  # type: ignore[list-item]
            temperature=0,
            max_tokens=60,
        )
        message = reply.choices[0].message
        if reply.choices[0].finish_reason == "tool_calls":
            for call in message.tool_calls or ():
                jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))
        else:
            assert message.content and not message.content.startswith("<")


@pytest.mark.model
async def test_a_call_cut_by_max_tokens_is_an_error_not_text(smollm: RunningServer) -> None:
    api = client(smollm)
    with pytest.raises(openai.BadRequestError, match="ended inside a tool call"):
        await api.chat.completions.create(
            model="smollm2-135m",
            messages=QUESTION,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=5,
        )


# --------------------------------------------------------------------------- the Responses API

#: The tools as the Responses API takes them (flat, not nested in ``function``).
FLAT = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]  # type: ignore[dict-item]


@pytest.mark.model
async def test_the_tool_loop_on_the_responses_api(smollm: RunningServer) -> None:
    """A call as a ``function_call`` output item; its result as a ``function_call_output``
    input item, continuing the stored conversation, or stateless with the call given back."""
    api = client(smollm)
    called = await api.responses.create(
        model="smollm2-135m",
        input="What is the weather in Paris?",
        tools=FLAT,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    )
    assert called.status == "completed" and len(called.output) == 1
    (call,) = called.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    assert call.id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
    assert [tool.name for tool in called.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert called.tool_choice == "required" and called.parallel_tool_calls is False
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}
    answer = await api.responses.create(
        model="smollm2-135m",
        previous_response_id=called.id,
        input=[result],  # type: ignore[list-item]
        tools=FLAT,  # type: ignore[arg-type]
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert answer.output_text and answer.output[0].type == "message"
    # Stateless: the call given back as the SDK returned it, then its result.
    stateless = await api.responses.create(
        model="smollm2-135m",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *called.output,
            result,
        ],  # type: ignore[list-item]
        tools=FLAT,  # type: ignore[arg-type]
        tool_choice="none",
        store=False,
        temperature=0,
        max_output_tokens=40,
    )
    # The same conversation, so the same prompt: the same greedy answer.
    assert stateless.output_text == answer.output_text
    assert stateless.usage is not None and answer.usage is not None
    assert stateless.usage.input_tokens == answer.usage.input_tokens
    await api.close()


@pytest.mark.model
async def test_a_call_streams_as_the_responses_api_streams_it_and_resumes(
    smollm: RunningServer,
) -> None:
    api = client(smollm)
    stream = await api.responses.create(
        model="smollm2-135m",
        input="What time is it in Oslo?",
        tools=FLAT,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_time"},
        temperature=0.7,
        max_output_tokens=60,
        background=True,
        stream=True,
    )
    seen: list[Any] = []
    async for event in stream:
        seen.append(event)
        if event.type == "response.function_call_arguments.delta" and len(seen) > 5:
            break  # the connection drops inside the arguments
    await stream.close()
    response_id = seen[0].response.id
    rest = await api.responses.retrieve(
        response_id, stream=True, starting_after=seen[-1].sequence_number
    )
    seen += [event async for event in rest]
    numbers = [event.sequence_number for event in seen]
    assert numbers == sorted(set(numbers))  # each once, in order
    kinds = [event.type for i, event in enumerate(seen) if i == 0 or seen[i - 1].type != event.type]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = seen[2].item, seen[-2].item
    assert added.type == "function_call" and added.name == "get_time" and added.arguments == ""
    arguments = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
    assert arguments == seen[-3].arguments == done.arguments
    jsonschema.validate(json.loads(arguments), schema_of("get_time"))
    final = seen[-1].response
    assert final.output[0].arguments == arguments and final.output[0].call_id == added.call_id
    await api.close()


def test_call_events_are_numbered_by_where_they_end_and_resume_mid_arguments() -> None:
    tools = parse_tools([WEATHER, TIME], "required", True)
    assert tools is not None
    text = (
        '<tool_call>{"name":"get_time","arguments":{"city":"Oslo"}}</tool_call>'
        '<tool_call>{"name":"get_time","arguments":{"city":"Rome"}}</tool_call>'
    )
    live = CallEvents("resp_1", tools, -1)
    events = [event for i in range(0, len(text), 3) for event in live.feed(text[i : i + 3])]
    numbers = [event["sequence_number"] for event in events]
    assert numbers == sorted(set(numbers)) and numbers[0] > 1
    # Coming back after any event, read from the whole text at once: the rest, each once.
    for k, event in enumerate(events):
        again = CallEvents("resp_1", tools, event["sequence_number"]).feed(text)
        assert [e["type"] for e in again] == [e["type"] for e in _merged(events[k + 1 :])]
        for index in (0, 1):
            had = "".join(
                e.get("delta", "") for e in events[: k + 1] if e.get("output_index") == index
            )
            got = "".join(e.get("delta", "") for e in again if e.get("output_index") == index)
            assert json.loads(had + got) == {"city": ("Oslo", "Rome")[index]}


def _merged(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events with each run of one call's argument deltas as one (as a whole text gives it)."""
    out: list[dict[str, Any]] = []
    for event in events:
        last = out[-1] if out else None
        if (
            last is not None
            and event["type"] == last["type"] == "response.function_call_arguments.delta"
            and event["output_index"] == last["output_index"]
        ):
            continue
        out.append(event)
    return out


@pytest.mark.parametrize(
    ("tools", "choice", "words"),
    [
        ([{"type": "function", "function": {"parameters": {}}}], None, "tools[0].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([WEATHER, WEATHER], None, "same name"),
        (
            [{"type": "function", "function": {"name": "x", "parameters": {"type": 3}}}],
            None,
            "tools[0].function.parameters['type']: not a valid JSON Schema",
        ),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "no tool is named"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "no tools to call"),
    ],
)
async def test_bad_tools_get_a_400_naming_the_field(
    server: RunningServer, tools: Any, choice: Any, words: str
) -> None:
    api = client(server)
    fields: dict[str, Any] = {"tools": tools} if tools is not None else {}
    if choice is not None:
        fields["tool_choice"] = choice
    with pytest.raises(openai.BadRequestError) as bad:
        await api.chat.completions.create(model="synthetic", messages=QUESTION, **fields)  # type: ignore[arg-type]
    assert words in bad.value.message


def test_the_reader_streams_names_then_arguments_in_parts() -> None:
    tools = parse_tools([WEATHER, TIME], "required", True)
    assert tools is not None
    text = (
        '<tool_call>{"name":"get_weather","arguments":{"city":"P\\"a}ris","unit":"celsius"}}'
        '</tool_call><tool_call>{"name":"get_time","arguments":{"city":"Oslo"}}</tool_call>'
    )
    reader = CallReader(tools, "r-1")
    events = [event for i in range(0, len(text), 4) for event in reader.feed(text[i : i + 4])]
    names = [(e.index, e.name, e.id) for e in events if e.name]
    assert [(i, n) for i, n, _ in names] == [(0, "get_weather"), (1, "get_time")]
    arguments: dict[int, str] = {}
    for event in events:
        arguments[event.index] = arguments.get(event.index, "") + event.arguments
    assert json.loads(arguments[0]) == {"city": 'P"a}ris', "unit": "celsius"}
    assert json.loads(arguments[1]) == {"city": "Oslo"}
    calls = parse_calls(reader.text, tools, "r-1")
    assert calls is not None and [c.id for c in calls] == [i for _, _, i in names]  # stable ids
    for cut in (5, 40):
        with pytest.raises(BadToolCall, match="ended inside a tool call"):
            parse_calls(text[:cut], tools)
    with pytest.raises(BadToolCall, match="not valid"):
        parse_calls('<tool_call>{"name":"get_time","arguments":{}}</tool_call>', tools)
    with pytest.raises(BadToolCall, match="'required' asked for a tool call and the reply is text"):
        parse_calls("Plain text.", tools)
    auto = parse_tools([WEATHER, TIME], "auto", True)
    assert auto is not None and parse_calls("Plain text.", auto) is None


def test_tool_choice_none_means_no_tools() -> None:
    assert parse_tools([WEATHER], "none", None) is None
    with pytest.raises(InvalidRequest, match="tools: must be a list"):
        parse_tools({"a": 1}, None, None)


# --------------------------------------------------------------------------- a template's own tools

HERMES = Path(__file__).parents[1] / "benchmarks" / "hermes_tools.jinja"


@pytest.fixture(scope="module")
def hermes() -> Iterator[RunningServer]:
    """The embedded model with a chat template that writes tools itself (the Hermes way)."""
    config = server_config(engine="llamacpp", parallel=2, n_ctx=4096, chat_template=str(HERMES))
    server = RunningServer(config, None).start()
    yield server
    server.stop()


def test_a_template_that_writes_tools_is_given_them() -> None:
    """Rendered with the template's own tools section and its own way of writing calls and
    results; ChatML (no tools) gets the generic format instead."""
    template = ChatTemplate(HERMES.read_text(), bos_token="", eos_token="")
    assert template.tools and not ChatTemplate(None, bos_token="", eos_token="").tools
    tools = parse_tools([WEATHER, TIME], "auto", True)
    assert tools is not None
    call = ToolCallTurn("call_1", "get_weather", '{"city":"Paris","unit":"celsius"}')
    history = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", '{"temp": 18}', tool_call_id="call_1"),
    ]
    text = template.render(history, add_generation_prompt=True, tools=tools)
    assert "# Tools" in text and '"name": "get_time"' in text
    assert "You can call functions" not in text  # not the generic description
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in text
    # A call written the template's way (newlines inside the tags) reads as a call.
    reply = '<tool_call>\n{"name":"get_time","arguments":{"city":"Oslo"}}\n</tool_call>'
    (parsed,) = parse_calls(reply, tools) or ()
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_time", {"city": "Oslo"})
    reader = CallReader(tools)
    events = [event for ch in reply for event in reader.feed(ch)]
    assert [e.name for e in events if e.name] == ["get_time"]
    assert json.loads("".join(e.arguments for e in events)) == {"city": "Oslo"}
    assert any(e.done for e in events)


@pytest.mark.model
async def test_a_template_of_its_own_calls_tools_in_its_own_format(hermes: RunningServer) -> None:
    api = client(hermes)
    reply = await api.chat.completions.create(
        **ASK, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls or ()
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    # The prompt is the template's own rendering of the tools (counted exactly).
    tools = parse_tools([WEATHER, TIME], "required", False)
    template = ChatTemplate(HERMES.read_text(), bos_token="", eos_token="")
    text = template.render(
        [ChatMessage("user", QUESTION[0]["content"])], add_generation_prompt=True, tools=tools
    )
    async with httpx.AsyncClient() as http:
        counted = await http.post(f"{hermes.http_url}/tokenize", json={"prompt": text})
    assert reply.usage is not None and reply.usage.prompt_tokens == counted.json()["count"]
    # The loop: the call and its result rendered the template's way; the answer in text.
    answer = await api.chat.completions.create(
        model="smollm2-135m",
        messages=[
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
        ],  # type: ignore[list-item]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    assert answer.choices[0].message.content


# ---------------------------------------------------------------- other templates' formats

TEMPLATES = Path(__file__).parent / "templates"
#: Each format, a template that writes calls in it, and a reply of two calls written its way.
FORMAT_CASES = {
    "llama3_json": (
        TEMPLATES / "llama3_json_tools.jinja",
        '{"name": "get_weather", "parameters": {"city": "P\\"a}ris", "unit": "celsius"}}; '
        '{"name":"get_time","parameters":{"city":"Oslo"}}',
    ),
    "mistral": (
        TEMPLATES / "mistral_tools.jinja",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P\\"a}ris", '
        '"unit": "celsius"}}, {"name":"get_time","arguments":{"city":"Oslo"}}]',
    ),
}


@pytest.mark.parametrize("name", sorted(FORMAT_CASES))
def test_a_template_is_probed_for_its_call_format_and_its_replies_read_that_way(name: str) -> None:
    """The template's way of writing a call is learnt from how it writes one in the history;
    the history is rendered that way; a reply in that format is read as calls (streamed in
    pieces and whole), and a reply cut inside them is an error."""
    path, reply = FORMAT_CASES[name]
    template = ChatTemplate(path.read_text(), bos_token="", eos_token="")
    assert template.tools and template.call_format.name == name
    tools = parse_tools([WEATHER, TIME], "auto", True, name)
    assert tools is not None
    call = ToolCallTurn("call_0123456789", "get_time", '{"city":"Oslo"}')
    history = [
        ChatMessage("user", "Time in Oslo?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "09:30", tool_call_id=call.id),
    ]
    text = template.render(history, add_generation_prompt=True, tools=tools)
    assert '"name": "get_weather"' in text  # the tools, in the template's own words
    written = '"parameters": {"city": "Oslo"}' if name == "llama3_json" else "[TOOL_CALLS] ["
    assert written in text and "You can call functions" not in text

    reader = CallReader(tools, "r-2")
    events = [event for i in range(0, len(reply), 3) for event in reader.feed(reply[i : i + 3])]
    assert [e.name for e in events if e.name] == ["get_weather", "get_time"]
    arguments: dict[int, str] = {}
    for event in events:
        arguments[event.index] = arguments.get(event.index, "") + event.arguments
    assert json.loads(arguments[0]) == {"city": 'P"a}ris', "unit": "celsius"}
    assert json.loads(arguments[1]) == {"city": "Oslo"}
    assert reader.whole == 2
    calls = parse_calls(reply, tools, "r-2") or []
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'P"a}ris', "unit": "celsius"}),
        ("get_time", {"city": "Oslo"}),
    ]
    for cut in (3, 30, len(reply) - 1):
        with pytest.raises(BadToolCall, match="ended inside a tool call"):
            parse_calls(reply[:cut], tools)
    with pytest.raises(BadToolCall, match="does not parse"):
        parse_calls(reply.replace("; ", " + ").replace(", {", " {"), tools)
    assert parse_calls("Plain <b>text</b>.", tools) is None  # "<" is not this format's call
    if name == "mistral":  # an engine that drops the special token's text leaves it out
        assert len(parse_calls(reply.removeprefix("[TOOL_CALLS] "), tools) or []) == 2


@pytest.fixture(scope="module", params=sorted(FORMAT_CASES))
def formatted(request: pytest.FixtureRequest) -> Iterator[tuple[str, RunningServer]]:
    """The embedded model with a template that writes calls in another format."""
    path = FORMAT_CASES[request.param][0]
    config = server_config(engine="llamacpp", parallel=2, n_ctx=4096, chat_template=str(path))
    server = RunningServer(config, None).start()
    yield request.param, server
    server.stop()


@pytest.mark.model
async def test_a_template_of_another_format_gets_calls_that_parse_and_the_loop_ends(
    formatted: tuple[str, RunningServer],
) -> None:
    """Decoding writes calls in the template's format; they stream as OpenAI streams them,
    parse, and are valid for their schemas; the history goes back the template's way and the
    model answers in text."""
    name, server = formatted
    api = client(server)
    stream = await api.chat.completions.create(
        **ASK, tool_choice="required", temperature=0, max_tokens=120, stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        assert not chunk.choices[0].delta.content  # calls, not text
        for part in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            if part.function and part.function.name:
                entry["name"] = part.function.name
            if part.function and part.function.arguments:
                entry["arguments"] += part.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls, name
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), schema_of(entry["name"]))
    first = calls[0]
    answer = await api.chat.completions.create(
        model="smollm2-135m",
        messages=[
            *QUESTION,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": first["id"],
                        "type": "function",
                        "function": {"name": first["name"], "arguments": first["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": first["id"], "content": '{"temperature": 18}'},
        ],  # type: ignore[list-item]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        temperature=0,
        max_tokens=40,
    )
    choice = answer.choices[0]
    if choice.finish_reason == "tool_calls":  # "auto": another call, in the format, is valid
        for call in choice.message.tool_calls or ():
            jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    else:
        assert choice.message.content and choice.message.content[0] not in "{["
    # The Responses API reads the same format: a function_call item, streamed.
    events = await api.responses.create(
        model="smollm2-135m",
        input="What time is it in Oslo?",
        tools=FLAT,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
        stream=True,
    )
    kinds = [event.type async for event in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_text.delta" not in kinds
    await api.close()
