"""Property-based fuzzing of every parser: whatever the input, only the documented errors come
out, and valid input survives a round trip.

``make test`` runs a bounded number of examples (the ``ci`` profile); ``make soak`` runs the
``soak`` profile, many more (``HYPOTHESIS_PROFILE=soak``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import string
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seedance.config import ConfigError
from seedance.config_loader import load_config
from seedance.keyfiles import load_public
from seedance.observability.audit import AuditLog, AuditSettings
from seedance.observability.audit.kinds import Request
from seedance.observability.audit.verify import verify
from seedance.protocol.codec import (
    FrameLimits,
    decode_client_text,
    decode_server_text,
    encode_client_message,
    encode_frame,
)
from seedance.protocol.errors import InvalidJSON, InvalidRequest, PayloadTooLarge, Unauthorized
from seedance.protocol.messages import ChatMessage, Generate, TokenFrame
from seedance.protocol.openai import decode_chat, decode_completion
from seedance.server.uvicorn_ws import _frame_header
from seedance.tenants.auth import Authenticator
from seedance.tenants.config import parse_access
from tests.support.rawclient import RawClient
from tests.support.servers import RunningServer

settings.register_profile("ci", max_examples=120, deadline=None)
settings.register_profile(
    "soak", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

LIMITS = FrameLimits(max_frame_bytes=64 * 1024, max_tokens=4096)

# Any JSON value, nested a little; texts with control characters and non-ASCII.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Objects shaped like the frames and bodies, with any values in their fields.
frame_keys = st.sampled_from(
    [
        "type", "prompt", "messages", "stream", "max_tokens", "temperature", "top_p", "stop",
        "seed", "request_id", "reset", "traceparent", "priority", "qos", "model", "n", "role",
        "content", "max_completion_tokens", "stream_options", "include_usage", "unknown",
    ]
)  # fmt: skip
frame_like = st.dictionaries(
    frame_keys,
    json_values | st.sampled_from(["generate", "cancel", "ping", "end_session", "user"]),
    max_size=8,
)


def _bytes_of(value: Any) -> bytes:
    return json.dumps(value).encode()


# --------------------------------------------------------------------------- WebSocket frames


@given(st.one_of(st.binary(max_size=256), st.text(max_size=256).map(str.encode)))
def test_client_frames_of_any_bytes_raise_only_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(InvalidJSON, InvalidRequest, PayloadTooLarge):
        decode_client_text(data, LIMITS)


@given(frame_like)
def test_client_frames_of_any_shape_raise_only_protocol_errors(frame: dict[str, Any]) -> None:
    try:
        decode_client_text(_bytes_of(frame), LIMITS)
    except (InvalidJSON, InvalidRequest, PayloadTooLarge) as exc:
        assert exc.message  # a message for the client, never empty


ids = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=32)
turn_text = st.text(max_size=64)


@given(
    messages=st.lists(
        st.builds(ChatMessage, st.sampled_from(["system", "user", "assistant"]), turn_text),
        min_size=1,
        max_size=4,
    ),
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    stop=st.none() | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4),
    seed=st.none() | st.integers(0, 2**63),
    request_id=st.none() | ids,
    priority=st.integers(-10, 10),
)
def test_valid_generate_frames_round_trip(**fields: Any) -> None:
    message = Generate(**fields)
    decoded = decode_client_text(encode_client_message(message), LIMITS)
    assert decoded == message


@given(text=st.text(max_size=200), seq=st.integers(0, 2**31), n=st.integers(1, 64), rid=ids)
def test_token_frames_round_trip(text: str, seq: int, n: int, rid: str) -> None:
    frame = TokenFrame(request_id=rid, seq=seq, n=n, token=text)
    assert decode_server_text(encode_frame(frame)) == frame


@given(
    payloads=st.lists(
        st.one_of(st.text(max_size=300), st.binary(max_size=70_000)), min_size=1, max_size=4
    ),
    cuts=st.lists(st.integers(1, 1 << 17), max_size=6),
)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_server_frames_parse_back_however_the_stream_is_cut(
    payloads: list[str | bytes], cuts: list[int]
) -> None:
    # The server frames its writes itself (transport._frame_header); a standard client parser
    # reads them back exactly, whichever TCP segments they arrive in.
    from websockets.frames import Frame
    from websockets.protocol import Protocol, Side, State

    wire = b""
    for payload in payloads:
        data = payload.encode() if isinstance(payload, str) else payload
        wire += _frame_header(0x81 if isinstance(payload, str) else 0x82, len(data)) + data
    client = Protocol(Side.CLIENT, state=State.OPEN, max_size=None)
    received: list[str | bytes] = []
    start = 0
    for cut in [*sorted(set(cuts)), len(wire)]:
        client.receive_data(wire[start:cut])
        start = max(start, min(cut, len(wire)))
        for event in client.events_received():
            assert isinstance(event, Frame)
            received.append(event.data.decode() if event.opcode.value == 1 else bytes(event.data))
    assert received == payloads


# --------------------------------------------------------------------------- OpenAI bodies


@given(st.one_of(st.binary(max_size=256), frame_like.map(_bytes_of)))
def test_openai_bodies_raise_only_400s(body: bytes) -> None:
    for decode in (decode_chat, decode_completion):
        try:
            decode(body, LIMITS)
        except (InvalidJSON, InvalidRequest) as exc:
            assert exc.http_status == 400 and exc.message


@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant"]),
                "content": turn_text,
            }
        ),
        min_size=1,
        max_size=4,
    ),
    max_tokens=st.none() | st.integers(1, 4096),
    extra=st.dictionaries(
        st.sampled_from(["user", "service_tier", "metadata"]), json_values, max_size=2
    ),
)
def test_valid_chat_bodies_keep_their_messages(
    messages: list[dict[str, str]], max_tokens: int | None, extra: dict[str, Any]
) -> None:
    body = {"model": "m", "messages": messages, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    request = decode_chat(_bytes_of(body), LIMITS)
    assert [m.content for m in request.messages] == [m["content"] for m in messages]
    assert request.generate.max_tokens == (max_tokens or 256)


# --------------------------------------------------------------------------- configuration


toml_scalars = st.one_of(
    st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)  # fmt: skip


@given(
    settings_table=st.dictionaries(
        st.sampled_from(
            [
                "port",
                "parallel",
                "max_frame_bytes",
                "idle_timeout",
                "merge_window_ms",
                "repack",
                "labels",
                "allowed_origin",
                "log_level",
                "upstream",
                "nope",
                "max_session_bytes",
                "handshake_timeout",
                "max_header_bytes",
            ]
        ),
        toml_scalars,
        max_size=4,
    ),
    tenants=st.dictionaries(
        st.text(alphabet="ab-", min_size=1, max_size=4),
        st.dictionaries(
            st.sampled_from(["tier", "models", "max_priority", "quotas", "keys", "x"]),
            toml_scalars
            | st.dictionaries(st.sampled_from(["sessions", "connections"]), toml_scalars),
            max_size=3,
        ),
        max_size=2,
    ),
)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_config_files_raise_only_config_errors(
    tmp_path: Path, settings_table: dict[str, Any], tenants: dict[str, Any]
) -> None:
    import tomlkit

    document = tomlkit.document()
    for key, value in settings_table.items():
        document[key] = value
    if tenants:
        document["tenants"] = tenants
    path = tmp_path / "fuzz.toml"
    path.write_text(tomlkit.dumps(document))
    try:
        load_config({"config": str(path)}, {})
    except ConfigError as exc:
        assert exc.message and "\n" not in exc.message


# --------------------------------------------------------------------------- audit records


@pytest.fixture(scope="module")
def signed_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Any, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    folder = tmp_path_factory.mktemp("audit")
    key = Ed25519PrivateKey.generate()
    (folder / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    log = AuditLog(AuditSettings(path=folder / "audit.log", signing_key=key))
    log.start()
    for i in range(6):
        log.submit(
            Request(
                api="http",
                tenant="t",
                credential="k",
                request_id=f"r{i}",
                model="m",
                outcome="stop",
            )
        )
    log.close()
    return (folder / "audit.log").read_bytes(), load_public(folder / "key.pem"), folder


@given(position=st.integers(0, 10_000), byte=st.integers(0, 255))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_changed_byte_of_an_audit_log_is_found(
    signed_log: tuple[bytes, Any, Path], position: int, byte: int
) -> None:
    data, public, folder = signed_log
    position %= len(data)
    if data[position] == byte:
        return
    changed = folder / f"changed-{time.monotonic_ns()}.log"
    changed.write_bytes(data[:position] + bytes([byte]) + data[position + 1 :])
    try:
        verdict = verify(changed, public)  # never raises, whatever the bytes
    finally:
        changed.unlink()
    assert not verdict.ok, (position, byte, verdict.message)


# --------------------------------------------------------------------------- JWT claims


SECRET = "fuzz-secret-" * 6  # 66 bytes: long enough for HS512
AUTH = Authenticator(
    parse_access(
        {
            "tenants": {"acme": {}, "ops": {}},
            "auth": {"jwt": {"secret": SECRET, "admin_tenants": ["ops"]}},
        },
        "fuzz",
    )
)


@given(
    claims=st.dictionaries(
        st.sampled_from(["tenant", "exp", "nbf", "iat", "role", "sub", "jti", "aud", "iss", "x"]),
        json_values | st.sampled_from(["acme", "ops", "admin", "user"]) | st.integers(0, 2**34),
        max_size=7,
    ),
    algorithm=st.sampled_from(["HS256", "HS384", "HS512"]),
)
def test_jwt_claims_give_a_principal_or_a_401(claims: dict[str, Any], algorithm: str) -> None:
    import jwt

    try:
        token = jwt.encode(claims, SECRET, algorithm)
    except (TypeError, ValueError):
        return  # claims PyJWT cannot even encode
    try:
        principal = AUTH.authenticate(token, f"fuzz-{time.monotonic_ns()}")
    except Unauthorized as exc:
        assert exc.message
        return
    assert principal.tenant.name in ("acme", "ops")
    assert principal.role == "user" or principal.tenant.name == "ops"


@given(st.text(max_size=200))
def test_any_credential_text_gives_a_401_or_a_principal(credential: str) -> None:
    with contextlib.suppress(Unauthorized):
        AUTH.authenticate(credential, f"fuzz-{time.monotonic_ns()}")


@given(cuts=st.lists(st.integers(1, 400), max_size=8))
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_server_reads_client_frames_however_they_are_cut(
    server: RunningServer, cuts: list[int]
) -> None:
    # A ping and a generate, masked as a browser sends them, arrive in arbitrary TCP segments.
    from websockets.frames import Frame, Opcode

    client = RawClient(server.port)
    client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.proto.send_frame(Frame(Opcode.PING, b"fuzz"))
    request = {"type": "generate", "prompt": "cut me", "max_tokens": 3, "request_id": "r1"}
    client.proto.send_text(json.dumps(request).encode())
    wire = b"".join(client.proto.data_to_send())
    start = 0
    for cut in [*sorted(set(cuts)), len(wire)]:
        if start < cut <= len(wire):
            client.sock.sendall(wire[start:cut])
            start = cut
            time.sleep(0.001)
    frames = []
    while not frames or frames[-1].get("type") != "done":
        frame = client.recv_frame()
        if frame.opcode == Opcode.TEXT:
            frames.append(json.loads(frame.data))
    client.close()
    assert frames[0]["type"] == "start"
    assert frames[-1]["usage"]["completion_tokens"] == 3
