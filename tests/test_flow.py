"""Heartbeats, idle timeout, and the bounds on what the server holds for a client."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from websockets.frames import Close, Frame, Opcode

from seedance.engines.synthetic import SyntheticEngine
from seedance.server.outbound import Outbound
from tests.support.rawclient import RawClient
from tests.support.servers import RunningServer, one_process_only
from tests.support.ws import open_session, raw_connect, recv_json, wait_closed


async def test_binary_heartbeat_answered(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        for _ in range(3):
            await ws.send(b"\x01\x00")
            assert await asyncio.wait_for(ws.recv(), 5) == b"\x02\x00"


async def test_standard_websocket_ping_answered(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        latency = await asyncio.wait_for(await ws.ping(), 5)
        assert latency >= 0


async def test_json_ping(server: RunningServer) -> None:
    ws, _ = await open_session(server.url)
    async with ws:
        await ws.send(json.dumps({"type": "ping", "id": "x1"}))
        assert await recv_json(ws) == {"type": "pong", "id": "x1"}
        await ws.send(json.dumps({"type": "ping"}))
        assert await recv_json(ws) == {"type": "pong"}


@pytest.mark.slow
@one_process_only("reads the server's connections in its process")
async def test_server_pings_after_silence_and_pongs_keep_it_open(make_server) -> None:  # type: ignore[no-untyped-def]
    """A client that speaks the binary heartbeat (it sent one) is pinged in binary."""
    server = make_server(heartbeat_interval_s=0.2, idle_timeout_s=0.6)
    ws, hello = await open_session(server.url)
    async with ws:
        assert (hello["heartbeat_interval"], hello["idle_timeout"]) == (0.2, 0.6)
        await ws.send(b"\x01\x00")
        assert await asyncio.wait_for(ws.recv(), 2) == b"\x02\x00"
        started = time.monotonic()
        pings = 0
        while time.monotonic() - started < 1.5:  # well past the idle timeout
            data = await asyncio.wait_for(ws.recv(), 2)
            assert data == b"\x01\x00"
            pings += 1
            await ws.send(b"\x02\x00")
        assert pings >= 4
        await ws.send(json.dumps({"type": "ping", "id": 1}))
        assert await recv_json(ws) == {"type": "pong", "id": 1}
        connection = next(iter(server.connections))
        assert connection.last_rtt_s is not None and connection.last_rtt_s < 1


@pytest.mark.slow
async def test_standard_pings_count_as_inbound_traffic(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(heartbeat_interval_s=0.2, idle_timeout_s=0.5)
    ws, _ = await open_session(server.url)
    async with ws:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # three idle timeouts, control frames only
            await asyncio.wait_for(await ws.ping(), 2)
            await asyncio.sleep(0.1)
        await ws.send(json.dumps({"type": "ping", "id": 2}))
        assert await recv_json(ws) == {"type": "pong", "id": 2}


@pytest.mark.slow
async def test_idle_timeout_closes_4408(make_server) -> None:  # type: ignore[no-untyped-def]
    """A client that spoke the binary heartbeat, then answers none (a client that answers
    nothing at all: tests/test_keepalive.py)."""
    server = make_server(heartbeat_interval_s=0.2, idle_timeout_s=0.5)
    async with raw_connect(server.url) as ws:
        await ws.send(b"\x01\x00")
        started = time.monotonic()
        code, seen = await wait_closed(ws)  # reads but never answers the heartbeat
        elapsed = time.monotonic() - started
    assert code == 4408
    assert seen[0]["type"] == "session" and b"\x01\x00" in seen
    assert 0.4 <= elapsed < 3


async def wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.mark.slow
@one_process_only("reads the server's connections in its process")
async def test_slow_reader_stays_bounded_then_is_cut_off(make_server) -> None:  # type: ignore[no-untyped-def]
    # More tokens than the kernel's socket buffers can absorb (up to 4 MiB on Linux).
    engine = SyntheticEngine(context_length=300_000, max_output_tokens=200_000)
    # One frame per token, so that 200,000 tokens are more bytes than the kernel holds.
    server = make_server(engines=[engine], write_timeout_s=2.0, merge_window_ms=0)
    client = RawClient(server.port, rcvbuf=4096)
    server.lock_send_buffers()
    try:
        client.send_json({"prompt": "flood me", "max_tokens": 200_000})  # then never read
        await wait_until(lambda: engine.stats.tokens_generated > 0)
        # Backpressure reaches the engine: its counter stops moving, well before the end.
        last, still_since = -1, time.monotonic()
        while time.monotonic() - still_since < 0.5:
            await asyncio.sleep(0.05)
            count = engine.stats.tokens_generated
            if count != last:
                last, still_since = count, time.monotonic()
        assert last < 200_000
        connection = next(iter(server.connections))
        assert connection.out.pending_bytes <= connection.out.high_water_bytes + 1024
        await wait_until(lambda: not server.connections, timeout=5)  # write timeout
        assert engine.stats.active == 0 and engine.stats.requests_aborted == 1
    finally:
        client.close()


@pytest.mark.slow
@one_process_only("reads the server's connections in its process")
async def test_a_writer_failure_is_logged_and_closes_the_connection_1011(
    make_server,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault in the writer (not the client going away) is an ERROR with the connection and
    request ids, and the connection ends with 1011 instead of hanging."""
    engine = SyntheticEngine(context_length=300_000, max_output_tokens=200_000)
    server = make_server(engines=[engine], merge_window_ms=0)

    def broken(self: Outbound) -> None:
        raise ValueError("a fault in the writer")

    monkeypatch.setattr(Outbound, "_take_all", broken)
    client = RawClient(server.port, rcvbuf=4096)
    try:
        with caplog.at_level(logging.ERROR, logger="seedance.server.connection"):
            request = {"prompt": "flood me", "max_tokens": 200_000, "request_id": "r-writer"}
            client.send_json(request)  # then read nothing for a while: frames queue
            await wait_until(lambda: any(c.out.pending_bytes for c in server.connections))
            close = None
            while close is None:  # now read: the writer runs, and fails
                frame = await asyncio.to_thread(client.recv_frame)
                if frame.opcode == Opcode.CLOSE:
                    close = frame
            assert Close.parse(close.data).code == 1011
            await wait_until(lambda: not server.connections, timeout=5)
        (record,) = [r for r in caplog.records if "the writer failed" in r.getMessage()]
        assert "request r-writer" in record.getMessage() and record.exc_info is not None
        assert "conn c-" in record.getMessage()
    finally:
        client.close()


