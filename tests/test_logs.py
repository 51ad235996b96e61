"""Log lines a client cannot forge or flood."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import jwt
import pytest

from tests.support.rawclient import RawClient
from tests.support.servers import RunningServer, ServerProcess, one_process_only
from tests.support.ws import open_session, recv_json


@pytest.mark.subprocess
async def test_a_newline_in_a_jwt_claim_cannot_forge_a_log_line(
    tmp_path: Path, server_process: Any
) -> None:
    secret = "s3cret-s3cret-s3cret-s3cret-s3cret!"
    config = tmp_path / "s.toml"
    config.write_text(f'[tenants.acme]\n[auth.jwt]\nsecret = "{secret}"\n')
    server: ServerProcess = server_process("--config", str(config))
    forged = "alice\n2026-12-01 00:00:00,000 INFO seedance: FORGED \x1b[2J"
    claims = {"tenant": "acme", "sub": forged, "exp": int(time.time()) + 60}
    token = jwt.encode(claims, secret, "HS256")
    ws, _ = await open_session(server.url, additional_headers={"Authorization": f"Bearer {token}"})
    async with ws:
        await ws.send('{"type": "ping", "id": 1}')
        await recv_json(ws)
    server.stop()
    lines = server.output.splitlines()
    assert not any(line.startswith("2026-12-01 00:00:00,000") for line in lines)
    opened = [line for line in lines if "credential=jwt:alice" in line]
    assert opened and "alice\\x0a2026-12-01" in opened[0] and "\\x1b[2J" in opened[0]


@pytest.mark.slow
@one_process_only("reads the server's connections in its process")
def test_a_control_ping_flood_writes_one_warning(
    make_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server: RunningServer = make_server(max_pending_bytes=65536)
    client = RawClient(server.port, rcvbuf=4096)  # reads nothing: the pongs pile up
    server.lock_send_buffers()
    with caplog.at_level(logging.WARNING, logger="seedance.server.uvicorn_ws"):
        for _ in range(50_000):  # 6 MB of pongs to write
            client.proto.send_ping(b"p" * 125)
        with contextlib.suppress(OSError):  # cut off: the server dropped the connection
            client.flush()
        deadline = time.monotonic() + 5
        while not any("pongs unread" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the flood was never cut off"
            time.sleep(0.05)
        time.sleep(0.3)
    client.close()
    warnings = [r for r in caplog.records if "pongs unread" in r.getMessage()]
    assert len(warnings) == 1
