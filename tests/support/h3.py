"""An HTTP/3 and WebTransport client for tests, on aioquic.

``h3_connection()`` opens one QUIC connection to a server speaking HTTP/3 and yields an
``H3Client``. Over it, tests send plain requests (``request()``, or any httpx client through
``transport()``, which streams response bodies, so Server-Sent Events arrive as they are sent),
open WebTransport sessions (``webtransport()``) and move the connection to a new local port
(``migrate()``) to check that the server follows a client whose address changes.

A WebTransport session carries its messages on one bidirectional stream that the client opens
when the server accepts the session. Both directions frame each message the same way: one byte
of kind (0x00 text, 0x01 binary), the payload's length as a QUIC variable-length integer, then
the payload (``encode_message()``, ``MessageDecoder``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import (  # type: ignore[attr-defined]  # re-exported from aioquic._buffer
    UINT_VAR_MAX_SIZE,
    Buffer,
    BufferReadError,
    encode_uint_var,
)
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, Headers, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived, StreamReset
from cryptography import x509

TEXT = 0x00
BINARY = 0x01
CLOSE = 0x02  # the server's close, in order on the stream: u32 code, UTF-8 reason
CLOSE_WEBTRANSPORT_SESSION = 0x2843
MAX_DATAGRAM_FRAME_SIZE = 65536

# Request headers that HTTP/3 forbids (RFC 9114 section 4.2); Host becomes :authority.
_DROPPED_HEADERS = frozenset(
    (
        b"connection",
        b"host",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"transfer-encoding",
        b"upgrade",
    )
)


class WebTransportRefused(Exception):
    """The server answered a WebTransport CONNECT with a status other than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"WebTransport session refused with status {status}: {body}")
        self.status = status
        self.body = body


class WebTransportClosed(Exception):
    """The WebTransport session is closed: no message can be sent, none is left to read."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"WebTransport session closed with code {code}: {reason!r}")
        self.code = code
        self.reason = reason


def encode_message(message: str | bytes) -> bytes:
    """One message as it travels on a session's message stream."""
    if isinstance(message, str):
        kind, payload = TEXT, message.encode()
    else:
        kind, payload = BINARY, message
    return bytes((kind,)) + encode_uint_var(len(payload)) + payload


class MessageDecoder:
    """Cuts a message stream into messages, whatever the stream's data events split or merge."""

    def __init__(self) -> None:
        self._pending = bytearray()

    @property
    def mid_message(self) -> bool:
        """Whether bytes of an incomplete message are waiting for the rest."""
        return bool(self._pending)

    def feed(self, data: bytes) -> list[str | bytes | WebTransportClosed]:
        """The messages that ``data`` completes, the server's close as a WebTransportClosed
        (ValueError for an unknown kind or bad UTF-8)."""
        self._pending += data
        messages: list[str | bytes | WebTransportClosed] = []
        while self._pending:
            header = Buffer(data=bytes(self._pending[1 : 1 + UINT_VAR_MAX_SIZE]))
            try:
                length = header.pull_uint_var()
            except BufferReadError:
                break
            start = 1 + header.tell()
            end = start + length
            if len(self._pending) < end:
                break
            kind = self._pending[0]
            payload = bytes(self._pending[start:end])
            del self._pending[:end]
            if kind == TEXT:
                messages.append(payload.decode())
            elif kind == BINARY:
                messages.append(payload)
            elif kind == CLOSE:
                code = int.from_bytes(payload[:4], "big")
                messages.append(WebTransportClosed(code, payload[4:].decode(errors="replace")))
            else:
                raise ValueError(f"unknown message kind {kind:#04x}")
        return messages


def encode_close_capsule(code: int, reason: str) -> bytes:
    """A CLOSE_WEBTRANSPORT_SESSION capsule: error code (u32) and UTF-8 reason."""
    value = code.to_bytes(4, "big") + reason.encode()
    return encode_uint_var(CLOSE_WEBTRANSPORT_SESSION) + encode_uint_var(len(value)) + value


