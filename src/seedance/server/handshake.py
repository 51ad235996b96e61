"""The first bytes of every connection: bounds on requests whose headers have not arrived.

uvicorn arms no timer before a connection's first request, and ``--max-connections`` counts
accepted WebSockets only, so a client that opens sockets and sends nothing (or a byte every few
seconds) could hold them forever and run the process out of file descriptors. Here every
HTTP request, a WebSocket upgrade included, has until ``handshake_timeout_s`` to send all its
headers, and the connections still sending them are capped, in all and per client address:

- too slow: ``408`` and the connection closes;
- headers over ``max_header_bytes`` in all: ``431`` at once;
- over a cap: ``503`` (``overloaded``) and the connection closes before anything is read.

Each of these writes a warning, at most one every 10 seconds per kind (a flood writes one line
and a count). The clock starts when the connection opens, and again when a kept-alive connection
starts its next request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from seedance.observability.logs import Throttled
from seedance.protocol.errors import InvalidRequest, Overloaded, SeedanceError
from seedance.protocol.openai import error_body
from seedance.server.tls import with_tls

logger = logging.getLogger(__name__)

_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def http_error(status: int, error: SeedanceError) -> bytes:
    """A whole HTTP/1.1 error response with an OpenAI-shaped body, closing the connection."""
    body = error_body(error)
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass
class HandshakeLimits:
    """The bounds, and the connections sending headers now (shared by every connection)."""

    timeout_s: float = 10.0
    max_total: int = 4096
    max_per_address: int = 1024
    max_header_bytes: int = 16 * 1024
    #: Load balancers (addresses, networks, or "*"): many clients share their address, so
    #: they are held to ``max_total`` only.
    trusted_proxies: tuple[str, ...] = ()
    total: int = 0
    by_address: dict[str, int] = field(default_factory=dict)
    timed_out: Throttled = field(default_factory=lambda: Throttled(logger))
    refused: Throttled = field(default_factory=lambda: Throttled(logger))
    too_large: Throttled = field(default_factory=lambda: Throttled(logger))

    def __post_init__(self) -> None:
        self._any_proxy = "*" in self.trusted_proxies
        self._proxies = [ip_network(n) for n in self.trusted_proxies if n != "*"]

    def is_proxy(self, address: str) -> bool:
        if self._any_proxy:
            return True
        try:
            ip = ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._proxies)

    def enter(self, address: str) -> str | None:
        """Count a connection that starts sending headers; the reason when a cap refuses it."""
        if self.total >= self.max_total:
            total = self.total
            return f"{total} connections are sending their request headers (limit {self.max_total})"
        count = self.by_address.get(address, 0)
        if count >= self.max_per_address and not self.is_proxy(address):
            return (
                f"{count} connections from {address} are sending their request headers "
                f"(limit {self.max_per_address} per address)"
            )
        self.total += 1
        self.by_address[address] = count + 1
        return None

    def leave(self, address: str) -> None:
        self.total -= 1
        count = self.by_address[address] - 1
        if count:
            self.by_address[address] = count
        else:
            del self.by_address[address]


class SeedanceHttpProtocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of :class:`HandshakeLimits`, and the TLS
    extension (:func:`~seedance.server.tls.with_tls`) in the scopes of a TLS connection."""

    limits: ClassVar[HandshakeLimits] = HandshakeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address = ""
        self._timer: asyncio.TimerHandle | None = None
        self._head = bytearray()  # what arrived of the request line and headers
        self._waiting = False  # counted in limits: the headers have not all arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app = with_tls(self.app, transport)
        self._address = self.client[0] if self.client else ""
        self._start_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if not self._waiting and self.conn.their_state is h11.IDLE:
            self._start_waiting()  # the next request on a kept-alive connection
            if not self._waiting:
                return  # refused
        if self._waiting and self._too_large(data):
            return
        super().data_received(data)
        if self._waiting and self.conn.their_state is not h11.IDLE:
            self._stop_waiting()  # the headers are in (a WebSocket upgrade included)

    def _too_large(self, data: bytes) -> bool:
        head = self._head
        start = max(0, len(head) - 3)
        head += data
        end = head.find(b"\r\n\r\n", start)
        size = len(head) if end < 0 else end + 4
        limit = self.limits.max_header_bytes
        if size <= limit:
            return False
        self.limits.too_large.warning(
            "%s: request headers over %d bytes: answered 431", self._address, limit
        )
        message = f"the request line and headers exceed {limit} bytes"
        self._reject(431, InvalidRequest(message))
        return True

    def _start_waiting(self) -> None:
        limits = self.limits
        refused = limits.enter(self._address)
        if refused is not None:
            limits.refused.warning("%s: connection refused: %s", self._address, refused)
            self._reject(503, Overloaded("too many connections are opening; retry later"))
            return
        self._waiting = True
        self._head.clear()
        self._timer = asyncio.get_running_loop().call_later(limits.timeout_s, self._timed_out)

    def _stop_waiting(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiting:
            self._waiting = False
            self._head = bytearray()
            self.limits.leave(self._address)

    def _timed_out(self) -> None:
        self._timer = None
        timeout = self.limits.timeout_s
        self.limits.timed_out.warning(
            "%s: request headers not in after %g s: answered 408", self._address, timeout
        )
        message = f"the request headers did not arrive within {timeout:g} s"
        self._reject(408, InvalidRequest(message))

    def _reject(self, status: int, error: SeedanceError) -> None:
        self._stop_waiting()
        if not self.transport.is_closing():
            self.transport.write(http_error(status, error))
            self.transport.close()


def http_protocol(limits: HandshakeLimits) -> type[SeedanceHttpProtocol]:
    """The protocol class for uvicorn's ``http=`` with these bounds."""
    return type("SeedanceHttpProtocol", (SeedanceHttpProtocol,), {"limits": limits})
