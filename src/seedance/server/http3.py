"""HTTP/3 and WebTransport over QUIC (``--http3``), beside the TCP listener, on the same port
number over UDP and with the same certificate (aioquic).

The one ASGI application serves both listeners:

- **HTTP/3 requests** reach it as ASGI ``http`` scopes (``http_version`` ``"3"``): the OpenAI
  APIs, Server-Sent Events, the Open Inference Protocol, health and metrics, unchanged.
- **A WebTransport session** (an extended CONNECT with ``:protocol`` ``webtransport``) on
  ``/v2/infer`` reaches it as an ASGI ``websocket`` scope, so the same sessions, resume, QoS,
  quotas, audit and end-to-end encryption hold. Its messages travel on the first bidirectional
  stream the client opens in the session, each as one byte of kind (``0`` text, ``1``
  binary), its length as a QUIC variable-length integer, and its bytes (docs/protocol.md,
  section 11). The server's keepalive pings are QUIC PING frames, which every QUIC stack
  acknowledges by itself (the WebSocket control ping's part); a client's binary heartbeat may
  also come as a datagram. A close is a ``CLOSE_WEBTRANSPORT_SESSION`` capsule with the close
  code and reason a WebSocket close would carry.

A QUIC connection is identified by its connection ids, not its address, so a client that
moves to another address or port keeps its connection and its streams (migration): the ASGI
scope's ``client`` is the address at the time the request began.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from aioquic._buffer import Buffer, BufferReadError  # aioquic.buffer's, typed
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import (
    DatagramReceived,
    DataReceived,
    H3Event,
    HeadersReceived,
    WebTransportStreamDataReceived,
)
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    PingAcknowledged,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from aioquic.tls import SessionTicket
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from seedance.server.transport import QUIC_EXTENSION, TRANSPORT_EXTENSION

logger = logging.getLogger(__name__)

App = Callable[..., Any]

#: The capsule that closes a WebTransport session (draft-ietf-webtrans-http3).
CLOSE_SESSION_CAPSULE = 0x2843
#: The message kinds on a session's stream: a frame, and the close (code and reason).
TEXT, BINARY, CLOSE = 0, 1, 2
#: The protocol's binary heartbeat frame type (docs/protocol.md, section 4): what a datagram
#: may carry.
_HEARTBEAT = 0x01
#: The type that opens a WebTransport bidirectional stream (a session's id follows).
_WT_STREAM = 0x41
#: How long a closing session's last frames wait for the client to open its stream, seconds.
_STREAM_WAIT_S = 5.0
#: How long the session's capsule waits after the client acknowledged its stream's close.
_CLOSE_GRACE_S = 0.1
#: Bytes a stream (a WebTransport session's, a streamed response's) may hold for a client
#: before its writer waits.
_HIGH_WATER = 256 * 1024
#: Session tickets kept for resumption (the oldest forgotten first).
_MAX_TICKETS = 10_000
#: H3_REQUEST_CANCELLED: how a session's streams are reset when it is dropped.
_CANCELLED = 0x10C
#: The longest a message on a session's stream may be (the app checks its own limit).
_MAX_MESSAGE = 64 * 1024 * 1024
#: Hop-by-hop headers HTTP/3 forbids (RFC 9114, section 4.2).
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"})


def alt_svc(port: int) -> tuple[str, str]:
    """The ``Alt-Svc`` header that tells HTTP/1.1 clients of the HTTP/3 listener."""
    return ("alt-svc", f'h3=":{port}"; ma=86400')


@dataclass(frozen=True)
class LocalCertificate:
    """A short-lived self-signed ECDSA P-256 certificate for local HTTP/3 (what a browser takes
    through WebTransport's ``serverCertificateHashes``: at most 14 days), and its SHA-256."""

    cert: str
    key: str
    sha256: str

    @classmethod
    def make(cls, host: str, days: int = 13) -> LocalCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host or "localhost")])
        now = datetime.datetime.now(datetime.timezone.utc)
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        if host and host not in ("localhost", "0.0.0.0", "::"):
            names.append(x509.DNSName(host))
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(key, hashes.SHA256())
        )
        folder = tempfile.mkdtemp(prefix="seedance-h3-")
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        with open(cert_path, "wb") as fh:
            fh.write(certificate.public_bytes(serialization.Encoding.PEM))
        with open(os.open(key_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as fh:
            fh.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        digest = hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER))
        return cls(cert_path, key_path, digest.hexdigest())


