"""HTTP/3 and WebTransport (``--http3``), over real QUIC on UDP: the official ``openai`` package
through an HTTP/3 client, ``/v2/infer`` over a WebTransport session with the same frames as over
a WebSocket, a reply that goes on while the client moves to another port, refusals closing the
session with the WebSocket close code, and the short-lived certificate a server makes for
itself."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from seedance.client import connect
from tests.support.certs import Authority, Issued
from tests.support.h3 import WebTransportClosed, WebTransportSession, h3_connection
from tests.support.servers import RunningServer, ServerProcess, one_process_only

CHAT: dict[str, Any] = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "Tell me about QUIC."}],
    "max_tokens": 24,
    "temperature": 0,
}


@pytest.fixture
def issued(tmp_path: Path) -> tuple[Authority, Issued]:
    authority = Authority(tmp_path)
    return authority, authority.server("server")


def h3_server(
    make_server: Callable[..., RunningServer], issued: tuple[Authority, Issued], **fields: Any
) -> RunningServer:
    _, cert = issued
    return make_server(tls_cert=str(cert.cert), tls_key=str(cert.key), http3=True, **fields)


def load_certificate(path: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


async def frames(session: WebTransportSession) -> list[dict[str, Any]]:
    """The session's text frames up to the first ``done`` or ``error``."""
    out: list[dict[str, Any]] = []
    while not out or out[-1]["type"] not in ("done", "error"):
        message = await asyncio.wait_for(session.recv(), 20)
        if isinstance(message, str):
            out.append(json.loads(message))
    return out


async def test_the_openai_package_streams_over_http3_and_tcp_answers_name_it(
    make_server: Callable[..., RunningServer], issued: tuple[Authority, Issued]
) -> None:
    server = h3_server(make_server, issued)
    authority, _ = issued
    base = f"https://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=authority.pem)) as tcp:
        answer = await tcp.get(f"{base}/healthz")
        assert answer.headers["alt-svc"] == f'h3=":{server.port}"; ma=86400'
        over_tcp = (await tcp.post(f"{base}/v1/chat/completions", json=CHAT)).json()
    async with h3_connection("127.0.0.1", server.port, ca_file=str(authority.pem)) as h3:
        http = httpx.AsyncClient(transport=h3.transport())
        health = await http.get(f"{base}/healthz")
        assert health.status_code == 200 and health.extensions["http_version"] == b"HTTP/3"
        api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", http_client=http)
        whole = await api.chat.completions.create(**CHAT)
        assert whole.choices[0].message.content == over_tcp["choices"][0]["message"]["content"]
        stream = await api.chat.completions.create(**CHAT, stream=True)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices]
        assert len(pieces) > 2  # it streamed
        assert "".join(p or "" for p in pieces) == whole.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            await api.chat.completions.create(**{**CHAT, "model": "nope"})


async def test_v2_infer_over_webtransport_is_the_websocket_protocol(
    make_server: Callable[..., RunningServer], issued: tuple[Authority, Issued]
) -> None:
    server = h3_server(make_server, issued)
    authority, _ = issued
    generate = {"type": "generate", "request_id": "r1", "prompt": "hello there", "max_tokens": 12}
    wss = f"wss://127.0.0.1:{server.port}"
    async with connect(wss, session_id="over-tcp", ca_file=str(authority.pem)) as tcp:
        expected = await tcp.complete("hello there", max_tokens=12)
    async with h3_connection("127.0.0.1", server.port, ca_file=str(authority.pem)) as h3:
        session = await h3.webtransport("/v2/infer?session_id=over-quic")
        hello = json.loads(await asyncio.wait_for(session.recv(), 10))
        assert hello["type"] == "session" and hello["session_id"] == "over-quic"
        await session.send_text(json.dumps(generate))
        got = await frames(session)
        assert got[-1]["type"] == "done" and got[-1]["finish_reason"] == "length"
        text = "".join(f["token"] for f in got if f["type"] == "token")
        assert text == expected.text
        # The binary heartbeat, on the stream and as a datagram: a pong each time, on the stream.
        await session.send_bytes(b"\x01\x00")
        assert await asyncio.wait_for(session.recv(), 10) == b"\x02\x00"
        session.send_datagram(b"\x01\x00")
        assert await asyncio.wait_for(session.recv(), 10) == b"\x02\x00"
        # A second session on the same connection: the session is kept, its context counted.
        again = await h3.webtransport("/v2/infer?session_id=over-quic")
        hello = json.loads(await asyncio.wait_for(again.recv(), 10))
        assert hello["created"] is False and hello["context_turns"] == 2
        await again.close()


