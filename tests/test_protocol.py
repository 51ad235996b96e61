"""The sans-I/O protocol layer, without an event loop: every rule and malformed inputs."""

from __future__ import annotations

import json

import msgspec
import pytest

from seedance.protocol import (
    Cancel,
    ChatMessage,
    DoneFrame,
    Embed,
    EndSession,
    FrameLimits,
    Generate,
    InvalidJSON,
    InvalidRequest,
    PayloadTooLarge,
    Ping,
    SeedanceError,
    SessionBusy,
    StartFrame,
    Timing,
    TokenFrame,
    TokenFrameEncoder,
    UnsupportedFrame,
    Usage,
    classify_binary,
    decode_client_text,
    decode_server_text,
    encode_client_message,
    encode_error,
    encode_frame,
    error_from_wire,
    validate_session_id,
)

LIMITS = FrameLimits(max_frame_bytes=1024 * 1024, max_tokens=2048)


def decode(obj: object) -> object:
    return decode_client_text(json.dumps(obj), LIMITS)


def rejects(obj: object, kind: type[SeedanceError] = InvalidRequest) -> str:
    with pytest.raises(kind) as info:
        decode_client_text(obj if isinstance(obj, str | bytes) else json.dumps(obj), LIMITS)
    return info.value.message


def test_reference_client_frame_is_a_generate() -> None:
    msg = decode(
        {
            "prompt": "Explain quantum entanglement",
            "stream": True,
            "max_tokens": 512,
            "temperature": 0.7,
        }
    )
    assert isinstance(msg, Generate)
    assert msg.prompt == "Explain quantum entanglement"
    assert (msg.stream, msg.max_tokens, msg.temperature) == (True, 512, 0.7)
    assert msg.turns() == [ChatMessage("user", "Explain quantum entanglement")]


def test_generate_defaults() -> None:
    msg = decode({"type": "generate", "prompt": "hi"})
    assert isinstance(msg, Generate)
    assert (msg.stream, msg.max_tokens, msg.temperature, msg.top_p) == (True, 256, 0.7, 1.0)
    assert (msg.stop, msg.seed, msg.request_id, msg.reset) == (None, None, None, False)


def test_generate_with_messages_and_every_field() -> None:
    msg = decode(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "x"},
            ],
            "stream": False,
            "max_tokens": 2048,
            "temperature": 0,
            "top_p": 0.5,
            "stop": ["a", "b", "c", "d"],
            "seed": 2**64 - 1,
            "request_id": "r1",
            "reset": True,
        }
    )
    assert isinstance(msg, Generate)
    assert msg.turns() == [ChatMessage("system", "be brief"), ChatMessage("user", "x")]
    assert msg.stop_strings() == ("a", "b", "c", "d")
    assert msg.temperature == 0.0 and isinstance(msg.temperature, float)