class Http3Listener:
    """The QUIC listener: HTTP/3 requests and WebTransport sessions into ``app``."""

    def __init__(self, app: App, cert: str, key: str, max_message: int = _MAX_MESSAGE) -> None:
        self.app = app
        self.max_message = max_message
        self.configuration = QuicConfiguration(
            is_client=False,
            alpn_protocols=H3_ALPN,
            max_datagram_frame_size=65536,
            idle_timeout=60.0,
            congestion_control_algorithm="cubic",  # as Linux's TCP: Reno halves on every loss
        )
        self.load(cert, key)
        self.connections: set[_QuicConnection] = set()
        self.accepting = True
        # TLS session tickets given out, each taken back once (a resumed handshake, 0-RTT).
        self._tickets: collections.OrderedDict[bytes, SessionTicket] = collections.OrderedDict()
        self._server: QuicServer | None = None

    def load(self, cert: str, key: str) -> None:
        """Serve new connections with this certificate chain and key (open ones keep theirs)."""
        self.configuration.load_cert_chain(cert, key)

    async def start(self, host: str, port: int) -> None:
        self._server = await serve(
            host,
            port,
            configuration=self.configuration,
            create_protocol=self._protocol,
            session_ticket_fetcher=self._take_ticket,
            session_ticket_handler=self._keep_ticket,
        )

    def _take_ticket(self, label: bytes) -> SessionTicket | None:
        """A ticket, once: the same ticket again gets a full handshake (0-RTT replayed)."""
        return self._tickets.pop(label, None)

    def _keep_ticket(self, ticket: SessionTicket) -> None:
        self._tickets[ticket.ticket] = ticket
        while len(self._tickets) > _MAX_TICKETS:
            self._tickets.popitem(last=False)

    def _protocol(self, *args: Any, **kwargs: Any) -> _QuicConnection:
        return _QuicConnection(self, *args, **kwargs)

    def stop_accepting(self) -> None:
        """Refuse new connections (open ones go on: one UDP socket carries them all)."""
        self.accepting = False

    def close(self) -> None:
        """Stop taking connections and close the open ones (their requests see a disconnect)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self.connections):
            connection.close()


class _QuicConnection(QuicConnectionProtocol):
    """One client's QUIC connection: its HTTP/3 requests and WebTransport sessions."""

    def __init__(self, listener: Http3Listener, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.listener = listener
        self.h3: H3Connection | None = None
        self.requests: dict[int, _Request] = {}
        self.sessions: dict[int, _Session] = {}
        self.session_of_stream: dict[int, _Session] = {}
        self.pings: dict[int, _Session] = {}
        #: Set (and replaced) when datagrams came or the connection ended: what a writer
        #: waiting for the client's acknowledgements looks again at (:meth:`acknowledged`).
        self._heard = asyncio.Event()
        self._waiting = 0  # writers waiting on it
        self.tasks: set[asyncio.Task[None]] = set()
        self._flushing = False
        listener.connections.add(self)

    @property
    def client(self) -> tuple[str, int] | None:
        paths = self._quic._network_paths
        if not paths:
            return None
        host, port = paths[0].addr[:2]
        return str(host), int(port)

    @property
    def server(self) -> tuple[str, int] | None:
        transport = self._transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        return (str(sockname[0]), int(sockname[1])) if sockname else None

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        if self._waiting:  # acknowledgements may have come
            self.wake()

    def wake(self) -> None:
        """Have every writer that waits look again (:meth:`acknowledged`)."""
        self._heard.set()
        self._heard = asyncio.Event()

    async def acknowledged(self, ready: Callable[[], bool]) -> None:
        """Return once ``ready()`` holds, looked at again as datagrams come from the client
        (its acknowledgements), or a stream or the connection ends (:meth:`wake`)."""
        self._waiting += 1
        try:
            while not ready():
                await self._heard.wait()
        finally:
            self._waiting -= 1

    def backlog(self, stream_id: int) -> int:
        """Bytes stream ``stream_id`` holds for the client: sent and not acknowledged, or not
        sent yet (its flow control, the congestion window)."""
        stream = self._quic._streams.get(stream_id)
        return len(stream.sender._buffer) if stream is not None else 0

    async def drained(self, stream_id: int, gone: Callable[[], bool]) -> None:
        """When stream ``stream_id`` holds more than :data:`_HIGH_WATER` bytes for the client,
        wait until it holds half that (or ``gone()``): a writer waits as on a full socket, so
        what the server holds for a client that does not read stays bounded, and the writer's
        own bounds (a WebSocket connection's write timeout) see it."""
        if not gone() and self.backlog(stream_id) > _HIGH_WATER:
            await self.acknowledged(lambda: gone() or self.backlog(stream_id) <= _HIGH_WATER // 2)

    def repeat(self, copies: int) -> None:
        """Send each datagram of this connection ``copies`` times from now on (a relay link
        that asked for it: :mod:`seedance.relay.copies`)."""
        from seedance.relay.copies import repeat

        repeat(self, copies)

    def flush_soon(self) -> None:
        """Send what was written at the end of this turn of the loop: what many streams write
        in one turn (a token for each of many replies) leaves in as few packets as it fits."""
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        self.transmit()

    def run(self, coroutine: Any, name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            if not self.listener.accepting:  # shutting down
                self.close(error_code=0x100, reason_phrase="server shutting down")
                return
            if event.alpn_protocol in H3_ALPN:
                self.h3 = H3Connection(self._quic, enable_webtransport=True)
        elif isinstance(event, ConnectionTerminated):
            self.listener.connections.discard(self)
            self.wake()
            for request in self.requests.values():
                request.disconnect()
            for session in list(self.sessions.values()):
                session.ended("connection closed")
            return
        elif isinstance(event, PingAcknowledged):
            pinged = self.pings.pop(event.uid, None)
            if pinged is not None:
                pinged.pong()
        elif isinstance(event, (StreamReset, StopSendingReceived)):
            self._reset(event.stream_id)
        elif isinstance(event, StreamDataReceived) and self.h3 is not None:
            self._bind(event)
        if self.h3 is not None:
            for h3_event in self.h3.handle_event(event):
                self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            headers = event.headers
            pseudo = {k: v for k, v in headers if k.startswith(b":")}
            if pseudo.get(b":method") == b"CONNECT" and pseudo.get(b":protocol") == b"webtransport":
                self._session(event.stream_id, pseudo, headers)
            elif event.stream_id not in self.requests:
                request = _Request(self, event.stream_id, pseudo, headers)
                self.requests[event.stream_id] = request
                if event.stream_ended:
                    request.body(b"", ended=True)
                self.run(request.serve(), f"h3-request-{event.stream_id}")
        elif isinstance(event, DataReceived):
            body_of = self.requests.get(event.stream_id)
            if body_of is not None:
                body_of.body(event.data, ended=event.stream_ended)
            session = self.sessions.get(event.stream_id)
            if session is not None:
                session.connect_stream_data(event.data, event.stream_ended)
        elif isinstance(event, WebTransportStreamDataReceived):
            session = self.sessions.get(event.session_id)
            if session is not None:
                session.stream_data(event.stream_id, event.data, event.stream_ended)
        elif isinstance(event, DatagramReceived):
            session = self.sessions.get(event.stream_id)
            if session is not None:
                session.datagram(event.data)

    def _bind(self, event: StreamDataReceived) -> None:
        """A client's new bidirectional stream that opens with a WebTransport stream header
        (``0x41``, the session's id) is that session's message stream. aioquic reports the
        stream only when data follows the header, and the client may send none before the
        server's first message, so the header is read here."""
        stream_id = event.stream_id
        if stream_id % 4 or stream_id in self.requests or stream_id in self.session_of_stream:
            return
        reader = Buffer(data=event.data[:16])
        try:
            if reader.pull_uint_var() != _WT_STREAM:
                return
            session = self.sessions.get(reader.pull_uint_var())
        except BufferReadError:
            return
        if session is not None:
            session.bind(stream_id)

    def _session(self, stream_id: int, pseudo: dict[bytes, bytes], headers: Any) -> None:
        session = _Session(self, stream_id, pseudo, headers)
        self.sessions[stream_id] = session
        self.run(session.serve(), f"webtransport-{stream_id}")

    def _reset(self, stream_id: int) -> None:
        request = self.requests.pop(stream_id, None)
        if request is not None:
            request.disconnect()
        session = self.sessions.get(stream_id) or self.session_of_stream.get(stream_id)
        if session is not None:
            session.ended("the client reset the stream")
        self.wake()  # a writer of the stream stops waiting: it is gone


def _scope(
    connection: _QuicConnection, kind: str, pseudo: dict[bytes, bytes], headers: Any
) -> dict[str, Any]:
    """The ASGI scope of a request on ``connection`` (``kind``: ``http``, or ``websocket`` for
    a WebTransport session): its path and query, its headers with the authority as ``host``
    and no pseudo-headers, the addresses as they are now."""
    raw_path, _, query = pseudo.get(b":path", b"/").partition(b"?")
    scope_headers = [(b"host", pseudo.get(b":authority", b""))]
    scope_headers += [(k, v) for k, v in headers if not k.startswith(b":") and k != b"host"]
    return {
        "type": kind,
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "3",
        "scheme": "https" if kind == "http" else "wss",
        "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": scope_headers,
        "client": connection.client,
        "server": connection.server,
        # The connection's own controls, for an endpoint that owns a link (the relay's).
        "extensions": {QUIC_EXTENSION: {"repeat": connection.repeat}},
    }


class _Request:
    """One HTTP/3 request, served as an ASGI ``http`` scope."""

    def __init__(
        self, connection: _QuicConnection, stream_id: int, pseudo: dict[bytes, bytes], headers: Any
    ) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.scope = _scope(connection, "http", pseudo, headers)
        self.scope["method"] = pseudo.get(b":method", b"GET").decode()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ended = False  # the response was sent whole, or the stream is gone
        self._status: int | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._sent = False  # the response's headers went out

    def body(self, data: bytes, *, ended: bool) -> None:
        self.events.put_nowait({"type": "http.request", "body": data, "more_body": not ended})

    def disconnect(self) -> None:
        self.ended = True
        self.events.put_nowait({"type": "http.disconnect"})

    async def receive(self) -> dict[str, Any]:
        return await self.events.get()

    async def send(self, message: dict[str, Any]) -> None:
        h3 = self.connection.h3
        if self.ended or h3 is None:
            return
        if message["type"] == "http.response.start":
            self._status = message["status"]
            self._headers = [
                (bytes(k).lower(), bytes(v))
                for k, v in message.get("headers", ())
                if bytes(k).lower() not in _HOP_BY_HOP
            ]
            return
        if message["type"] != "http.response.body":
            return
        if self._status is not None:
            status = [(b":status", str(self._status).encode())]
            h3.send_headers(self.stream_id, status + self._headers)
            self._status = None
            self._sent = True
        more = bool(message.get("more_body", False))
        h3.send_data(self.stream_id, bytes(message.get("body", b"")), end_stream=not more)
        if not more:
            self.ended = True
        self.connection.flush_soon()
        if more:  # a stream (SSE, the relay's lines): held to what the client takes
            await self.connection.drained(self.stream_id, lambda: self.ended)

    async def serve(self) -> None:
        try:
            await self.connection.listener.app(self.scope, self.receive, self.send)
        except Exception:
            logger.exception("HTTP/3 request %s failed", self.scope["path"])
            if not self._sent:  # nothing answered yet: a 500; else the stream is cut
                await self.send({"type": "http.response.start", "status": 500, "headers": []})
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            elif not self.ended:
                with contextlib.suppress(Exception):
                    self.connection._quic.reset_stream(self.stream_id, _CANCELLED)
                self.connection.transmit()
        finally:
            self.connection.requests.pop(self.stream_id, None)


class _Session:
    """One WebTransport session, served as an ASGI ``websocket`` scope."""

    def __init__(
        self, connection: _QuicConnection, session_id: int, pseudo: dict[bytes, bytes], headers: Any
    ) -> None:
        self.connection = connection
        self.session_id = session_id
        protocols = [
            p.strip().decode()
            for k, v in headers
            if k in (b"sec-websocket-protocol", b"wt-available-protocols")
            for p in v.split(b",")
            if p.strip()
        ]
        self.scope = _scope(connection, "websocket", pseudo, headers)
        self.scope["subprotocols"] = [p.strip('"') for p in protocols]
        self.scope["extensions"][TRANSPORT_EXTENSION] = {
            "ping": self.ping,
            "set_pong_handler": self._set_pong_handler,
            "last_control_frame_at": lambda: self._last_control,
            "abort": self.abort,
        }
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.events.put_nowait({"type": "websocket.connect"})
        self.stream_id: int | None = None  # the client's first bidirectional stream
        self.accepted = False
        self.closed = False
        self._inbound = bytearray()
        self._pending: list[bytes] = []  # what was sent before the client opened its stream
        self._bound = asyncio.Event()
        self._close_code = 1011  # the close if the app ends without one: an internal error
        self._closing = False
        self._pong: Callable[[], None] | None = None
        self._last_control: float = 0.0

    # ------------------------------------------------------------------ from the client

    def bind(self, stream_id: int) -> None:
        """The client's first bidirectional stream carries the session's messages."""
        if self.stream_id is None:
            self.stream_id = stream_id
            self.connection.session_of_stream[stream_id] = self
            self._flush_pending()
            self._bound.set()

    def stream_data(self, stream_id: int, data: bytes, ended: bool) -> None:
        if stream_id % 4 == 0:  # client-initiated, bidirectional
            self.bind(stream_id)
        if stream_id != self.stream_id or self.closed:
            return
        self._inbound += data
        self._read_messages()
        if ended:
            self.ended("the client ended the session's stream")

    def _read_messages(self) -> None:
        buffer = self._inbound
        while buffer:
            reader = Buffer(data=bytes(buffer[:9]))
            try:
                kind = reader.pull_uint8()
                length = reader.pull_uint_var()
            except BufferReadError:
                return  # the header is not all here yet
            if kind not in (TEXT, BINARY) or length > self.connection.listener.max_message:
                self._refuse(1003 if kind not in (TEXT, BINARY) else 1009)
                return
            start = reader.tell()
            if len(buffer) < start + length:
                return
            payload = bytes(buffer[start : start + length])
            del buffer[: start + length]
            if kind == TEXT:
                try:
                    text = payload.decode()
                except UnicodeDecodeError:
                    self._refuse(1007)
                    return
                self.events.put_nowait({"type": "websocket.receive", "text": text})
            else:
                self.events.put_nowait({"type": "websocket.receive", "bytes": payload})

    def _refuse(self, code: int) -> None:
        """A malformed message: the app is told the client is gone, and the session closes
        with ``code`` when the app has ended."""
        self._close_code = code
        self.events.put_nowait({"type": "websocket.disconnect", "code": code})

    def connect_stream_data(self, data: bytes, ended: bool) -> None:
        """Capsules on the CONNECT stream: the client's close, or its end."""
        if ended or self._close_capsule(data):
            self.ended("the client closed the session")

    @staticmethod
    def _close_capsule(data: bytes) -> bool:
        reader = Buffer(data=data)
        try:
            while not reader.eof():
                kind = reader.pull_uint_var()
                reader.pull_bytes(reader.pull_uint_var())
                if kind == CLOSE_SESSION_CAPSULE:
                    return True
        except BufferReadError:
            pass
        return False

    def datagram(self, data: bytes) -> None:
        if data[:1] == bytes([_HEARTBEAT]) and not self.closed:  # a heartbeat, unreliably
            self.events.put_nowait({"type": "websocket.receive", "bytes": data})

    def ended(self, why: str) -> None:
        if self.closed:
            return
        self._closing = True
        self.closed = True
        logger.debug("WebTransport session %d ended: %s", self.session_id, why)
        self.events.put_nowait({"type": "websocket.disconnect", "code": 1006})
        self._forget()

    def _forget(self) -> None:
        self.connection.sessions.pop(self.session_id, None)
        if self.stream_id is not None:
            self.connection.session_of_stream.pop(self.stream_id, None)
        self.connection.wake()  # a send that waits ends: the session is gone

    # ------------------------------------------------------------------ to the client

    async def receive(self) -> dict[str, Any]:
        return await self.events.get()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        h3 = self.connection.h3
        if h3 is None or self.closed:
            return
        if kind == "websocket.accept":
            headers = [(b":status", b"200"), (b"sec-webtransport-http3-draft", b"draft02")]
            protocol = message.get("subprotocol")
            if protocol:
                headers.append((b"sec-websocket-protocol", protocol.encode()))
                headers.append((b"wt-protocol", f'"{protocol}"'.encode()))
            h3.send_headers(self.session_id, headers)
            self.accepted = True
        elif kind == "websocket.send":
            text = message.get("text")
            if text is not None:
                self._write(TEXT, text.encode())
            else:
                self._write(BINARY, bytes(message.get("bytes") or b""))
            self.connection.flush_soon()
            if self.stream_id is not None:
                await self.connection.drained(self.stream_id, lambda: self.closed)
            return
        elif kind == "websocket.close":
            await self._close(int(message.get("code", 1000)), message.get("reason") or "")
            return
        elif kind == "websocket.http.response.start":
            status = str(message["status"]).encode()
            h3.send_headers(self.session_id, [(b":status", status)])
            self.accepted = True
        elif kind == "websocket.http.response.body":
            more = bool(message.get("more_body", False))
            h3.send_data(self.session_id, bytes(message.get("body", b"")), end_stream=not more)
            if not more:
                self._finish()
        self.connection.flush_soon()

    def _write(self, kind: int, payload: bytes) -> None:
        message = bytes([kind]) + encode_uint_var(len(payload)) + payload
        if self.stream_id is None:
            self._pending.append(message)
        else:
            self._quic_send(message)

    def _quic_send(self, data: bytes, end: bool = False) -> None:
        assert self.stream_id is not None
        self.connection._quic.send_stream_data(self.stream_id, data, end)

    def _flush_pending(self) -> None:
        for message in self._pending:
            self._quic_send(message)
        self._pending.clear()
        self.connection.transmit()

    async def _close(self, code: int, reason: str) -> None:
        """Close as a WebSocket closes: after the frames sent, in order. The close goes on the
        stream (a ``close`` message, then its end) and, once the client has it, as the
        session's capsule: a browser drops what a page has not read yet of a stream when its
        session closes, so the capsule waits for the stream's end to be acknowledged and a
        moment more (a client that read the close may end the session first)."""
        h3 = self.connection.h3
        if self.closed or self._closing or h3 is None:
            return
        self._closing = True
        if not self.accepted:  # refused before the session began: a status, as HTTP says
            h3.send_headers(self.session_id, [(b":status", b"403")], end_stream=True)
            self.connection.transmit()
            self._finish()
            return
        if self._pending and not await self._stream_opened():
            return
        value = code.to_bytes(4, "big") + reason.encode()[:1024]
        if self.stream_id is not None:
            self._quic_send(bytes([CLOSE]) + encode_uint_var(len(value)) + value, end=True)
            self.connection.transmit()
            if not await self._delivered():
                return  # the client ended the session itself
        capsule = encode_uint_var(CLOSE_SESSION_CAPSULE) + encode_uint_var(len(value)) + value
        with contextlib.suppress(Exception):  # the client ended the CONNECT stream meanwhile
            h3.send_data(self.session_id, capsule, end_stream=True)
        self.connection.transmit()
        self._finish()

    async def _delivered(self) -> bool:
        """Wait until the client acknowledged the whole stream, and a moment more (bounded);
        false when the session ended meanwhile."""
        streams = self.connection._quic._streams

        def acknowledged() -> bool:
            stream = streams.get(self.stream_id) if self.stream_id is not None else None
            return self.closed or stream is None or stream.sender.is_finished

        try:
            await asyncio.wait_for(self.connection.acknowledged(acknowledged), _STREAM_WAIT_S)
        except asyncio.TimeoutError:
            return not self.closed
        if not self.closed:
            await asyncio.sleep(_CLOSE_GRACE_S)
        return not self.closed

    async def _stream_opened(self) -> bool:
        """Wait a while for the client's stream, for frames sent before the close (its
        error) to go out first; false when the session ended meanwhile."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._bound.wait(), _STREAM_WAIT_S)
        return not self.closed

    def _finish(self) -> None:
        self.closed = True
        self.events.put_nowait({"type": "websocket.disconnect", "code": 1000})
        self._forget()

    def ping(self) -> bool:
        """A QUIC PING (acknowledged by the client's QUIC stack, whatever the page does)."""
        if self.closed:
            return False
        uid = id(self) ^ int(asyncio.get_running_loop().time() * 1e6)
        self.connection.pings[uid] = self
        self.connection._quic.send_ping(uid)
        self.connection.transmit()
        return True

    def _set_pong_handler(self, handler: Callable[[], None] | None) -> None:
        self._pong = handler

    def pong(self) -> None:
        self._last_control = asyncio.get_running_loop().time()
        if self._pong is not None:
            self._pong()

    def abort(self) -> None:
        """Drop the session now: its streams reset, the app told it is gone."""
        quic = self.connection._quic
        for stream_id in (self.stream_id, self.session_id):
            if stream_id is not None:
                with contextlib.suppress(Exception):  # already ended
                    quic.reset_stream(stream_id, _CANCELLED)
        self.connection.transmit()
        self.ended("aborted")

    async def serve(self) -> None:
        try:
            await self.connection.listener.app(self.scope, self.receive, self.send)
        except Exception:
            logger.exception("WebTransport session %s failed", self.scope["path"])
        finally:
            if not self.closed:
                await self._close(
                    self._close_code, "malformed message" if self._close_code != 1011 else ""
                )
