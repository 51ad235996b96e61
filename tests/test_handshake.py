"""Connections that do not finish their request: timed out, capped, answered, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from typing import Any

import pytest

from tests.support.servers import RunningServer, ServerProcess, one_process_only
from tests.support.waits import eventually
from tests.support.ws import open_session

UPGRADE = (
    "GET /v2/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _answer(reader: asyncio.StreamReader, timeout: float = 10) -> tuple[int, dict[str, Any]]:
    """Read a whole HTTP response up to EOF: (status, JSON body)."""
    data = await asyncio.wait_for(reader.read(), timeout)
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


@pytest.mark.slow
async def test_a_connection_that_sends_nothing_gets_408(make_server: Any) -> None:
    server: RunningServer = make_server(handshake_timeout_s=0.5)
    reader, writer = await _open(server.port)
    started = time.monotonic()
    status, body = await _answer(reader)
    assert status == 408 and body["error"]["code"] == "invalid_request"
    assert "did not arrive within 0.5 s" in body["error"]["message"]
    assert 0.4 < time.monotonic() - started < 5
    writer.close()


@pytest.mark.slow
async def test_headers_sent_a_byte_at_a_time_still_time_out(make_server: Any) -> None:
    server: RunningServer = make_server(handshake_timeout_s=1.0)
    reader, writer = await _open(server.port)
    started = time.monotonic()

    async def trickle() -> None:  # a byte every 50 ms: the whole upgrade would take 8 s
        with contextlib.suppress(OSError):
            for byte in UPGRADE.encode():
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)

    slow = asyncio.create_task(trickle())
    status, _ = await _answer(reader)
    assert status == 408
    assert time.monotonic() - started < 3
    slow.cancel()
    writer.close()


@pytest.mark.slow
async def test_the_next_request_on_a_kept_alive_connection_is_timed_too(make_server: Any) -> None:
    server: RunningServer = make_server(handshake_timeout_s=0.5)
    reader, writer = await _open(server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    sizes = [h[15:] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
    await reader.readexactly(int(sizes[0]))
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
    status, _ = await _answer(reader)
    assert status == 408
    writer.close()


@pytest.mark.slow
@one_process_only("reads the server's handshake counts in its process")
async def test_connections_still_sending_headers_are_capped_per_address(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # 127.0.0.1 is trusted as a proxy by default, and a proxy is not capped per address.
    server: RunningServer = make_server(max_handshakes_per_address=3, trusted_proxies=())
    idle = [await _open(server.port) for _ in range(3)]
    await eventually(lambda: server.handshakes.total == 3)
    with caplog.at_level(logging.WARNING, logger="seedance.server.handshake"):
        for _ in range(5):
            reader, writer = await _open(server.port)
            status, body = await _answer(reader)
            assert status == 503 and body["error"]["code"] == "overloaded"
            writer.close()
    refusals = [r for r in caplog.records if "connection refused" in r.getMessage()]
    assert len(refusals) == 1  # a flood writes one line ...
    assert "3 connections from 127.0.0.1" in refusals[0].getMessage()
    for _, writer in idle:
        writer.close()
    await eventually(lambda: server.handshakes.total == 0)
    ws, session = await open_session(server.url)  # ... and the address is served again
    async with ws:
        assert session["type"] == "session"


@one_process_only("reads the server's handshake counts in its process")
async def test_a_trusted_proxy_is_held_to_the_total_cap_only(make_server: Any) -> None:
    server: RunningServer = make_server(
        max_handshakes_per_address=2, max_handshakes=5, trusted_proxies=("127.0.0.0/8",)
    )
    idle = [await _open(server.port) for _ in range(5)]  # a balancer's many clients
    await eventually(lambda: server.handshakes.total == 5)
    reader, writer = await _open(server.port)
    status, _ = await _answer(idle[0][0])  # the total cap still holds: the oldest goes
    assert status == 503
    assert server.handshakes.total == 5
    for _, w in [*idle, (reader, writer)]:
        w.close()
    await eventually(lambda: server.handshakes.total == 0)


@pytest.mark.parametrize(
    ("trusted", "peer"), [(("127.0.0.1",), "198.51.100.7:"), ((), "127.0.0.1:")]
)
@one_process_only("reads the server's log records in the test's process")
async def test_the_client_address_comes_from_a_trusted_proxys_forwarded_header(
    make_server: Any, caplog: pytest.LogCaptureFixture, trusted: tuple[str, ...], peer: str
) -> None:
    server: RunningServer = make_server(trusted_proxies=trusted)
    forwarded = {"X-Forwarded-For": "198.51.100.7"}
    with caplog.at_level(logging.INFO, logger="seedance.server.connection"):
        ws, _ = await open_session(server.url, additional_headers=forwarded)
        await ws.close()
        await eventually(lambda: any("conn " in r.getMessage() for r in caplog.records))
    opened = next(r.getMessage() for r in caplog.records if " open peer=" in r.getMessage())
    assert f" open peer={peer}" in opened


@pytest.mark.slow
@one_process_only("reads the server's handshake counts in its process")
async def test_connections_still_sending_headers_are_capped_in_all_the_oldest_going(
    make_server: Any,
) -> None:
    """At the cap in all, the oldest connection still sending headers is answered 503 and
    closed, and the new one is let in: a real client, which sends its headers at once, is
    never locked out by silent ones."""
    server: RunningServer = make_server(max_handshakes=2)
    idle = [await _open(server.port) for _ in range(2)]
    await eventually(lambda: server.handshakes.total == 2)
    ws, hello = await open_session(server.url)  # a third: the oldest silent one goes
    async with ws:
        assert hello["type"] == "session"
    status, body = await _answer(idle[0][0])
    assert status == 503 and body["error"]["code"] == "overloaded"
    assert not idle[1][1].is_closing() and server.handshakes.total == 1
    for _, w in idle:
        w.close()


async def test_headers_over_the_limit_get_431_at_once(make_server: Any) -> None:
    server: RunningServer = make_server(max_header_bytes=4096)
    reader, writer = await _open(server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000)
    status, body = await _answer(reader, timeout=5)
    assert status == 431 and "exceed 4096 bytes" in body["error"]["message"]
    writer.close()


async def test_a_websocket_upgrade_with_a_header_line_over_8_kib_gets_431(make_server: Any) -> None:
    # Within the server's 16 KiB of headers, over the WebSocket library's 8 KiB per line (a
    # long JWT, say): an answer at once, not a connection left hanging.
    server: RunningServer = make_server()
    reader, writer = await _open(server.port)
    token = "x" * 9000
    writer.write(f"{UPGRADE}Authorization: Bearer {token}\r\n\r\n".encode())
    status, body = await _answer(reader, timeout=5)
    assert status == 431 and body["error"]["code"] == "invalid_request"
    writer.close()


@pytest.mark.subprocess
async def test_shutdown_with_half_open_handshakes_exits_cleanly(server_process: Any) -> None:
    server: ServerProcess = server_process()
    refused_reader, refused_writer = await _open(server.port)
    refused_writer.write(f"{UPGRADE}Authorization: Bearer {'x' * 9000}\r\n\r\n".encode())
    status, _ = await _answer(refused_reader, timeout=5)
    assert status == 431
    _, half = await _open(server.port)
    half.write(UPGRADE.encode())  # the headers never end
    await half.drain()
    await asyncio.sleep(0.3)
    server.signal(signal.SIGTERM)
    assert server.wait(timeout=20) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert "stopped" in server.output
    assert "Traceback" not in server.output
    half.close()