def test_other_message_types() -> None:
    assert decode({"type": "cancel"}) == Cancel()
    assert decode({"type": "cancel", "request_id": "r1"}) == Cancel(request_id="r1")
    assert decode({"type": "ping", "id": {"any": [1, "json"]}}) == Ping(id={"any": [1, "json"]})
    assert decode({"type": "end_session"}) == EndSession()
    embed = decode({"type": "embed", "input": ["a", [1, 2]], "request_id": "e1"})
    assert embed == Embed(input=["a", [1, 2]], request_id="e1")
    with pytest.raises(InvalidRequest, match="request_id"):
        decode({"type": "embed", "input": "a", "request_id": "\n"})


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        ({"prompt": "x", "foo": 1}, "unknown field 'foo'"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens: expected int, got str"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens: expected int, got bool"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens: expected int, got float"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be between 1 and 2048"),
        ({"prompt": "x", "max_tokens": 2049}, "max_tokens must be between 1 and 2048"),
        ({"prompt": "x", "max_tokens": 10**40}, "max_tokens must be between 1 and 2048"),
        ({"prompt": "x", "temperature": 2.5}, "temperature must be between 0 and 2"),
        ({"prompt": "x", "temperature": -1}, "temperature must be between 0 and 2"),
        ({"prompt": "x", "top_p": 0}, "top_p must be greater than 0"),
        ({"prompt": "x", "top_p": 1.01}, "top_p must be greater than 0"),
        ({"prompt": "x", "stop": ["a"] * 5}, "at most 4 strings"),
        ({"prompt": "x", "stop": [1]}, "stop[0]: expected str"),
        ({"prompt": "x", "stop": ""}, "stop strings must not be empty"),
        ({"prompt": "x", "seed": -1}, "seed must be an integer between 0 and"),
        ({"prompt": "x", "seed": 2**64}, "seed must be an integer between 0 and"),
        ({"prompt": "x", "request_id": ""}, "request_id must be 1-128 characters"),
        ({"prompt": "x", "request_id": "r" * 129}, "request_id must be 1-128 characters"),
        ({"prompt": "x", "request_id": "a\nb"}, "request_id must not contain control"),
        ({"prompt": "x", "request_id": 7}, "request_id: expected str"),
        ({"prompt": "x", "stream": "yes"}, "stream: expected bool"),
        ({}, "exactly one of prompt, messages and prompt_ids (or prompt_tensor) is required"),
        (
            {"prompt": "x", "messages": []},
            "exactly one of prompt, messages and prompt_ids (or prompt_tensor) is required",
        ),
        ({"messages": []}, "messages must hold at least one message"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role: invalid value"),
        ({"messages": [{"role": "user"}]}, "missing field 'content'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: expected str"),
        (
            {"prompt": None},
            "exactly one of prompt, messages and prompt_ids (or prompt_tensor) is required",
        ),
        ({"prompt": ["x"]}, "prompt: expected str"),
        ({"type": "nope"}, "unknown message type 'nope'"),
        ({"type": 3}, "unknown message type 3"),
        ({"type": "cancel", "extra": 1}, "unknown field 'extra'"),
        ({"type": "cancel", "request_id": 1}, "request_id: expected str"),
    ],
)
def test_invalid_requests_name_the_field_and_rule(frame: object, needle: str) -> None:
    assert needle in rejects(frame)


def test_error_carries_the_request_id_when_readable() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode({"prompt": "x", "max_tokens": 0, "request_id": "r-7"})
    assert info.value.request_id == "r-7"
    with pytest.raises(InvalidRequest) as info:
        decode({"prompt": "x", "max_tokens": 0, "request_id": 7})
    assert info.value.request_id is None


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "not json",
        "{",
        '{"prompt": "x",}',
        "{'prompt': 'x'}",
        '{"prompt": NaN}',
        b"\xff\xfe{}",
        b'{"prompt": "\xc3\x28"}',  # invalid UTF-8 inside a string
        '{"prompt": "\\ud800"}',  # a lone surrogate escape
        "[" * 100_000 + "]" * 100_000,  # deeply nested
        '{"a": ' * 5000 + "1" + "}" * 5000,
        '{"prompt": "x", "max_tokens": 1e400}',  # a number out of range
    ],
)
def test_malformed_json_is_invalid_json(raw: str | bytes) -> None:
    rejects(raw, InvalidJSON)


@pytest.mark.parametrize("raw", ["[]", "1", '"text"', "null", "true", "[{}]"])
def test_json_that_is_not_an_object_is_invalid_json(raw: str) -> None:
    assert "must be a JSON object" in rejects(raw, InvalidJSON)


def test_lone_surrogate_in_a_python_string_is_invalid_json() -> None:
    rejects('{"prompt": "\udcff"}', InvalidJSON)


def test_frame_size_limit_counts_utf8_bytes() -> None:
    limits = FrameLimits(max_frame_bytes=100, max_tokens=4096)
    ok = json.dumps({"prompt": "é" * 40}, ensure_ascii=False)  # 40 chars, 80 bytes of text
    decode_client_text(ok, limits)
    too_big = json.dumps({"prompt": "é" * 60}, ensure_ascii=False)  # 74 chars, 134 bytes
    assert len(too_big) < 100
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 100 bytes"):
        decode_client_text(too_big, limits)
    with pytest.raises(PayloadTooLarge):
        decode_client_text(b"x" * 101, limits)


