"""Streams that outlive their connection: ``resumable`` requests, ``resume``, ``history_lost``.

Over real sockets: a client drops its socket mid-reply, reconnects to the same session and
resumes after the last token it holds; the reply it ends with is the undisturbed one, every
token once, in order.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from tests.support.servers import RunningServer, one_process_only
from tests.support.waits import eventually
from tests.support.ws import collect, generate, open_session, recv_json, tokens_text, wait_closed

PROMPT = "tell me a long story"


@dataclass
class Reading:
    """What a client holds of one reply: the text by token index, and how it ended."""

    request_id: str
    last_seq: int = -1
    texts: list[str] = field(default_factory=list)
    starts: int = 0
    end: dict[str, Any] | None = None

    def take(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        if kind == "start":
            assert frame["request_id"] == self.request_id
            self.starts += 1
        elif kind == "token":
            assert frame["request_id"] == self.request_id
            assert frame["seq"] == self.last_seq + 1, (
                frame["seq"],
                self.last_seq,
            )  # no gap, no repeat
            self.texts.append(frame["token"])
            self.last_seq += frame.get("n", 1)
        elif kind in ("done", "error"):
            self.end = frame
        else:
            raise AssertionError(f"unexpected frame {frame}")

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def read(ws: ClientConnection, reading: Reading, until_seq: int | None = None) -> None:
    """Frames until the reply ends, or until the client holds token ``until_seq``."""
    while reading.end is None:
        reading.take(await recv_json(ws))
        if until_seq is not None and reading.last_seq >= until_seq:
            return


async def begin(
    url: str, session: str, max_tokens: int, until_seq: int
) -> tuple[ClientConnection, Reading]:
    """A resumable reply ``r1`` begun in ``session`` at ``url``, read up to ``until_seq``."""
    ws, _ = await open_session(url, f"session_id={session}")
    request = {"prompt": PROMPT, "seed": 7, "max_tokens": max_tokens, "resumable": True}
    await ws.send(json.dumps({**request, "request_id": "r1"}))
    reading = Reading("r1")
    await read(ws, reading, until_seq=until_seq)
    return ws, reading


async def resume(
    server: RunningServer, session: str, reading: Reading, epoch: str | None = None
) -> tuple[ClientConnection, dict[str, Any]]:
    ws, hello = await open_session(server.url, f"session_id={session}")
    resume = {"type": "resume", "request_id": reading.request_id, "after_seq": reading.last_seq}
    await ws.send(json.dumps({**resume, "epoch": epoch or hello["epoch"]}))
    return ws, hello


async def read_whole(server: Any, session: str) -> Reading:
    """The reply ``r1`` of ``session``, resumed on ``server`` from its start and read to its
    end (a server of a cluster reads it as Redis keeps it)."""
    reading = Reading("r1")
    ws, _ = await resume(server, session, reading)
    async with ws:
        await read(ws, reading)
    return reading


async def undisturbed(server: RunningServer, **fields: Any) -> str:
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt=PROMPT, **{"seed": 7, **fields})
    assert frames[-1]["type"] == "done"
    return tokens_text(frames)


@pytest.mark.slow
async def test_a_reply_dropped_20_times_ends_whole_and_exact(make_server: Any) -> None:
    server: RunningServer = make_server(tokens_per_s=3000.0)
    expected = await undisturbed(server, max_tokens=2000)
    ws, hello = await open_session(server.url, "session_id=phone")
    assert hello["epoch"] and "active" not in hello
    request = {"prompt": PROMPT, "seed": 7, "max_tokens": 2000, "resumable": True}
    await ws.send(json.dumps({**request, "request_id": "r1"}))
    reading = Reading("r1")
    rng = random.Random(20)
    drops = sorted(rng.sample(range(1, 1900), 20))
    for drop in drops:
        await read(ws, reading, until_seq=drop)
        ws.transport.abort()  # the network goes away: no close frame
        if reading.end is not None:
            break
        ws, hello = await resume(server, "phone", reading)
        assert hello["active"]["request_id"] == "r1"
        assert hello["active"]["next_seq"] > reading.last_seq  # what the server logged so far
    await read(ws, reading)
    await ws.close()
    assert reading.end is not None and reading.end["type"] == "done", reading.end
    assert reading.end["finish_reason"] == "length"
    assert reading.end["usage"]["completion_tokens"] == 2000 == reading.last_seq + 1
    assert reading.text == expected
    assert reading.starts >= 2  # each resume begins with the request's start frame


@pytest.mark.slow
async def test_two_readers_get_the_whole_reply_and_either_can_cancel(make_server: Any) -> None:
    server: RunningServer = make_server(tokens_per_s=400.0)
    expected = await undisturbed(server, max_tokens=200)
    first, _ = await open_session(server.url, "session_id=tabs")
    await first.send(
        json.dumps({"prompt": PROMPT, "seed": 7, "max_tokens": 200, "request_id": "a"})
    )
    one = Reading("a")
    await read(first, one, until_seq=20)
    second, hello = await open_session(server.url, "session_id=tabs")  # a second tab
    assert hello["active"] == {
        "request_id": "a",
        "next_seq": hello["active"]["next_seq"],
        "state": "running",
    }
    await second.send(json.dumps({"type": "resume", "request_id": "a", "after_seq": -1}))
    two = Reading("a")
    await asyncio.gather(read(first, one), read(second, two))
    assert one.text == two.text == expected
    assert one.end == two.end and one.end is not None and one.end["finish_reason"] == "length"

    # A cancel from the tab that did not start the request stops it for both.
    await first.send(json.dumps({"prompt": PROMPT, "max_tokens": 2000, "request_id": "b"}))
    one = Reading("b")
    await read(first, one, until_seq=5)
    await second.send(json.dumps({"type": "resume", "request_id": "b", "after_seq": -1}))
    two = Reading("b")
    await read(second, two, until_seq=10)
    await second.send(json.dumps({"type": "cancel", "request_id": "b"}))
    await asyncio.gather(read(first, one), read(second, two))
    assert one.end is not None and one.end["finish_reason"] == "cancelled"
    assert two.end == one.end and one.text == two.text
    assert one.last_seq + 1 == one.end["usage"]["completion_tokens"] < 2000
    await first.close()
    await second.close()


@pytest.mark.slow
@one_process_only("reads the server's stream logs in its process")
async def test_a_resumable_reply_runs_on_without_a_reader_and_can_be_read_after(
    make_server: Any,
) -> None:
    server: RunningServer = make_server(tokens_per_s=1000.0)
    ws, _ = await open_session(server.url, "session_id=lid")
    await ws.send(
        json.dumps({"prompt": PROMPT, "max_tokens": 300, "resumable": True, "request_id": "r"})
    )
    reading = Reading("r")
    await read(ws, reading, until_seq=10)
    ws.transport.abort()
    engine = server.engine
    await eventually(lambda: not server.state.generations, what="the generation finished")
    assert engine.stats.requests_aborted == 0
    ws, hello = await resume(server, "lid", reading)
    assert hello["active"] == {"request_id": "r", "next_seq": 300, "state": "done"}
    await read(ws, reading)
    await ws.close()
    assert reading.end is not None and reading.end["usage"]["completion_tokens"] == 300
    assert reading.last_seq == 299


@pytest.mark.slow
@one_process_only("reads the server's stream logs in its process")
async def test_a_resumable_reply_without_a_reader_past_the_grace_ends_cancelled(
    make_server: Any,
) -> None:
    server: RunningServer = make_server(tokens_per_s=100.0, resume_grace_s=0.2)
    ws, _ = await open_session(server.url, "session_id=gone")
    await ws.send(
        json.dumps({"prompt": PROMPT, "max_tokens": 5000, "resumable": True, "request_id": "r"})
    )
    reading = Reading("r")
    await read(ws, reading, until_seq=2)
    ws.transport.abort()
    await eventually(lambda: not server.state.generations, what="the grace ran out")
    ws, hello = await resume(server, "gone", reading)
    assert hello["active"]["state"] == "done"
    await read(ws, reading)
    await ws.close()
    assert reading.end is not None and reading.end["finish_reason"] == "cancelled"
    assert reading.last_seq + 1 == reading.end["usage"]["completion_tokens"] < 5000


@pytest.mark.slow
@one_process_only("reads the server's stream logs in its process")
async def test_a_request_that_is_not_resumable_still_stops_on_disconnect(
    make_server: Any,
) -> None:
    server: RunningServer = make_server(tokens_per_s=200.0)
    ws, _ = await open_session(server.url, "session_id=plain")
    await ws.send(json.dumps({"prompt": PROMPT, "max_tokens": 2000, "request_id": "r"}))
    await read(ws, Reading("r"), until_seq=3)
    ws.transport.abort()
    engine = server.engine
    await eventually(lambda: engine.stats.active == 0, what="the engine freed")
    assert engine.stats.requests_aborted == 1
    await eventually(lambda: not server.state.generations, what="the request ended")
    ws, hello = await open_session(server.url, "session_id=plain")
    async with ws:
        assert "active" not in hello
        await ws.send(json.dumps({"type": "resume", "request_id": "r", "after_seq": 3}))
        error = await recv_json(ws)
    assert error["error"]["code"] == "history_lost" and error["error"]["reason"] == "expired"


async def _history_lost(ws: ClientConnection, **resume: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "resume", **resume}))
    frame = await recv_json(ws)
    assert frame["type"] == "error" and frame["error"]["code"] == "history_lost", frame
    assert frame["request_id"] == resume["request_id"]
    body: dict[str, Any] = frame["error"]
    return body


@one_process_only("--resume-max-bytes trims each process's kept streams; Redis keeps them")
async def test_every_history_lost_reason(make_server: Any) -> None:
    server: RunningServer = make_server(resume_max_bytes=2000)
    ws, hello = await open_session(server.url, "session_id=s1")
    async with ws:
        frames = await generate(ws, prompt=PROMPT, max_tokens=50, resumable=True, request_id="a")
        assert frames[-1]["type"] == "done"
        # cursor_ahead: the client claims a token the server never logged
        body = await _history_lost(ws, request_id="a", after_seq=50, epoch=hello["epoch"])
        assert body["reason"] == "cursor_ahead" and "49" in body["message"]
        # epoch_changed: a cursor from another epoch (a server that lost its log)
        body = await _history_lost(ws, request_id="a", after_seq=3, epoch="0123456789abcdef")
        assert body["reason"] == "epoch_changed"
        # expired: never ran here (or ended longer ago than the window)
        body = await _history_lost(ws, request_id="nope", after_seq=-1)
        assert body["reason"] == "expired"
        # the log is still readable: whole, or from the end of a frame the client holds
        await ws.send(json.dumps({"type": "resume", "request_id": "a", "after_seq": -1}))
        whole = await collect(ws)
        assert whole[0]["type"] == "start" and tokens_text(whole) == tokens_text(frames)
        first = frames[1]
        held = first["seq"] + first.get("n", 1) - 1
        await ws.send(json.dumps({"type": "resume", "request_id": "a", "after_seq": held}))
        rest = await collect(ws)
        assert rest[1]["seq"] == held + 1
        assert first["token"] + tokens_text(rest) == tokens_text(frames)
        assert rest[-1] == frames[-1]  # the same done: usage counted once
    # trimmed: other sessions' ended streams push this one over the tenant's byte cap
    for other in ("s2", "s3", "s4"):
        ws2, _ = await open_session(server.url, f"session_id={other}")
        async with ws2:
            await generate(ws2, prompt=PROMPT, max_tokens=100, resumable=True)
    ws, _ = await open_session(server.url, "session_id=s1")
    async with ws:
        body = await _history_lost(ws, request_id="a", after_seq=3)
        assert body["reason"] == "trimmed" and "2000 bytes" in body["message"]


@one_process_only("reads the server's stream logs in its process")
async def test_expired_after_the_window(make_server: Any) -> None:
    server: RunningServer = make_server(resume_window_s=0.05)
    ws, _ = await open_session(server.url, "session_id=w")
    async with ws:
        await generate(ws, prompt=PROMPT, max_tokens=5, resumable=True, request_id="a")
        await eventually(lambda: server.state.streams.current("default", "w") is None)
        body = await _history_lost(ws, request_id="a", after_seq=-1)
    assert body["reason"] == "expired"


async def test_bad_resume_frames_are_refused_and_lose_nothing(make_server: Any) -> None:
    server: RunningServer = make_server()
    ws, _ = await open_session(server.url, "session_id=bad")
    async with ws:
        await ws.send(json.dumps({"type": "resume", "request_id": "a", "after_seq": -2}))
        error = await recv_json(ws)
        assert (
            error["error"]["code"] == "invalid_request" and "after_seq" in error["error"]["message"]
        )
        await ws.send(json.dumps({"type": "resume", "after_seq": 0}))
        error = await recv_json(ws)
        assert (
            error["error"]["code"] == "invalid_request"
            and "request_id" in error["error"]["message"]
        )
        frames = await generate(ws, prompt="still here", max_tokens=3)
        assert frames[-1]["type"] == "done"


@pytest.mark.model
@pytest.mark.slow
async def test_the_embedded_model_resumes_exactly(make_server: Any) -> None:
    server: RunningServer = make_server(engine="llamacpp", parallel=2, n_ctx=4096)
    fields = {"max_tokens": 120, "temperature": 0.0, "seed": 3}
    expected = await undisturbed(server, **fields)
    ws, _ = await open_session(server.url, "session_id=model")
    await ws.send(json.dumps({"prompt": PROMPT, **fields, "resumable": True, "request_id": "m"}))
    reading = Reading("m")
    for drop in (5, 40, 80):
        await read(ws, reading, until_seq=drop)
        ws.transport.abort()
        if reading.end is not None:
            break
        ws, _ = await resume(server, "model", reading)
    await read(ws, reading)
    await ws.close()
    assert reading.end is not None and reading.end["type"] == "done"
    assert reading.text == expected
    assert reading.end["usage"]["completion_tokens"] == reading.last_seq + 1


@pytest.mark.slow
async def test_shutdown_closes_idle_connections_spread_out_and_lets_streams_finish(
    make_server: Any,
) -> None:
    server: RunningServer = make_server(tokens_per_s=200.0, drain_timeout_s=10.0)
    idle = [(await open_session(server.url))[0] for _ in range(10)]
    ws, _ = await open_session(server.url, "session_id=busy")
    await ws.send(
        json.dumps({"prompt": PROMPT, "max_tokens": 400, "resumable": True, "request_id": "r"})
    )
    reading = Reading("r")
    await read(ws, reading, until_seq=5)
    loop = asyncio.get_running_loop()
    stopping = asyncio.ensure_future(asyncio.to_thread(server.stop))
    closed: list[tuple[float, int | None]] = []

    async def closes(client: ClientConnection) -> None:
        code, _ = await wait_closed(client, timeout=10)
        closed.append((loop.time(), code))

    await asyncio.gather(*(closes(client) for client in idle))
    assert [code for _, code in closed] == [1001] * 10
    times = sorted(at for at, _ in closed)
    assert times[-1] - times[0] > 0.5  # spread out, not all at once
    await read(ws, reading)  # the running stream goes on to its end
    assert reading.end is not None and reading.end["finish_reason"] == "length"
    assert reading.last_seq == 399
    code, _ = await wait_closed(ws)
    assert code == 1001
    await stopping