def split_capsules(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """The complete capsules (type, value) at the start of ``data``, and the bytes left over."""
    capsules: list[tuple[int, bytes]] = []
    buf = Buffer(data=data)
    while not buf.eof():
        start = buf.tell()
        try:
            capsule_type = buf.pull_uint_var()
            value = buf.pull_bytes(buf.pull_uint_var())
        except BufferReadError:
            return capsules, data[start:]
        capsules.append((capsule_type, value))
    return capsules, b""


class _ResponseReceiver:
    """What the server sends back on one request stream: the response head, then the body."""

    def __init__(self) -> None:
        self._head: asyncio.Future[tuple[int, Headers]] = asyncio.get_running_loop().create_future()
        self._chunks: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self.ended = False

    def headers_received(self, headers: Headers) -> None:
        if self._head.done():
            return  # trailers
        status = int(dict(headers)[b":status"])
        if status >= 200:  # not an interim response
            fields = [(name, value) for name, value in headers if name != b":status"]
            self._head.set_result((status, fields))

    def data_received(self, data: bytes) -> None:
        if data:
            self._chunks.put_nowait(data)

    def end(self) -> None:
        if not self._head.done():
            self._head.set_exception(httpx.RemoteProtocolError("stream ended without a response"))
        self._chunks.put_nowait(None)

    def fail(self, error: Exception) -> None:
        if not self._head.done():
            self._head.set_exception(error)
        self._chunks.put_nowait(error)

    async def response(self) -> tuple[int, Headers]:
        """The status and the headers (without :status) of the final response."""
        return await self._head

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, or None at its end."""
        chunk = await self._chunks.get()
        if isinstance(chunk, Exception):
            raise chunk
        self.ended = chunk is None
        return chunk

    async def read_all(self) -> bytes:
        body = bytearray()
        while (chunk := await self.next_chunk()) is not None:
            body += chunk
        return bytes(body)


class _QuicProtocol(QuicConnectionProtocol):
    """Hands every QUIC event to one callback: the H3Client's dispatcher."""

    def __init__(self, quic: QuicConnection, on_event: Callable[[QuicEvent], None]) -> None:
        super().__init__(quic)
        self._on_event = on_event

    def quic_event_received(self, event: QuicEvent) -> None:
        self._on_event(event)


class WebTransportSession:
    """A WebTransport session: framed messages on one stream, datagrams, and its closing.

    ``closed`` resolves to (code, reason) when the server ends the session: with a
    CLOSE_WEBTRANSPORT_SESSION capsule, by ending the CONNECT stream without one (0, ""),
    or when the QUIC connection ends (0, "connection closed").
    """

    def __init__(self, client: H3Client, session_id: int, receiver: _ResponseReceiver) -> None:
        self.session_id = session_id
        self.response_headers: Headers = []
        self.datagrams: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        self._client = client
        self._receiver = receiver
        self._message_stream_id: int | None = None
        self._messages: asyncio.Queue[str | bytes | Exception] = asyncio.Queue()
        self._decoder = MessageDecoder()
        self._closed_here: tuple[int, str] | None = None
        self._capsule_reader: asyncio.Task[None] | None = None  # held: the loop holds tasks weakly

    async def send_text(self, text: str) -> None:
        self._send_message(text)

    async def send_bytes(self, data: bytes) -> None:
        self._send_message(data)

    async def recv(self) -> str | bytes:
        """The next message; WebTransportClosed once the session is closed and all are read."""
        message = await self._messages.get()
        if isinstance(message, Exception):
            self._messages.put_nowait(message)
            raise message
        return message

    async def send_raw(self, data: bytes) -> None:
        """Bytes on the message stream as they are (a test's malformed framing)."""
        self._check_open()
        assert self._message_stream_id is not None
        self._client._quic.send_stream_data(self._message_stream_id, data)
        self._client._protocol.transmit()

    def send_datagram(self, data: bytes) -> None:
        self._check_open()
        self._client._h3.send_datagram(self.session_id, data)
        self._client._protocol.transmit()

    async def close(self, code: int = 0, reason: str = "") -> None:
        """Send CLOSE_WEBTRANSPORT_SESSION and end the CONNECT stream (once; later calls: no-op)."""
        if self._closed_here is not None or self._client.terminated:
            return
        self._closed_here = (code, reason)
        self._client._h3.send_data(
            self.session_id, encode_close_capsule(code, reason), end_stream=True
        )
        self._client._protocol.transmit()

    def _start(self, response_headers: Headers, message_stream_id: int) -> None:
        self.response_headers = response_headers
        self._message_stream_id = message_stream_id
        self._capsule_reader = asyncio.get_running_loop().create_task(self._read_capsules())

    def _check_open(self) -> None:
        if self.closed.done():
            raise WebTransportClosed(*self.closed.result())
        if self._closed_here is not None:
            raise WebTransportClosed(*self._closed_here)

    def _send_message(self, message: str | bytes) -> None:
        self._check_open()
        assert self._message_stream_id is not None
        self._client._quic.send_stream_data(self._message_stream_id, encode_message(message))
        self._client._protocol.transmit()

    def _message_data_received(self, data: bytes, stream_ended: bool) -> None:
        try:
            for message in self._decoder.feed(data):
                if isinstance(message, WebTransportClosed):  # in order, after the last frame
                    self._finish(message.code, message.reason)
                else:
                    self._messages.put_nowait(message)
            if stream_ended and self._decoder.mid_message:
                raise ValueError("the message stream ended inside a message")
        except ValueError as error:
            self._messages.put_nowait(error)

    async def _read_capsules(self) -> None:
        pending = b""
        try:
            while (chunk := await self._receiver.next_chunk()) is not None:
                capsules, pending = split_capsules(pending + chunk)
                for capsule_type, value in capsules:
                    if capsule_type == CLOSE_WEBTRANSPORT_SESSION:
                        code = int.from_bytes(value[:4], "big")
                        self._finish(code, value[4:].decode(errors="replace"))
        except httpx.RemoteProtocolError:
            pass  # the CONNECT stream was reset: the session ends as if it had ended cleanly
        self._finish(0, "")

    def _finish(self, code: int, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result((code, reason))
            self._messages.put_nowait(WebTransportClosed(code, reason))


class _ResponseBody(httpx.AsyncByteStream):
    """A response body handed to httpx chunk by chunk, as the server sends it."""

    def __init__(self, client: H3Client, stream_id: int, receiver: _ResponseReceiver) -> None:
        self._client = client
        self._stream_id = stream_id
        self._receiver = receiver

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._receiver.next_chunk()) is not None:
            yield chunk

    async def aclose(self) -> None:
        if not self._receiver.ended:
            self._client._cancel(self._stream_id)


class _H3Transport(httpx.AsyncBaseTransport):
    """An httpx transport that sends each request on a new stream of one HTTP/3 connection."""

    def __init__(self, client: H3Client) -> None:
        self._client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        headers: Headers = [
            (b":method", request.method.encode()),
            (b":scheme", b"https"),
            (b":authority", request.headers.get("host", request.url.netloc.decode()).encode()),
            (b":path", request.url.raw_path),
        ]
        for name, value in request.headers.raw:
            if name.lower() not in _DROPPED_HEADERS:
                headers.append((name.lower(), value))
        body = await request.aread()
        stream_id, receiver = self._client._start_request(headers, body)
        try:
            status, response_headers = await receiver.response()
        except BaseException:
            self._client._cancel(stream_id)
            raise
        return httpx.Response(
            status,
            headers=response_headers,
            stream=_ResponseBody(self._client, stream_id, receiver),
            extensions={"http_version": b"HTTP/3"},
        )


class H3Client:
    """One HTTP/3 connection (aioquic's H3Connection over QUIC) seen from the client side.

    Events are dispatched by stream: responses to the request they answer, data on a
    WebTransport message stream and datagrams to their session. Open it with
    ``h3_connection()``.
    """

    def __init__(self, quic: QuicConnection, authority: str) -> None:
        self.terminated = False
        self._authority = authority.encode()
        self._quic = quic
        self._h3 = H3Connection(quic, enable_webtransport=True)
        self._protocol = _QuicProtocol(quic, self._quic_event_received)
        self._transport: asyncio.DatagramTransport | None = None
        self._requests: dict[int, _ResponseReceiver] = {}
        self._sessions: dict[int, WebTransportSession] = {}
        self._message_streams: dict[int, WebTransportSession] = {}

    @property
    def local_address(self) -> tuple[str, int]:
        """The (host, port) of the UDP socket the connection now uses."""
        assert self._transport is not None
        host, port = self._transport.get_extra_info("sockname")[:2]
        return str(host), int(port)

    @property
    def peer_certificate(self) -> x509.Certificate:
        """The certificate the server presented."""
        certificate = self._quic.tls._peer_certificate  # aioquic keeps it, unexposed
        assert certificate is not None
        return certificate

    def transport(self) -> httpx.AsyncBaseTransport:
        """An httpx transport for ``httpx.AsyncClient(transport=...)`` over this connection."""
        return _H3Transport(self)

    async def request(
        self, method: str, path: str, headers: Headers | None = None, body: bytes = b""
    ) -> tuple[int, Headers, bytes]:
        """Send one request and read the whole response: (status, headers, body)."""
        request_headers: Headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self._authority),
            (b":path", path.encode()),
            *(headers or []),
        ]
        if body and all(name != b"content-length" for name, _ in request_headers):
            request_headers.append((b"content-length", str(len(body)).encode()))
        stream_id, receiver = self._start_request(request_headers, body)
        try:
            status, response_headers = await receiver.response()
            return status, response_headers, await receiver.read_all()
        except BaseException:
            self._cancel(stream_id)
            raise

    async def webtransport(self, path: str, headers: Headers | None = None) -> WebTransportSession:
        """Open a WebTransport session with an extended CONNECT to ``path``.

        Raises WebTransportRefused, with the response body as text, unless the status is 200.
        """
        connect_headers: Headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"webtransport"),
            (b":scheme", b"https"),
            (b":authority", self._authority),
            (b":path", path.encode()),
            (b"origin", b"https://" + self._authority),
            *(headers or []),
        ]
        session_id, receiver = self._start_request(connect_headers, end_stream=False)
        session = WebTransportSession(self, session_id, receiver)
        self._sessions[session_id] = session
        try:
            status, response_headers = await receiver.response()
            if status != 200:
                body = await receiver.read_all()
                raise WebTransportRefused(status, body.decode(errors="replace"))
        except BaseException:
            self._sessions.pop(session_id, None)
            self._cancel(session_id)
            raise
        message_stream_id = self._h3.create_webtransport_stream(session_id)
        self._message_streams[message_stream_id] = session
        session._start(response_headers, message_stream_id)
        self._protocol.transmit()
        return session

    async def migrate(self) -> tuple[str, int]:
        """Move the connection to a new local UDP port; return the new local address.

        The client switches to a new connection ID and sends a PING from the new socket; once
        it is acknowledged the server has received packets from the new address (and started
        validating the path). The old socket is closed then.
        """
        old_transport = self._transport
        await self._bind(self.local_address[0])
        self._protocol.change_connection_id()
        await self._protocol.ping()
        assert old_transport is not None
        old_transport.close()
        return self.local_address

    async def _bind(self, host: str) -> None:
        """Open a UDP socket on ``host`` (a new port) whose datagrams reach the QUIC protocol.

        Its endpoint calls the protocol's connection_made(), which makes it the socket the
        protocol sends from.
        """
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: self._protocol, local_addr=(host, 0)
        )

    async def _connect(self, remote: tuple[Any, ...]) -> None:
        self._protocol.connect(remote)
        await self._protocol.wait_connected()

    async def _close(self) -> None:
        self._protocol.close()
        await self._protocol.wait_closed()
        if self._transport is not None:
            self._transport.close()

    def _start_request(
        self,
        headers: Headers,
        body: bytes = b"",
        *,
        end_stream: bool = True,
    ) -> tuple[int, _ResponseReceiver]:
        """Send a request's headers and body on a new stream; its response goes to a receiver."""
        if self.terminated:
            raise httpx.ConnectError("the HTTP/3 connection is closed")
        stream_id = self._quic.get_next_available_stream_id()
        receiver = _ResponseReceiver()
        self._requests[stream_id] = receiver
        self._h3.send_headers(stream_id, headers, end_stream=end_stream and not body)
        if body:
            self._h3.send_data(stream_id, body, end_stream=end_stream)
        self._protocol.transmit()
        return stream_id, receiver

    def _cancel(self, stream_id: int) -> None:
        """Abort a request the caller gave up on, both ways, with H3_REQUEST_CANCELLED.

        RESET_STREAM unless all the request was acknowledged; STOP_SENDING unless the whole
        response has arrived.
        """
        reading = self._requests.pop(stream_id, None) is not None
        if self.terminated:
            return
        self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        if reading:
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self._protocol.transmit()

    def _quic_event_received(self, event: QuicEvent) -> None:
        # aioquic's H3Connection does not know that the server's data on a WebTransport stream
        # the client opened belongs to it: that data goes straight to its session.
        if isinstance(event, StreamDataReceived) and event.stream_id in self._message_streams:
            session = self._message_streams[event.stream_id]
            session._message_data_received(event.data, event.end_stream)
            return
        if isinstance(event, StreamReset) and event.stream_id in self._requests:
            self._requests.pop(event.stream_id).fail(
                httpx.RemoteProtocolError(f"stream reset by the server (error {event.error_code})")
            )
        elif isinstance(event, ConnectionTerminated):
            self._terminate(event.reason_phrase)
        for h3_event in self._h3.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, (HeadersReceived, DataReceived)):
            receiver = self._requests.get(event.stream_id)
            if receiver is None:
                return
            if isinstance(event, HeadersReceived):
                receiver.headers_received(event.headers)
            else:
                receiver.data_received(event.data)
            if event.stream_ended:
                del self._requests[event.stream_id]
                receiver.end()
        elif isinstance(event, DatagramReceived):
            session = self._sessions.get(event.stream_id)
            if session is not None:
                session.datagrams.put_nowait(event.data)

    def _terminate(self, reason: str) -> None:
        self.terminated = True
        for session in self._sessions.values():
            session._finish(0, "connection closed")
        for receiver in self._requests.values():
            receiver.fail(httpx.RemoteProtocolError(f"the connection closed: {reason}"))
        self._sessions.clear()
        self._message_streams.clear()
        self._requests.clear()


