"""The stream log and its store, without sockets: replay by index, retention, reasons."""

from __future__ import annotations

from typing import Any

import pytest

from seedance.protocol.errors import HistoryLost, InvalidRequest
from seedance.streams.log import FRAME_BYTES, StreamLog
from seedance.streams.store import MemoryStreamStore


class Reader:
    def __init__(self) -> None:
        self.frames: list[Any] = []

    def on_start(self, frame: str) -> None:
        self.frames.append(("start", frame))

    def on_tokens(self, text: str, tokens: int) -> None:
        self.frames.append((text, tokens))

    def on_end(self, frame: str) -> None:
        self.frames.append(("end", frame))


def logged(*deltas: tuple[str, int]) -> StreamLog:
    log = StreamLog("r", "e", resumable=True, stream=True)
    log.open("S")
    for text, n in deltas:
        log.append(text, n)
    return log


def test_a_late_reader_gets_what_it_lacks_then_the_rest_live() -> None:
    log = logged(("a", 1), ("bc", 2), ("d", 1))  # tokens 0 | 1 2 | 3
    reader = Reader()
    log.attach(reader, after_seq=0)
    assert reader.frames == [("start", "S"), ("bcd", 3)]
    log.append("e", 1)
    log.close("D", now=1.0)
    assert reader.frames[2:] == [("e", 1), ("end", "D")] and log.readers == []
    assert log.missing(-1) == ("abcde", 5) and log.missing(4) is None
    with pytest.raises(InvalidRequest, match="falls inside a token frame"):
        log.missing(1)  # token 1 came with token 2 in one frame
    with pytest.raises(HistoryLost) as lost:
        log.attach(Reader(), after_seq=5)
    assert lost.value.reason == "cursor_ahead"


def test_a_reply_that_is_not_streamed_hands_over_only_the_end() -> None:
    log = StreamLog("r", "e", resumable=True, stream=False)
    reader = Reader()
    log.attach(reader)
    log.open("S")
    log.append("a", 1)
    log.close("D", now=1.0)
    assert reader.frames == [("start", "S"), ("end", "D")]


def test_the_store_keeps_resumable_logs_for_the_window_and_says_why_they_went() -> None:
    now = [0.0]
    store = MemoryStreamStore(window_s=10, max_bytes_per_tenant=1000, clock=lambda: now[0])
    plain = store.open("t", "s1", "a", resumable=False, stream=True)
    assert store.current("t", "s1") is plain  # running: readable by a second reader
    plain.close("D", now[0])
    store.ended("t", "s1", plain)
    assert store.current("t", "s1") is None
    with pytest.raises(HistoryLost, match="never ran here") as lost:
        store.lookup("t", "s1", "a", store.epoch)
    assert lost.value.reason == "expired"

    kept = store.open("t", "s1", "b", resumable=True, stream=True)
    kept.append("x" * 30, 1)
    kept.close("D", now[0])
    store.ended("t", "s1", kept)
    assert store.lookup("t", "s1", "b", None) is kept
    assert store.bytes_of("t") == FRAME_BYTES + 30  # the end frame and the text
    with pytest.raises(HistoryLost) as lost:
        store.lookup("t", "s1", "b", "another epoch")
    assert lost.value.reason == "epoch_changed"
    now[0] = 10.5
    with pytest.raises(HistoryLost) as lost:
        store.lookup("t", "s1", "b", None)
    assert lost.value.reason == "expired" and store.bytes_of("t") == 0


def test_the_tenant_byte_cap_drops_the_oldest_ended_logs() -> None:
    each = FRAME_BYTES + 39
    store = MemoryStreamStore(window_s=60, max_bytes_per_tenant=2 * each + 1, clock=lambda: 0.0)
    for i in range(4):
        log = store.open("t", f"s{i}", f"r{i}", resumable=True, stream=True)
        log.append("x" * 39, 1)
        log.close("D", 0.0)
        store.ended("t", f"s{i}", log)
    other = store.open("u", "s0", "u0", resumable=True, stream=True)
    other.close("D", 0.0)
    store.ended("u", "s0", other)
    with pytest.raises(HistoryLost) as lost:
        store.lookup("t", "s0", "r0", None)
    assert lost.value.reason == "trimmed"
    with pytest.raises(HistoryLost):
        store.lookup("t", "s1", "r1", None)
    assert store.lookup("t", "s3", "r3", None).request_id == "r3"
    assert store.bytes_of("t") == 2 * each and store.lookup("u", "s0", "u0", None) is other
