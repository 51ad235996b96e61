"""Raw WebSocket helpers for tests that check frames exactly as a client sees them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from seedance.client.session import Stream, TokenChunk


def raw_connect(url: str, query: str = "", **kwargs: Any) -> connect:
    """Open ``/v2/infer`` with no library heartbeat, so tests see every frame."""
    target = f"{url}/v2/infer" + (f"?{query}" if query else "")
    kwargs.setdefault("ping_interval", None)
    return connect(target, **kwargs)


async def recv_json(ws: ClientConnection, timeout: float = 10.0) -> dict[str, Any]:
    """The next text frame as JSON (binary heartbeat pings are answered and skipped)."""
    while True:
        data = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(data, bytes):
            if data == b"\x01\x00":
                await ws.send(b"\x02\x00")
            continue
        frame: dict[str, Any] = json.loads(data)
        return frame


async def open_session(
    url: str, query: str = "", **kwargs: Any
) -> tuple[ClientConnection, dict[str, Any]]:
    ws = await raw_connect(url, query, **kwargs)
    hello = await recv_json(ws)
    assert hello["type"] == "session", hello
    return ws, hello


async def collect(ws: ClientConnection, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Frames up to and including the next ``done`` or ``error``."""
    frames = []
    while True:
        frame = await recv_json(ws, timeout)
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            return frames


async def generate(ws: ClientConnection, **fields: Any) -> list[dict[str, Any]]:
    await ws.send(json.dumps(fields))
    return await collect(ws)


async def wait_closed(ws: ClientConnection, timeout: float = 10.0) -> tuple[int | None, list[Any]]:
    """Read until the server closes; return the close code and the frames seen before it."""
    seen: list[Any] = []

    async def read_all() -> None:
        try:
            while True:
                data = await ws.recv()
                seen.append(json.loads(data) if isinstance(data, str) else data)
        except ConnectionClosed:
            pass

    await asyncio.wait_for(read_all(), timeout)
    return ws.close_code, seen


def tokens_text(frames: list[dict[str, Any]]) -> str:
    return "".join(f["token"] for f in frames if f["type"] == "token")


def assert_seq_contiguous(frames: list[dict[str, Any]], request_id: str | None = None) -> int:
    """Token frames cover seq 0, 1, 2, ... without gap or repeat; returns the token count."""
    expected = 0
    for frame in frames:
        if frame["type"] != "token":
            continue
        if request_id is not None:
            assert frame["request_id"] == request_id
        assert frame["seq"] == expected, (frame, expected)
        expected += frame.get("n", 1)
    return expected


async def read(stream: Stream) -> list[TokenChunk]:
    return [chunk async for chunk in stream]


def assert_contiguous(chunks: list[TokenChunk], completion_tokens: int) -> None:
    """Token frames' ``seq`` run on without gaps and add up to the reply's tokens."""
    seq = 0
    for chunk in chunks:
        assert chunk.seq == seq, [(c.seq, c.n) for c in chunks]
        seq += chunk.n
    assert seq == completion_tokens
