"""The first bytes of every connection: bounds on requests whose headers have not arrived.

uvicorn arms no timer before a connection's first request, and ``--max-connections`` counts
accepted WebSockets only, so a client that opens sockets and sends nothing (or a byte every few
seconds) could hold them forever and run the process out of file descriptors. Here every
HTTP request, a WebSocket upgrade included, has until ``handshake_timeout_s`` to send all its
headers, and the connections still sending them are capped, in all and per client address:

- too slow: ``408`` and the connection closes;
- headers over ``max_header_bytes`` in all: ``431`` at once;
- over the cap per address: ``503`` (``overloaded``) and the new connection closes before
  anything is read (that address is flooding);
- over the cap in all: the **oldest** connection still sending headers gets the ``503`` and
  closes, and the new one is let in: a flood of silent sockets, from however many addresses,
  never locks a client out, since a real client sends its headers at once;
- descriptors nearly gone (the open connections within :attr:`HandshakeLimits.reserve` of the
  process's limit): the oldest such connections are closed, as many as the reserve, so that
  ``accept`` does not fail for want of a descriptor and a new client gets in.

The caps are sized from the process's descriptor limit (:func:`sized_for`), which
``seedance serve`` raises toward its hard limit at start (:func:`raise_descriptor_limit`).
Each of these writes a warning, at most one every 10 seconds per kind (a flood writes one line
and a count). The clock starts when the connection opens, and again when a kept-alive connection
starts its next request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
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
    #: The process's soft limit of file descriptors (None: not known, no descriptor check),
    #: and how close to it a new connection's descriptor may come before the oldest
    #: connection still sending headers is closed.
    descriptors: int | None = None
    reserve: int = 16
    #: Descriptors the process holds beside its connections (files, the listening socket,
    #: the event loop's own), measured at the first connection.
    held: int | None = None
    total: int = 0
    by_address: dict[str, int] = field(default_factory=dict)
    #: The connections sending headers now, oldest first.
    waiting: dict[SeedanceHttpProtocol, None] = field(default_factory=dict)
    timed_out: Throttled = field(default_factory=lambda: Throttled(logger))
    refused: Throttled = field(default_factory=lambda: Throttled(logger))
    too_large: Throttled = field(default_factory=lambda: Throttled(logger))
    shed: Throttled = field(default_factory=lambda: Throttled(logger))

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

    def enter(self, connection: SeedanceHttpProtocol, address: str) -> str | None:
        """Count a connection that starts sending headers; the reason when the cap per
        address refuses it. At the cap in all, the oldest one goes instead."""
        count = self.by_address.get(address, 0)
        if count >= self.max_per_address and not self.is_proxy(address):
            return (
                f"{count} connections from {address} are sending their request headers "
                f"(limit {self.max_per_address} per address)"
            )
        if self.total >= self.max_total:
            self.shed_oldest(f"{self.total} connections are sending their request headers "
                             f"(limit {self.max_total})")  # fmt: skip
        self.total += 1
        self.by_address[address] = count + 1
        self.waiting[connection] = None
        return None

    def leave(self, connection: SeedanceHttpProtocol, address: str) -> None:
        self.waiting.pop(connection, None)
        self.total -= 1
        count = self.by_address[address] - 1
        if count:
            self.by_address[address] = count
        else:
            del self.by_address[address]

    def shed_oldest(self, why: str, keep: SeedanceHttpProtocol | None = None) -> bool:
        """Close the oldest connection still sending headers (but ``keep``), answered 503."""
        oldest = next((c for c in self.waiting if c is not keep), None)
        if oldest is None:
            return False
        self.shed.warning(
            "%s: the oldest connection still sending headers closed (503): %s",
            oldest._address,
            why,
        )
        oldest._reject(503, Overloaded("too many connections are opening; retry"))
        return True

    def descriptor_taken(self, connection: SeedanceHttpProtocol, connections: int) -> None:
        """A new connection came, ``connections`` now open in all: near the limit, as many
        of the oldest still sending headers are closed as the reserve holds, so that
        descriptors are free again when the next client comes (the event loop may accept many
        connections before it hands the first to its protocol: a flood drains the reserve in
        one go). The count is the server's connections and the descriptors it held before
        serving, checked against the process's own count where the system keeps one."""
        if self.descriptors is None:
            return
        threshold = self.descriptors - self.reserve
        if self.held is None:  # measured at the first connection: the server is up by then
            self.held = max(0, (open_descriptors() or connections) - connections)
        if self.held + connections < threshold - self.reserve:  # a reserve more, for drift
            return
        in_use = open_descriptors()
        if in_use is not None and in_use < threshold:
            return
        why = (
            f"{in_use or self.held + connections} of at most {self.descriptors} descriptors in use"
        )
        for _ in range(self.reserve):
            if not self.shed_oldest(why, keep=connection):
                break


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
        if self._waiting:
            self.limits.descriptor_taken(self, len(self.connections))

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
        refused = limits.enter(self, self._address)
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
            self.limits.leave(self, self._address)

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


def open_descriptors() -> int | None:
    """How many descriptors this process holds now (None: the system does not say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own
    except OSError:
        return None


def descriptor_limit() -> int | None:
    """The process's soft limit of open file descriptors (None: unlimited or not known)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


#: The soft limit asked for when the hard limit is unlimited.
DESCRIPTORS_WANTED = 1 << 20


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (``seedance serve`` does at start):
    (before, after) when it rose, else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = DESCRIPTORS_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # a platform that caps it lower (macOS)
            logger.info("file descriptors: the soft limit stays at %d (%s)", soft, exc)
            return None
        return soft, wanted
    return None


def sized_for(limits: HandshakeLimits, descriptors: int | None) -> HandshakeLimits:
    """``limits`` with their caps held under what ``descriptors`` open files allow: at most
    half of them sending headers in all, an eighth from one address, and a reserve of a
    thirty-second (at least 8) that a new connection's descriptor may not reach."""
    if descriptors is None:
        return limits
    limits.descriptors = descriptors
    limits.reserve = max(8, descriptors // 32)
    total = max(1, min(limits.max_total, descriptors // 2))
    per_address = max(1, min(limits.max_per_address, descriptors // 8))
    if (total, per_address) != (limits.max_total, limits.max_per_address):
        logger.warning(
            "file descriptors: %d at most; connections still sending headers capped at %d in "
            "all and %d per address (configured %d and %d)",
            descriptors,
            total,
            per_address,
            limits.max_total,
            limits.max_per_address,
        )
    limits.max_total, limits.max_per_address = total, per_address
    return limits


def http_protocol(limits: HandshakeLimits) -> type[SeedanceHttpProtocol]:
    """The protocol class for uvicorn's ``http=`` with these bounds."""
    return type("SeedanceHttpProtocol", (SeedanceHttpProtocol,), {"limits": limits})
