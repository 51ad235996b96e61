"""Write scheduling (``seedance.server.outbound``) against a fake writer: no socket, no
server. What reaches the wire, in which order, merged how, and when a client is cut off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest

from seedance.server.outbound import FrameMerger, Outbound


class FakeWriter:
    """The server's direct write path: records each ``write`` (a list of frames)."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()
        self.writes: list[list[str | bytes]] = []
        self.fail: Exception | None = None

    def write_frames(self, frames: Sequence[str | bytes]) -> bool:
        if self.fail is not None:
            raise self.fail
        self.writes.append(list(frames))
        return True


class FakeSocket:
    """The ASGI side of a WebSocket as Outbound uses it."""

    def __init__(self) -> None:
        self.writer = FakeWriter()
        self.closed_with: tuple[int, str] | None = None

    async def send(self, frame: str | bytes) -> None:  # the ASGI path (not used here)
        raise AssertionError("the direct path is offered")

    async def close(self, code: int, reason: str = "") -> None:
        self.closed_with = (code, reason)


def tokens(write: list[str | bytes]) -> list[tuple[str, int, int]]:
    """(text, seq, n) of each token frame in one write."""
    frames = [json.loads(f) for f in write]
    return [(f["token"], f["seq"], f.get("n", 1)) for f in frames if f["type"] == "token"]


def outbound(**options: Any) -> tuple[Outbound, FakeSocket, list[str]]:
    sock = FakeSocket()
    events: list[str] = []
    out = Outbound(
        sock,  # type: ignore[arg-type]
        max_pending_bytes=options.pop("max_pending_bytes", 1 << 20),
        on_overflow=lambda: events.append("overflow"),
        on_failure=lambda exc: events.append(f"failure: {exc}"),
        **options,
    )
    return out, sock, events


async def test_an_idle_socket_gets_each_frame_at_once_in_its_own_write() -> None:
    out, sock, _ = outbound()
    out.put('{"type":"pong"}')
    stream = out.token_stream("r1")
    stream.push("a", 1)
    stream.push("b", 1)  # no merger: one frame per token
    assert sock.writer.writes[0] == ['{"type":"pong"}']
    assert [tokens(w) for w in sock.writer.writes[1:]] == [[("a", 0, 1)], [("b", 1, 1)]]


async def test_while_the_socket_is_paused_frames_queue_and_tokens_merge() -> None:
    merger = FrameMerger(0.005)
    out, sock, _ = outbound(merger=merger)
    sock.writer.writable.clear()  # the client is not reading
    stream = out.token_stream("r1")
    for text in "abc":
        stream.push(text, 1)
    out.put('{"type":"pong"}')
    stream.push("d", 1)  # joins the stream's waiting frame, ahead of the pong
    assert out.pending_bytes > 0 and sock.writer.writes == []
    sock.writer.writable.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    (write,) = sock.writer.writes  # everything in one write
    assert tokens(write) == [("abcd", 0, 4)]
    assert json.loads(write[1]) == {"type": "pong"}
    assert out.pending_bytes == 0 and merger.merged == 3
    await asyncio.sleep(0.02)  # longer than the window: the stream is not hot
    stream.push("e", 1)  # the socket is idle again: at once, seq goes on
    assert tokens(sock.writer.writes[-1]) == [("e", 4, 1)]


async def test_a_hot_stream_is_held_for_the_window_then_sent_merged() -> None:
    merger = FrameMerger(0.02)
    out, sock, _ = outbound(merger=merger)
    stream = out.token_stream("r1")
    stream.push("a", 1)  # the first token goes at once
    stream.push("b", 1)  # hot: held
    stream.push("c", 1)
    assert [tokens(w) for w in sock.writer.writes] == [[("a", 0, 1)]]
    await asyncio.sleep(0.05)  # the window's tick
    assert [tokens(w) for w in sock.writer.writes] == [[("a", 0, 1)], [("bc", 1, 2)]]
    assert merger.merged == 1


async def test_backpressure_holds_a_stream_until_the_queue_drains() -> None:
    out, sock, _ = outbound(high_water_bytes=1000)
    sock.writer.writable.clear()
    out.put("x" * 2000)
    waiting = asyncio.ensure_future(out.wait_writable())
    await asyncio.sleep(0.01)
    assert out.congested and not waiting.done()
    sock.writer.writable.set()
    await asyncio.wait_for(waiting, 1)
    assert not out.congested


async def test_a_client_that_never_reads_is_cut_off_past_the_limit() -> None:
    out, sock, events = outbound(max_pending_bytes=10_000, high_water_bytes=2_000)
    sock.writer.writable.clear()
    for _ in range(20):
        out.put("x" * 1000)
    assert events == ["overflow"] and out.closed
    out.put("after")  # ignored
    assert sock.writer.writes == []


async def test_close_goes_after_the_queued_frames() -> None:
    out, sock, _ = outbound()
    sock.writer.writable.clear()
    out.put("one")
    out.close(1000, "bye")
    out.put("too late")
    assert sock.closed_with is None
    sock.writer.writable.set()
    await asyncio.sleep(0.01)
    assert sock.writer.writes == [["one"]] and sock.closed_with == (1000, "bye")


@pytest.mark.parametrize(
    ("fault", "reported"),
    [(ValueError("a bug"), ["failure: a bug"]), (ConnectionResetError("gone"), [])],
)
async def test_a_writer_fault_is_reported_and_a_vanished_client_is_not(
    fault: Exception, reported: list[str]
) -> None:
    out, sock, events = outbound()
    sock.writer.writable.clear()
    out.put("one")
    sock.writer.fail = fault
    sock.writer.writable.set()
    await asyncio.sleep(0.01)
    assert out.closed and events == reported
