"""Adaptive token-frame merging, as a client sees it on the wire."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from seedance.config import ServerConfig
from seedance.engines.synthetic import SyntheticEngine
from seedance.server.app import create_app
from tests.support.servers import one_process_only, slow_engine
from tests.support.ws import (
    assert_seq_contiguous,
    generate,
    open_session,
    recv_json,
    tokens_text,
    wait_closed,
)


async def test_fast_stream_merges_tokens_but_never_the_first(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SyntheticEngine()])  # no delay: far faster than the window
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="go", max_tokens=300, seed=3)
        tokens = [f for f in frames if f["type"] == "token"]
        assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 300
        assert assert_seq_contiguous(frames) == 300
        assert len(tokens) < 100  # merged: far fewer frames than tokens
        assert "n" not in tokens[0]  # the first token travels alone, at once
        assert any(f.get("n", 1) > 1 for f in tokens)
        whole = await generate(ws, prompt="go", max_tokens=300, seed=3, stream=False, reset=True)
        assert tokens_text(frames) == whole[-1]["text"]  # merging loses and reorders nothing


async def test_merging_off_sends_one_frame_per_token(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SyntheticEngine()], merge_window_ms=0)
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="go", max_tokens=200)
        tokens = [f for f in frames if f["type"] == "token"]
        assert len(tokens) == 200 and all("n" not in f for f in tokens)
        assert assert_seq_contiguous(frames) == 200


@pytest.mark.slow
async def test_stream_slower_than_the_window_is_never_held(make_server) -> None:  # type: ignore[no-untyped-def]
    # 40 tokens/s: 25 ms between tokens, well over the 5 ms window.
    server = make_server(engines=[slow_engine(tokens_per_s=40)])
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="go", max_tokens=12)
        tokens = [f for f in frames if f["type"] == "token"]
        assert len(tokens) == 12 and all("n" not in f for f in tokens)


async def test_concurrent_streams_on_one_connection_keep_their_order(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SyntheticEngine()])
    ws, _ = await open_session(server.url)
    async with ws:
        # One request per connection at a time is the session rule; use three connections and
        # check that frames of each stay complete and in order while they interleave.
        others = [await open_session(server.url) for _ in range(2)]
        sockets = [ws] + [o[0] for o in others]
        results = await asyncio.gather(
            *(
                generate(s, prompt=f"p{i}", max_tokens=250, request_id=f"q{i}")
                for i, s in enumerate(sockets)
            )
        )
        for i, frames in enumerate(results):
            assert frames[0]["type"] == "start" and frames[-1]["type"] == "done"
            assert assert_seq_contiguous(frames, f"q{i}") == 250
        for other, _ in others:
            await other.close()


@one_process_only("reads the server's state in its process")
async def test_window_is_a_setting(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[SyntheticEngine()], merge_window_ms=50)
    assert server.state.merger is not None and server.state.merger.window_s == 0.05


async def test_plain_asgi_server_uses_the_queued_path() -> None:
    # Mounted under an ASGI server without Seedance's transport extension, the app falls back
    # to one websocket.send per frame and to the ASGI receive queue; the client sees the same.
    app = create_app(ServerConfig(), engines=[SyntheticEngine()])
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, ws="websockets-sansio", log_level="warning"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(1000):
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        ws, _ = await open_session(f"ws://127.0.0.1:{port}")
        async with ws:
            frames = await generate(ws, prompt="go", max_tokens=120)
            assert assert_seq_contiguous(frames) == 120 and frames[-1]["type"] == "done"
            await ws.send('{"type":"ping","id":7}')
            assert await recv_json(ws) == {"type": "pong", "id": 7}
            await ws.send('{"type":"end_session"}')
            code, _ = await wait_closed(ws)
            assert code == 1000
    finally:
        server.should_exit = True
        await task


@one_process_only("reads the server's state in its process")
async def test_messages_after_end_session_keep_their_order(server) -> None:  # type: ignore[no-untyped-def]
    # end_session is handled in the receive loop (it awaits the store); what follows it in
    # the same burst must not overtake it: the session is gone before the ping is answered.
    ws, _ = await open_session(server.url, "session_id=order1")
    async with ws:
        await ws.send('{"type":"end_session"}')
        await ws.send('{"type":"ping","id":1}')
        code, _ = await wait_closed(ws)
        assert code == 1000
    assert server.state.sessions.get("default", "order1") is None
