"""Redundant sending on the relay's link: every UDP datagram of a QUIC connection sent more than
once (``--relay-copies``).

A token's packet lost on the way costs it a round trip on any transport: the loss is seen, and
the packet sent again. Sent twice, a packet is late only when both copies are lost (at 1% loss:
one packet in 10,000, where each copy's loss is independent), for twice the bytes; the
receiver's QUIC stack drops the copies it does not need (RFC 9000, section 12.3). Worth it for
token streams, which are few bytes and many waits.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: The most copies a link sends of each datagram.
MAX_COPIES = 3
#: The header by which an edge asks the far end to send its answers' packets this many times.
HEADER = b"seedance-relay-copies"


class Repeating:
    """A datagram transport that sends each datagram ``copies`` times (the rest as ``inner``)."""

    def __init__(self, inner: asyncio.DatagramTransport, copies: int) -> None:
        self.inner = inner
        self.copies = max(1, min(copies, MAX_COPIES))

    def sendto(self, data: bytes, addr: Any = None) -> None:
        for _ in range(self.copies):
            self.inner.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def repeat(protocol: Any, copies: int) -> None:
    """Have the QUIC connection ``protocol`` (aioquic's, whose ``_transport`` it sends on) send
    each datagram ``copies`` times from now on (1: once)."""
    transport = protocol._transport
    inner = transport.inner if isinstance(transport, Repeating) else transport
    protocol._transport = inner if copies <= 1 else Repeating(inner, copies)
