"""End to end over real sockets: the reference exchange, streaming and whole replies."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from seedance import SERVER_NAME
from seedance.engines.synthetic import SyntheticEngine
from tests.support.servers import RunningServer, one_process_only
from tests.support.ws import assert_seq_contiguous, collect, generate, open_session, tokens_text

REFERENCE_CLIENT = """
const socket = new WebSocket('ws://127.0.0.1:8000/v2/infer?session_id=abc123&model=smollm2-135m');
socket.onopen = () => socket.send(JSON.stringify({
  prompt: "Explain quantum entanglement", stream: true, max_tokens: 512, temperature: 0.7 }));
socket.onmessage = (event) => {
  const chunk = JSON.parse(event.data);
  if (chunk.token) console.log(chunk.token);   // tokens as they are generated
  if (chunk.done) console.log("done");         // end of the reply
};
"""


@one_process_only("reads the server's stream store in its process")
async def test_reference_exchange(server: RunningServer) -> None:
    ws, hello = await open_session(server.url, "session_id=abc123")
    async with ws:
        assert hello == {
            "type": "session",
            "session_id": "abc123",
            "model": "synthetic",
            "created": True,
            "context_turns": 0,
            "expires_in": 1800.0,
            "heartbeat_interval": 25.0,
            "idle_timeout": 30.0,
            "server": SERVER_NAME,
            "epoch": server.state.streams.epoch,
        }
        await ws.send(
            json.dumps(
                {
                    "prompt": "Explain quantum entanglement",
                    "stream": True,
                    "max_tokens": 512,
                    "temperature": 0.7,
                }
            )
        )
        frames = await collect(ws)
    start, *tokens, done = frames
    assert start["type"] == "start"
    rid = start["request_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", start["trace_id"])
    assert start["model"] == "synthetic" and start["prompt_tokens"] > 0
    assert all(f["type"] == "token" and f["request_id"] == rid for f in tokens)
    assert assert_seq_contiguous(tokens, rid) == 512
    assert done["type"] == "done" and done["done"] is True
    assert done["request_id"] == rid and done["trace_id"] == start["trace_id"]
    assert done["finish_reason"] == "length"
    assert done["usage"] == {
        "prompt_tokens": start["prompt_tokens"],
        "completion_tokens": 512,
        "total_tokens": start["prompt_tokens"] + 512,
    }
    timing = done["timing"]
    assert 0 <= timing["queue_ms"] <= timing["ttft_ms"] <= timing["total_ms"]
    assert "text" not in done


async def test_stream_false_returns_text_in_done(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        streamed = await generate(ws, prompt="same", seed=7, max_tokens=40, reset=True)
        whole = await generate(ws, prompt="same", seed=7, max_tokens=40, stream=False, reset=True)
    assert [f["type"] for f in whole] == ["start", "done"]
    assert whole[-1]["text"] == tokens_text(streamed)
    assert whole[-1]["usage"]["completion_tokens"] == 40


async def test_request_id_is_echoed_in_every_frame(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="x", request_id="mine-1", max_tokens=5)
    assert {f["request_id"] for f in frames} == {"mine-1"}


async def test_same_seed_same_reply_and_stop_strings(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        first = tokens_text(await generate(ws, prompt="p", seed=3, max_tokens=60, reset=True))
        again = tokens_text(await generate(ws, prompt="p", seed=3, max_tokens=60, reset=True))
        other = tokens_text(await generate(ws, prompt="p", seed=4, max_tokens=60, reset=True))
        assert first == again != other
        # Stop on a string that spans tokens: the reply ends right before it.
        stop = first[20:27]
        frames = await generate(ws, prompt="p", seed=3, max_tokens=60, reset=True, stop=[stop])
    text = tokens_text(frames)
    assert text == first[: first.index(stop)]
    assert frames[-1]["finish_reason"] == "stop"
    assert assert_seq_contiguous(frames) == frames[-1]["usage"]["completion_tokens"]


async def test_subprotocol_is_selected_when_offered(server: RunningServer) -> None:
    ws, _ = await open_session(server.url, subprotocols=["seedance.v2"])
    async with ws:
        assert ws.subprotocol == "seedance.v2"
    ws, _ = await open_session(server.url)
    async with ws:
        assert ws.subprotocol is None


def _node_with_websocket() -> list[str] | None:
    node = shutil.which("node")
    if node is None:
        return None
    for flags in ([], ["--experimental-websocket"]):
        probe = subprocess.run(
            [node, *flags, "-e", "process.exit(typeof WebSocket === 'function' ? 0 : 1)"],
            capture_output=True,
            timeout=30,
        )
        if probe.returncode == 0:
            return [node, *flags]
    return None


@pytest.mark.subprocess
@one_process_only("reads the server's stream store in its process")
def test_reference_javascript_client_unchanged(make_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = _node_with_websocket()
    if node is None:
        pytest.skip("needs Node.js with a global WebSocket (Node >= 20.10)")
    server = make_server(engines=[SyntheticEngine(name="smollm2-135m")])
    # The snippet of PROTOCOL.md verbatim; only the port differs, and the script exits after
    # the done line so the test can end.
    script = REFERENCE_CLIENT.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    prelude = (
        "const log = console.log; console.log = (...a) => { log(...a);"
        " if (a[0] === 'done') process.exit(0); };\n"
        "setTimeout(() => { log('timeout'); process.exit(3); }, 20000);\n"
    )
    (tmp_path / "client.js").write_text(prelude + script)
    result = subprocess.run(
        [*node, str(tmp_path / "client.js")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "done"
    session = server.state.sessions.get("default", "abc123")
    assert session is not None and len(session.turns) == 2
    # One line per token frame (frames may merge tokens): together, the whole reply.
    assert "".join(lines[:-1]) == session.turns[1].message.content


async def test_timings_resolve_below_a_millisecond(server: RunningServer) -> None:
    # uvloop's loop.time() counts whole milliseconds: timings must come from a finer clock.
    ws, _ = await open_session(server.url)
    async with ws:
        timings = [
            (await generate(ws, prompt="t", max_tokens=3, reset=True))[-1]["timing"]
            for _ in range(5)
        ]
    values = [t[k] for t in timings for k in ("ttft_ms", "total_ms")]
    assert any(v != int(v) for v in values), values
