"""The ASGI side of a WebSocket, as the server uses it: receive events, send frames, close,
abort, and the ``seedance.transport`` extension through which a server that offers it
(:mod:`seedance.server.uvicorn_ws`) writes frames directly and hands messages over without the
ASGI queue. Nothing here depends on the server underneath: under any other ASGI server the
same calls go through plain ASGI messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# What the server offers the app in ``scope["extensions"]`` (see seedance.server.uvicorn_ws).
TRANSPORT_EXTENSION = "seedance.transport"
# What the HTTP/3 listener offers in ``scope["extensions"]``: its QUIC connection's controls
# (``repeat``: send each datagram N times; seedance.server.http3).
QUIC_EXTENSION = "seedance.quic"
OutFrame = str | bytes
# Called with each complete message (payload, is_text); returns false to decline it.
Receiver = Callable[[bytes, bool], bool]


class AsgiWebSocket:
    """The ASGI side of one WebSocket: receive events, send frames, close, abort."""

    __slots__ = (
        "_abort",
        "_last_control",
        "_ping",
        "_receive",
        "_send",
        "_set_pong_handler",
        "_set_receiver",
        "scope",
        "writer",
    )

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        extension = (scope.get("extensions") or {}).get(TRANSPORT_EXTENSION) or {}
        self._abort: Callable[[], None] | None = extension.get("abort")
        self._last_control: Callable[[], float] | None = extension.get("last_control_frame_at")
        self.writer: FrameWriter | None = extension.get("writer")
        self._set_receiver: Callable[[Receiver | None], None] | None = extension.get("set_receiver")
        self._ping: Callable[[], bool] | None = extension.get("ping")
        self._set_pong_handler: Callable[[Callable[[], None] | None], None] | None = extension.get(
            "set_pong_handler"
        )

    async def receive(self) -> dict[str, Any]:
        event: dict[str, Any] = await self._receive()
        return event

    async def accept(self, subprotocol: str | None) -> None:
        await self._send({"type": "websocket.accept", "subprotocol": subprotocol})

    async def send(self, frame: OutFrame) -> None:
        if isinstance(frame, str):
            await self._send({"type": "websocket.send", "text": frame})
        else:
            await self._send({"type": "websocket.send", "bytes": frame})

    async def close(self, code: int, reason: str = "") -> None:
        await self._send({"type": "websocket.close", "code": code, "reason": reason})

    def set_receiver(self, receiver: Receiver | None) -> bool:
        """Have messages handed to ``receiver`` as they are parsed (no ASGI queue, no task
        switch); false when the server does not offer it. A message the receiver declines
        (returns false) arrives through :meth:`receive` as usual."""
        if self._set_receiver is None:
            return False
        self._set_receiver(receiver)
        return True

    @property
    def can_ping(self) -> bool:
        """Whether :meth:`ping` can send a WebSocket ping frame (the server offers it)."""
        return self._ping is not None

    def ping(self) -> bool:
        """Send a standard WebSocket ping frame, which every client answers by itself; false
        when the server does not offer it or the connection is closing."""
        return self._ping() if self._ping is not None else False

    def on_pong(self, handler: Callable[[], None] | None) -> None:
        """Have ``handler`` called when the client answers the last :meth:`ping`."""
        if self._set_pong_handler is not None:
            self._set_pong_handler(handler)

    def last_control_frame_at(self) -> float:
        """Loop time of the last ping or pong control frame received (0: none, or unknown)."""
        return self._last_control() if self._last_control is not None else 0.0

    def abort(self) -> bool:
        """Drop the TCP connection now, when the server offers it; false otherwise."""
        if self._abort is None:
            return False
        self._abort()
        return True


class FrameWriter(Protocol):
    """The server's direct write path (the ``seedance.transport`` extension's ``writer``).

    Frames handed to it are framed and written to the socket in one ``write``, without an
    ASGI message per frame. :attr:`writable` is cleared while the transport's buffer is over
    its high-water mark (the client is not keeping up) and set again when it drains.
    """

    writable: asyncio.Event
    #: An encrypted connection's sealer, set by the app: what the server writes on its own
    #: (the ``payload_too_large`` error before its 1009 close) is sealed by it too.
    seal: Callable[[OutFrame], OutFrame] | None

    def write_frames(self, frames: Sequence[bytes | str]) -> bool:
        """Write the frames; false when the connection is no longer open."""
        ...