def flood(client: RawClient, frame: bytes, seconds: float = 30.0) -> float | None:
    """Send ``frame`` (already encoded) over and over, never reading, until the server cuts the
    connection; returns how long that took (``None``: not cut)."""
    client.sock.settimeout(0.5)
    burst = frame * 256
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            client.sock.sendall(burst)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        except TimeoutError:
            continue  # our send buffer is full: the server is not reading now; keep trying
    return None


def encoded(opcode: Opcode, payload: bytes) -> bytes:
    """One client frame as bytes (masked, as clients must)."""
    return Frame(opcode, payload).serialize(mask=True)


@one_process_only("reads the server's connections in its process")
async def test_ping_flood_without_reading_is_cut_off(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(max_pending_bytes=256 * 1024)
    client = RawClient(server.port, rcvbuf=4096)
    try:
        server.lock_send_buffers()
        ping = encoded(Opcode.PING, b"p" * 125)
        took = await asyncio.to_thread(flood, client, ping)
        assert took is not None, "the server kept answering pings nobody reads"
        await wait_until(lambda: not server.connections)
    finally:
        client.close()


@pytest.mark.slow
@one_process_only("reads the server's connections in its process")
async def test_heartbeat_flood_without_reading_is_cut_off(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(max_pending_bytes=256 * 1024)
    client = RawClient(server.port, rcvbuf=4096)
    try:
        server.lock_send_buffers()
        heartbeat = encoded(Opcode.BINARY, b"\x01\x00")
        took = await asyncio.to_thread(flood, client, heartbeat)
        assert took is not None, "the server kept queueing heartbeat pongs nobody reads"
        await wait_until(lambda: not server.connections)
    finally:
        client.close()
