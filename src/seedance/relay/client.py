"""The edge's side of the relay's link: one QUIC connection per far gateway, kept and reused,
carrying each relayed request as an HTTP/3 request stream (aioquic).

:meth:`Peer.post` opens a stream on the connection (opening the connection first when there is
none, or when the last one ended) and streams the response's body back. A connection that ends
fails every stream on it with :class:`LinkLost`; the next request opens a new one, resuming the
TLS session with the ticket the far end gave: no certificate exchange, and the request sent in
the first flight as 0-RTT data. That is safe here because a relayed request carries a relay
token the far end takes once: a replay of the early data is refused as ``replayed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent, StreamReset
from aioquic.tls import SessionTicket

from seedance.relay.copies import HEADER, repeat

logger = logging.getLogger(__name__)


class LinkLost(ConnectionError):
    """The QUIC connection to the far gateway ended (or the stream was reset, or it did not
    answer in time); ``reused``: on a connection kept from an earlier request, which may only
    be stale (a new one may do)."""

    def __init__(self, message: str, *, reused: bool = False) -> None:
        super().__init__(message)
        self.reused = reused


@dataclass
class _Exchange:
    """One request's response as it arrives."""

    headers: asyncio.Future[list[tuple[bytes, bytes]]]
    body: asyncio.Queue[bytes | Exception] = field(default_factory=asyncio.Queue)


class _Link(QuicConnectionProtocol):
    """A QUIC connection speaking HTTP/3, its responses handed to their exchanges."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.exchanges: dict[int, _Exchange] = {}
        self.ended = False
        #: The TLS session was resumed from a ticket, and the far end took the 0-RTT data.
        self.resumed = self.early_data = False

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.resumed, self.early_data = event.session_resumed, event.early_data_accepted
        if isinstance(event, ConnectionTerminated):
            self.ended = True
            for exchange in self.exchanges.values():
                self._fail(exchange, LinkLost(f"the link ended: {event.reason_phrase or 'closed'}"))
            self.exchanges.clear()
            return
        if isinstance(event, StreamReset):
            reset = self.exchanges.pop(event.stream_id, None)
            if reset is not None:
                self._fail(reset, LinkLost("the far end reset the stream"))
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        exchange = self.exchanges.get(getattr(event, "stream_id", -1))
        if exchange is None:
            return
        if isinstance(event, HeadersReceived):
            if not exchange.headers.done():
                exchange.headers.set_result(list(event.headers))
        elif isinstance(event, DataReceived):
            if event.data:
                exchange.body.put_nowait(event.data)
        else:
            return
        if event.stream_ended:
            exchange.body.put_nowait(b"")
            self.exchanges.pop(event.stream_id, None)

    @staticmethod
    def _fail(exchange: _Exchange, error: Exception) -> None:
        if not exchange.headers.done():
            exchange.headers.set_exception(error)
        exchange.body.put_nowait(error)


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: AsyncIterator[bytes]


class Peer:
    """A far gateway at ``url`` (``https://host:port``), reached over one kept QUIC connection."""

    def __init__(
        self,
        url: str,
        *,
        ca_file: str | None = None,
        connect_timeout_s: float = 10.0,
        answer_timeout_s: float = 5.0,
        copies: int = 1,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"a relay peer is https://host:port, not {url!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or 443
        self.authority = f"{self.host}:{self.port}"
        self.ca_file = ca_file
        self.connect_timeout_s = connect_timeout_s
        #: How long a request waits for the far end's first answer (its headers come with
        #: the reply's start, before the engine's first token) before the link counts as lost.
        self.answer_timeout_s = answer_timeout_s
        #: Each datagram sent this many times, both ways (:mod:`seedance.relay.copies`).
        self.copies = copies
        self.connects = 0  # connections opened: one, while the link holds
        self._ticket: SessionTicket | None = None
        self._link: _Link | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock = asyncio.Lock()

    def _configuration(self) -> QuicConfiguration:
        configuration = QuicConfiguration(
            is_client=True, alpn_protocols=H3_ALPN, server_name=self.host, idle_timeout=30.0
        )
        if self.ca_file is not None:
            configuration.load_verify_locations(cafile=self.ca_file)
        configuration.verify_mode = ssl.CERT_REQUIRED
        configuration.session_ticket = self._ticket  # resumes the TLS session where it can
        return configuration

    def _keep_ticket(self, ticket: SessionTicket) -> None:
        self._ticket = ticket

    async def _connected(self) -> _Link:
        async with self._lock:
            link = self._link
            if link is not None and not link.ended:
                return link
            await self._drop()
            stack = contextlib.AsyncExitStack()
            opening = connect(
                self.host,
                self.port,
                configuration=self._configuration(),
                create_protocol=_Link,
                session_ticket_handler=self._keep_ticket,
                wait_connected=self._ticket is None,  # with a ticket: the request as 0-RTT
            )
            try:
                opened = await asyncio.wait_for(
                    stack.enter_async_context(opening), self.connect_timeout_s
                )
            except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
                await stack.aclose()
                raise LinkLost(f"cannot reach {self.url}: {exc or 'timed out'}") from None
            assert isinstance(opened, _Link)
            if self.copies > 1:
                repeat(opened, self.copies)
            self._link, self._stack = opened, stack
            self.connects += 1
            logger.info("relay link to %s open (connection %d)", self.url, self.connects)
            return opened

    async def post(self, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Response:
        """A POST on a stream of its own; the response's status and headers, and its body as
        it arrives (LinkLost when the link ends first)."""
        reused = self._link is not None and not self._link.ended
        link = await self._connected()
        stream_id = link._quic.get_next_available_stream_id()
        loop = asyncio.get_running_loop()
        exchange = _Exchange(headers=loop.create_future())
        link.exchanges[stream_id] = exchange
        request = [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ]
        if self.copies > 1:  # the far end's packets too
            request.append((HEADER, str(self.copies).encode()))
        link.h3.send_headers(stream_id, request)
        link.h3.send_data(stream_id, body, end_stream=True)
        link.transmit()
        try:
            answered = await asyncio.wait_for(exchange.headers, self.answer_timeout_s)
        except asyncio.TimeoutError:
            link.exchanges.pop(stream_id, None)
            await self._forget(link)
            raise LinkLost(
                f"{self.url} did not answer in {self.answer_timeout_s:g} s", reused=reused
            ) from None
        except LinkLost as exc:
            raise LinkLost(str(exc), reused=reused) from None
        head = dict(answered)
        return Response(int(head.get(b":status", b"0")), head, _body(link, stream_id, exchange))

    async def _forget(self, link: _Link) -> None:
        """Stop using ``link`` (the next request opens another), if it is still the one."""
        async with self._lock:
            if self._link is link:
                await self._drop()

    async def _drop(self) -> None:
        stack, self._stack, self._link = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    def cut(self) -> None:
        """End the link now, as a network failure would (tests, demos): its streams fail."""
        if self._link is not None:
            self._link.close(error_code=0x100, reason_phrase="cut")
            self._link.transmit()


async def _body(link: _Link, stream_id: int, exchange: _Exchange) -> AsyncIterator[bytes]:
    try:
        while True:
            chunk = await exchange.body.get()
            if isinstance(chunk, Exception):
                raise chunk
            if not chunk:
                return
            yield chunk
    finally:
        if link.exchanges.pop(stream_id, None) is not None and not link.ended:
            with contextlib.suppress(Exception):  # a reply not read to its end: stop it there
                link._quic.reset_stream(stream_id, 0x10C)
                link.transmit()