def test_binary_frames() -> None:
    assert classify_binary(b"\x01\x00") == "ping"
    assert classify_binary(b"\x02\x00") == "pong"
    assert classify_binary(b"\x10\x00\x01") == "tensor"  # checked whole by its decoder
    for data in (b"", b"\x01", b"\x01\x01", b"\x03\x00", b"\x01\x00\x00", b"\x11"):
        with pytest.raises(UnsupportedFrame, match=r"must be a heartbeat .* or a tensor frame"):
            classify_binary(data)


@pytest.mark.parametrize("good", ["abc123", "a", "A-Z_a.z:0-9", "x" * 128])
def test_session_ids_accepted(good: str) -> None:
    assert validate_session_id(good) == good


@pytest.mark.parametrize("bad", ["", "x" * 129, "a b", "a/b", "é", "a?b", "a\n"])
def test_session_ids_rejected(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="session_id"):
        validate_session_id(bad)


def test_token_frames_are_exact_json() -> None:
    enc = TokenFrameEncoder('r"1')
    one = json.loads(enc.encode("Quantum", 0))
    assert one == {"type": "token", "token": "Quantum", "seq": 0, "request_id": 'r"1'}
    many = json.loads(enc.encode(' "é🙂\n', 5, 3))
    assert many == {"type": "token", "token": ' "é🙂\n', "seq": 5, "n": 3, "request_id": 'r"1'}
    assert enc.encode("x", 0).startswith('{"type":"token"')


def test_server_frames_roundtrip_through_the_client_decoder() -> None:
    frames = [
        StartFrame(request_id="r1", trace_id="t" * 32, model="m", prompt_tokens=42),
        TokenFrame(token="hi", seq=0, request_id="r1"),
        DoneFrame(
            done=True,
            request_id="r1",
            trace_id="t",
            finish_reason="stop",
            usage=Usage(1, 2, 3),
            timing=Timing(0.4, 31.2, 912.5),
            text="hi",
        ),
    ]
    for frame in frames:
        text = encode_frame(frame)
        assert json.loads(text)["type"] == frame.__struct_config__.tag
        assert decode_server_text(text) == frame
    done = json.loads(encode_frame(frames[2]))
    assert done["done"] is True and done["usage"]["total_tokens"] == 3
    start = json.loads(encode_frame(frames[0]))
    assert list(start) == ["type", "request_id", "trace_id", "model", "prompt_tokens"]


def test_client_decoder_ignores_unknown_frame_types() -> None:
    assert decode_server_text('{"type": "from_the_future", "x": 1}') is None
    assert isinstance(
        decode_server_text('{"type": "token", "token": "a", "seq": 0, "new": 1}'), TokenFrame
    )


def test_error_frames() -> None:
    frame = json.loads(encode_error(SessionBusy("busy"), "r9"))
    assert frame == {
        "type": "error",
        "request_id": "r9",
        "error": {"code": "session_busy", "message": "busy", "retryable": True},
    }
    err = error_from_wire("session_busy", "busy", request_id="r9")
    assert isinstance(err, SessionBusy) and err.retryable and err.request_id == "r9"
    unknown = error_from_wire("brand_new_code", "?")
    assert type(unknown) is SeedanceError and unknown.code == "brand_new_code"


def test_client_messages_encode_type_and_changed_fields_only() -> None:
    assert json.loads(encode_client_message(Cancel())) == {"type": "cancel"}
    text = encode_client_message(Generate(prompt="hi", max_tokens=5))
    assert json.loads(text) == {"type": "generate", "prompt": "hi", "max_tokens": 5}
    assert decode_client_text(text, LIMITS) == Generate(prompt="hi", max_tokens=5)


def test_messages_are_msgspec_structs() -> None:
    assert msgspec.json.decode(
        b'{"role": "user", "content": "x"}', type=ChatMessage
    ) == ChatMessage("user", "x")