@asynccontextmanager
async def h3_connection(
    host: str,
    port: int,
    *,
    ca_file: str | None = None,
    verify: bool = True,
    server_name: str | None = None,
) -> AsyncIterator[H3Client]:
    """Connect to an HTTP/3 server (QUIC handshake done) and close the connection on exit.

    ``server_name`` is the TLS server name (default: ``host``); ``ca_file`` the CA that
    signed the server's certificate; ``verify=False`` skips certificate checks.
    """
    configuration = QuicConfiguration(
        is_client=True,
        alpn_protocols=H3_ALPN,
        max_datagram_frame_size=MAX_DATAGRAM_FRAME_SIZE,
        server_name=server_name or host,
    )
    if not verify:
        configuration.verify_mode = ssl.CERT_NONE
    if ca_file is not None:
        configuration.load_verify_locations(cafile=ca_file)

    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    # IPv4 first: test servers listen on 127.0.0.1, and "localhost" may resolve to ::1 too.
    family, _, _, _, remote = next((info for info in infos if info[0] == socket.AF_INET), infos[0])
    # The local address the system routes to the server from, so that local_address (and a
    # migration's new socket) name the host the server sees.
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(remote)
        local_host = str(probe.getsockname()[0])

    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    client = H3Client(QuicConnection(configuration=configuration), authority)
    await client._bind(local_host)
    try:
        await client._connect(remote)
        yield client
    finally:
        await client._close()
