"""Faults a server meets in service: clients that vanish at any point of a request, and an event
loop stalled for a second. (An engine thread dying mid-batch: tests/test_llamacpp.py; a full
audit disk: tests/test_audit.py; a native crash: tests/test_llamacpp_cpu.py.)"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.rawclient import RawClient
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.waits import eventually
from tests.support.ws import assert_seq_contiguous, collect, open_session

UPGRADE = (
    b"GET /v2/infer HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
CHAT = b'{"model":"synthetic","messages":[{"role":"user","content":"hi"}],"max_tokens":40'


def vanish(sock: socket.socket) -> None:
    """Drop the connection as a dead phone does: no close frame, a TCP reset."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def settled(server: RunningServer) -> None:
    """Nothing of the vanished client is left: no connection, request or generation."""
    state = server.state
    deadline = time.monotonic() + 5
    while len(state.peers) or state.models.running:
        assert time.monotonic() < deadline, (
            [peer.name for peer in state.peers],
            state.models.running,
        )
        time.sleep(0.02)
    client = RawClient(server.port)  # and the next client is served
    client.send_json({"type": "generate", "prompt": "next", "max_tokens": 2})
    while (frame := client.recv_json())["type"] != "done":
        assert frame["type"] in ("start", "token"), frame
    client.close()


def _http(server: RunningServer, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    payload = CHAT + body
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _wait_for(sock: socket.socket, marker: bytes) -> None:
    sock.settimeout(10)
    seen = b""
    while marker not in seen:
        data = sock.recv(65536)
        assert data, seen
        seen += data


def _ws_generate(server: RunningServer, *, wait_for: str | None) -> RawClient:
    client = RawClient(server.port)
    client.send_json({"type": "generate", "prompt": "go", "max_tokens": 200})
    while wait_for is not None and client.recv_json()["type"] != wait_for:
        pass
    return client


# Each point: what the client does before it vanishes (returns the socket to drop).
POINTS: dict[str, Callable[[RunningServer], socket.socket]] = {
    "mid-handshake": lambda s: _partial_upgrade(s),
    "after the session frame": lambda s: RawClient(s.port).sock,
    "waiting for admission": lambda s: _ws_generate(s, wait_for=None).sock,
    "before the first token": lambda s: _ws_generate(s, wait_for="start").sock,
    "mid-stream": lambda s: _ws_generate(s, wait_for="token").sock,
    "http: mid-body": lambda s: _http_partial(s),
    "http: generating": lambda s: _http(s, b',"stream":false}'),
    "http: mid-stream": lambda s: _http_streaming(s),
}


def _partial_upgrade(server: RunningServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(UPGRADE[:40])
    return sock


def _http_partial(server: RunningServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    return sock


def _http_streaming(server: RunningServer) -> socket.socket:
    sock = _http(server, b',"stream":true}')
    _wait_for(sock, b"data: ")
    return sock


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.slow
@one_process_only("reads the server's state (or stalls its loop) in its process")
def test_a_client_vanishing_at_any_point_leaves_nothing_behind(
    make_server: Any, point: str
) -> None:
    # One slot: a request behind a running one waits for admission.
    engine = slow_engine(tokens_per_s=20, ttft_ms=300)
    server: RunningServer = make_server(engines=[engine], max_running=1)
    busy = _ws_generate(server, wait_for="start") if point == "waiting for admission" else None
    sock = POINTS[point](server)
    time.sleep(0.2)  # let the server reach that point
    vanish(sock)
    if busy is not None:
        vanish(busy.sock)
    settled(server)


@pytest.mark.slow
@one_process_only("reads the server's state (or stalls its loop) in its process")
async def test_an_event_loop_stalled_for_a_second_loses_no_token(make_server: Any) -> None:
    server: RunningServer = make_server(engines=[slow_engine(tokens_per_s=50)])
    loop = server.server.servers[0].get_loop()
    sessions = [await open_session(server.url) for _ in range(5)]
    for i, (ws, _) in enumerate(sessions):
        await ws.send(json.dumps({"prompt": "stall", "max_tokens": 100, "request_id": f"r{i}"}))
    await asyncio.sleep(0.5)
    loop.call_soon_threadsafe(time.sleep, 1.0)  # something blocks the loop for a second
    for i, (ws, _) in enumerate(sessions):
        frames = await collect(ws, timeout=20)
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length"
        assert assert_seq_contiguous(frames, f"r{i}") == 100
        await ws.close()
    merger = server.state.merger
    assert merger is not None
    # And the merge window comes back down once the loop is idle (how soon depends on what
    # else the machine runs: the window follows the loop's measured lateness).
    await eventually(lambda: merger.current_s < 2 * merger.window_s, 10, "the window back down")