async def test_a_reply_goes_on_while_the_client_moves_to_another_port(
    make_server: Callable[..., RunningServer], issued: tuple[Authority, Issued]
) -> None:
    server = h3_server(make_server, issued, tokens_per_s=100)
    authority, _ = issued
    generate = {"type": "generate", "request_id": "m1", "prompt": "go", "max_tokens": 60}
    async with h3_connection("127.0.0.1", server.port, ca_file=str(authority.pem)) as h3:
        session = await h3.webtransport("/v2/infer?session_id=moving")
        await session.recv()  # the session frame
        await session.send_text(json.dumps(generate))
        first = json.loads(await asyncio.wait_for(session.recv(), 10))
        while first["type"] != "token":  # the start frame
            first = json.loads(await asyncio.wait_for(session.recv(), 10))
        before = h3.local_address
        after = await h3.migrate()
        assert after[1] != before[1]
        rest = await frames(session)
        assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "length"
        tokens = [first, *(f for f in rest if f["type"] == "token")]
        assert sum(f.get("n", 1) for f in tokens) == 60
        assert [f["seq"] for f in tokens] == sorted(f["seq"] for f in tokens)
        # The server sees the new address for new requests.
        http = httpx.AsyncClient(transport=h3.transport())
        assert (await http.get(f"https://127.0.0.1:{server.port}/healthz")).status_code == 200


async def test_a_refused_session_closes_with_the_websocket_close_code(
    make_server: Callable[..., RunningServer], issued: tuple[Authority, Issued]
) -> None:
    server = h3_server(make_server, issued)
    authority, _ = issued
    async with h3_connection("127.0.0.1", server.port, ca_file=str(authority.pem)) as h3:
        session = await h3.webtransport("/v2/infer?model=nope")
        error = json.loads(await asyncio.wait_for(session.recv(), 10))
        assert error["type"] == "error" and error["error"]["code"] == "model_not_found"
        assert await asyncio.wait_for(session.closed, 10) == (4404, "model_not_found")
        with pytest.raises(WebTransportClosed):
            await session.recv()
        # A malformed message: kind 7 is no kind; the session closes with 1003.
        bad = await h3.webtransport("/v2/infer")
        await bad.recv()
        await bad.send_raw(b"\x07\x01x")
        code, _ = await asyncio.wait_for(bad.closed, 10)
        assert code == 1003


