"""The keepalive every client answers: standard WebSocket pings until a client speaks the binary
heartbeat, binary heartbeats after, and a connection that streams a reply is never idle.

The rules on their own, on a fake clock (``seedance.server.keepalive``), then over real sockets
with clients that answer nothing, only control frames, or the binary heartbeat; the design
document's own JavaScript in Chromium is in ``tests/test_browser.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
from websockets.frames import Opcode

from seedance.server.keepalive import Action, Heartbeat, Keepalive
from tests.support.rawclient import RawClient
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.ws import open_session, recv_json


def keepalive(**fields: float) -> Keepalive:
    return Keepalive(
        heartbeat_interval_s=fields.get("interval", 25.0),
        idle_timeout_s=fields.get("idle", 30.0),
        write_timeout_s=fields.get("write", 60.0),
        last_inbound=0.0,
    )


# --------------------------------------------------------------------------- the rules


def test_a_silent_client_is_pinged_once_then_closed_as_idle() -> None:
    k = keepalive()
    assert k.due(0.0, None) == 25.0
    assert k.on_timer(24.9, None) is Action.NOTHING
    assert k.on_timer(25.0, None) is Action.PING
    assert k.heartbeat is Heartbeat.CONTROL  # what every client answers by itself
    assert k.due(25.0, None) == 30.0  # one ping per silence: next, the idle timeout
    assert k.on_timer(26.0, None) is Action.NOTHING
    assert k.on_timer(30.0, None) is Action.CLOSE_IDLE


def test_any_inbound_frame_restarts_the_silence() -> None:
    k = keepalive()
    assert k.on_timer(25.0, None) is Action.PING
    k.inbound(25.02)  # the pong
    assert k.on_timer(30.0, None) is Action.NOTHING
    assert k.due(30.0, None) == pytest.approx(50.02)
    assert k.on_timer(50.02, None) is Action.PING


def test_a_streaming_connection_is_never_idle_and_counts_silence_from_the_streams_end() -> None:
    k = keepalive()
    k.stream_started(1.0)
    assert k.on_timer(25.0, None) is Action.PING  # still pinged: a browser answers it
    for now in (30.0, 45.0, 90.0):  # a client that only reads a long reply
        assert k.on_timer(now, None) is Action.NOTHING
    k.stream_ended(95.0)
    # The silence counts from the stream's end, for the ping too: one at 120, answered or not.
    assert k.due(95.0, None) == 120.0
    assert k.on_timer(120.0, None) is Action.PING
    assert k.due(120.0, None) == 125.0
    assert k.on_timer(125.0, None) is Action.CLOSE_IDLE


def test_a_client_that_speaks_binary_gets_binary_and_a_stall_cuts_off_whatever_it_does() -> None:
    k = keepalive(write=10.0)
    k.spoke_binary()
    assert k.heartbeat is Heartbeat.BINARY
    k.stream_started(0.0)
    assert k.due(5.0, 3.0) == 13.0
    assert k.on_timer(12.9, 3.0) in (Action.NOTHING, Action.PING)
    assert k.on_timer(13.0, 3.0) is Action.CUT_OFF


# --------------------------------------------------------------------------- over sockets


def frames_until_closed(client: RawClient, timeout_s: float) -> tuple[list[Opcode], int]:
    """Every frame's opcode until the server closes; the close code. The client answers
    nothing: its pongs are never sent."""
    client.sock.settimeout(timeout_s)
    opcodes = []
    while True:
        frame = client.recv_frame()
        opcodes.append(frame.opcode)
        if frame.opcode == Opcode.CLOSE:
            return opcodes, int.from_bytes(frame.data[:2], "big")


@pytest.mark.slow
def test_a_client_that_answers_nothing_gets_ping_frames_then_4408(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server(heartbeat_interval_s=0.2, idle_timeout_s=0.5)
    client = RawClient(server.port)
    started = time.monotonic()
    opcodes, code = frames_until_closed(client, 5)
    elapsed = time.monotonic() - started
    client.close()
    assert code == 4408
    assert Opcode.PING in opcodes  # a standard ping frame, never a binary data frame
    assert Opcode.BINARY not in opcodes
    assert 0.4 <= elapsed < 3


@pytest.mark.slow
def test_a_client_that_only_reads_a_long_reply_gets_it_whole(
    make_server: Callable[..., RunningServer],
) -> None:
    """A reply of 1.5 s, three idle timeouts: nothing answered, not even the pings."""
    server = make_server(
        [slow_engine(tokens_per_s=40)], heartbeat_interval_s=0.2, idle_timeout_s=0.5
    )
    client = RawClient(server.port)
    client.send_json({"prompt": "go on", "max_tokens": 60})
    tokens, binary = 0, 0
    while True:
        frame = client.recv_frame()
        if frame.opcode == Opcode.BINARY:
            binary += 1
        if frame.opcode != Opcode.TEXT:
            continue
        message = json.loads(frame.data)
        if message["type"] == "token":
            tokens += message.get("n", 1)
        if message["type"] in ("done", "error"):
            break
    assert message["type"] == "done" and message["finish_reason"] == "length", message
    assert tokens == 60 and binary == 0
    _opcodes, code = frames_until_closed(client, 5)  # idle now: closed after the timeout
    client.close()
    assert code == 4408


@pytest.mark.slow
@one_process_only("reads the server's connections in its process")
async def test_a_library_client_stays_open_on_its_automatic_pongs(
    make_server: Callable[..., RunningServer],
) -> None:
    """python-websockets answers ping frames by itself, as browsers do: no heartbeat code."""
    server = make_server(heartbeat_interval_s=0.1, idle_timeout_s=0.3)
    ws, _ = await open_session(server.url)
    async with ws:
        await asyncio.sleep(1.2)  # four idle timeouts
        await ws.send(json.dumps({"type": "ping", "id": "still"}))
        assert await recv_json(ws) == {"type": "pong", "id": "still"}
    connection_rtt = server.state.metrics.heartbeat_rtt.collect()[0].samples
    counts = [s.value for s in connection_rtt if s.name.endswith("_count")]
    assert counts and counts[0] >= 2  # the pongs of ping frames are round trips too


@pytest.mark.slow
async def test_a_client_that_speaks_the_binary_heartbeat_is_pinged_in_binary(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server(heartbeat_interval_s=0.2, idle_timeout_s=0.6)
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(b"\x01\x00")
        assert await asyncio.wait_for(ws.recv(), 5) == b"\x02\x00"
        data = await asyncio.wait_for(ws.recv(), 2)  # the server's own, after the silence
        assert data == b"\x01\x00"


def test_the_pong_to_the_ping_after_a_stream_counts_however_late_the_timer() -> None:
    """The ping after a stream comes a heartbeat interval into the silence, not at its start,
    so its pong counts even when the timer at the window's end runs late."""
    k = keepalive()
    k.stream_started(1.0)
    k.stream_ended(95.0)
    assert k.on_timer(120.0, None) is Action.PING
    k.inbound(120.001)  # the pong, a millisecond later
    assert k.on_timer(125.2, None) is not Action.CLOSE_IDLE  # the timer, 200 ms late