async def test_without_a_certificate_the_server_makes_a_short_lived_one(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server(http3=True)
    async with httpx.AsyncClient() as tcp:
        offer = (await tcp.get(f"{server.http_url}/v2/webtransport")).json()
    assert offer["offered"] and offer["port"] == server.port
    async with h3_connection("127.0.0.1", server.port, verify=False) as h3:
        certificate = h3.peer_certificate
        http = httpx.AsyncClient(transport=h3.transport())
        reply = await http.get(f"https://127.0.0.1:{server.port}/healthz")
        assert reply.json() == {"status": "ok"}
    # The page's serverCertificateHashes: the hash of the certificate the listener presents.
    der = certificate.public_bytes(serialization.Encoding.DER)
    assert hashlib.sha256(der).hexdigest() == offer["certificate_sha256"]
    public = certificate.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
    lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
    assert lifetime <= datetime.timedelta(days=14)  # what serverCertificateHashes accepts


async def test_a_session_that_only_reads_is_kept_open_by_quic_pings(
    make_server: Callable[..., RunningServer], issued: tuple[Authority, Issued]
) -> None:
    """A reply longer than the idle timeout, then a silence longer than it: the client sends
    nothing but what its QUIC stack answers (a page's WebTransport does no more), and the
    session stays open."""
    server = h3_server(
        make_server, issued, tokens_per_s=8, idle_timeout_s=1.0, heartbeat_interval_s=0.3
    )
    authority, _ = issued
    async with h3_connection("127.0.0.1", server.port, ca_file=str(authority.pem)) as h3:
        session = await h3.webtransport("/v2/infer?session_id=reader")
        await session.recv()
        generate = {"type": "generate", "request_id": "long", "prompt": "go", "max_tokens": 20}
        await session.send_text(json.dumps(generate))
        got = await frames(session)  # 2.5 s: longer than the idle timeout
        assert got[-1]["type"] == "done" and got[-1]["finish_reason"] == "length"
        await asyncio.sleep(2.5)  # silence, past the idle timeout twice
        assert not session.closed.done()
        await session.send_text(json.dumps({**generate, "request_id": "again", "max_tokens": 2}))
        assert (await frames(session))[-1]["type"] == "done"


async def test_shutdown_ends_a_webtransport_reply_whole_then_closes_1001(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--http3", "--synthetic-tokens-per-s", "50")
    await server.logged("HTTP/3 and WebTransport on UDP port")
    async with h3_connection("127.0.0.1", server.port, verify=False) as h3:
        session = await h3.webtransport("/v2/infer")
        await session.recv()
        generate = {"type": "generate", "request_id": "r1", "prompt": "finish", "max_tokens": 40}
        await session.send_text(json.dumps(generate))
        first = json.loads(await asyncio.wait_for(session.recv(), 10))
        server.signal(signal.SIGTERM)
        await server.logged("shutting down")
        rest = await frames(session)
        code, _ = await asyncio.wait_for(session.closed, 20)
    tokens = [f for f in [first, *rest] if f["type"] == "token"]
    assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "length"
    assert sum(f.get("n", 1) for f in tokens) == 40
    assert code == 1001
    assert server.wait() in (0, -signal.SIGTERM)  # uvicorn raises the signal again at its end


@one_process_only("reads what the QUIC listener holds for a client, in its process")
async def test_a_webtransport_client_that_stops_reading_is_cut_off_and_holds_little(
    make_server: Callable[..., RunningServer],
    issued: tuple[Authority, Issued],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client whose QUIC stack goes silent mid-reply (nothing acknowledged): the session's
    sends wait once 256 KiB are held for it, as a WebSocket's do on a full socket, and the
    connection's write timeout cuts it off; the server holds no more than that meanwhile."""
    caplog.set_level("INFO", "seedance")
    # Merging off: a frame per token, so that the reply outgrows the mark before it ends.
    server = h3_server(make_server, issued, write_timeout_s=2.0, merge_window_ms=0)
    authority, _ = issued
    async with h3_connection("127.0.0.1", server.port, ca_file=str(authority.pem)) as h3:
        session = await h3.webtransport("/v2/infer?session_id=silent")
        await session.recv()
        generate = {"type": "generate", "request_id": "big", "prompt": "go", "max_tokens": 16000}
        await session.send_text(json.dumps(generate))
        assert json.loads(await session.recv())["type"] == "start"  # the reply runs
        h3._protocol.datagram_received = lambda data, addr: None  # type: ignore[method-assign]
        listener = server.server.http3
        assert listener is not None
        (connection,) = listener.connections
        (held,) = connection.sessions.values()
        largest = 0
        deadline = asyncio.get_running_loop().time() + 15
        while server.connections and asyncio.get_running_loop().time() < deadline:
            if held.stream_id is not None:
                largest = max(largest, connection.backlog(held.stream_id))
            await asyncio.sleep(0.05)
        assert not server.connections  # cut off
        assert largest <= 2 * 256 * 1024  # what it held: the high-water mark and a frame or so
    assert any("not reading" in r.getMessage() for r in caplog.records)
