"""uvicorn's sans-I/O WebSocket protocol with Seedance's bounds and its direct paths.

This module is the only one that reaches into uvicorn's WebSocket internals (``frames``,
``curr_msg_data_type``, ``close_sent``, ``conn``, ``queue`` ...): pyproject.toml pins uvicorn to
the releases it was tested with, and ``tests/test_uvicorn_ws.py`` names every internal used, so
a release that moves one fails there by name.

- automatic pongs: uvicorn writes one for every ping without looking at the write buffer;
  here a client whose unread data passes ``max_pending_bytes`` is cut off;
- a frame over ``ws_max_size`` gets a ``payload_too_large`` error frame before the 1009 close
  (sealed on an encrypted connection);
- the ``seedance.transport`` extension lets the app write frames in one ``write`` (no ASGI
  message per frame), receive messages without the ASGI queue, drop a connection that does
  not read, send ping frames and hear their pongs (the keepalive every client answers), and
  see control frames (inbound traffic for the idle timeout);
- an upgrade request that does not parse is answered (400 or 431) and closed.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig, SecurityError
from websockets.frames import Frame
from websockets.protocol import State

from seedance.eventloop import LightQueue, set_nodelay
from seedance.protocol.codec import encode_error
from seedance.protocol.errors import InvalidRequest, PayloadTooLarge
from seedance.server.handshake import http_error
from seedance.server.tls import with_tls
from seedance.server.transport import TRANSPORT_EXTENSION, OutFrame, Receiver

logger = logging.getLogger(__name__)


class SeedanceWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol with Seedance's bounds.

    - automatic pongs: uvicorn writes one for every ping without looking at the write buffer;
      here a client whose unread data passes ``max_pending_bytes`` is cut off;
    - a frame over ``ws_max_size`` gets a ``payload_too_large`` error frame before the 1009;
    - the ``seedance.transport`` extension lets the app drop a connection that does not read,
      and see control frames (which count as inbound traffic for the idle timeout);
    - on a TLS connection, the ASGI TLS extension (:func:`~seedance.server.tls.with_tls`).
    """

    max_pending_bytes = 1024 * 1024
    last_control_frame_at = 0.0
    receiver: Receiver | None = None
    seal: Callable[[OutFrame], OutFrame] | None = None
    pong_handler: Callable[[], None] | None = None
    _ping_payload: bytes | None = None

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][TRANSPORT_EXTENSION] = {
                "abort": self._abort,
                "last_control_frame_at": lambda: self.last_control_frame_at,
                "writer": self,
                "set_receiver": self._set_receiver,
                "ping": self._send_ping,
                "set_pong_handler": self._set_pong_handler,
            }

    def _set_receiver(self, receiver: Receiver | None) -> None:
        self.receiver = receiver

    def _set_pong_handler(self, handler: Callable[[], None] | None) -> None:
        self.pong_handler = handler

    @property
    def _open(self) -> bool:
        """Whether frames can still be written (the handshake done, no close either way)."""
        return not (
            self.close_sent
            or self.disconnected
            or not self.handshake_complete
            or self.conn.state is not State.OPEN
            or self.transport.is_closing()
        )

    def _send_ping(self) -> bool:
        """A WebSocket ping frame with a payload of its own, answered by the client's pong."""
        if not self._open:
            return False
        self._ping_payload = os.urandom(4)
        self.conn.send_ping(self._ping_payload)
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    def send_receive_event_to_app(self) -> None:
        """Hand a complete message to the app's receiver when it has one (the direct path)."""
        receiver = self.receiver
        if receiver is not None and not self.close_sent:
            frames = self.frames
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            if receiver(data, self.curr_msg_data_type == "text"):
                self.frames = []
                return
        super().send_receive_event_to_app()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue = LightQueue()  # type: ignore[assignment]

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.app = with_tls(self.app, transport)
        set_nodelay(transport)

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.accept" and self.handshake_complete:
            # The handshake's request and response are not needed again: free their headers.
            self.request = self.response = None  # type: ignore[assignment]

    def write_frames(self, frames: Sequence[bytes | str]) -> bool:
        """:class:`FrameWriter`: frame and write data frames in one ``write``."""
        # _open, inline: this runs for every frame (make bench-compare measured the call).
        if (
            self.close_sent
            or self.disconnected
            or not self.handshake_complete
            or self.conn.state is not State.OPEN
            or self.transport.is_closing()
        ):
            return False
        self.transport.write(_framed(frames))
        return True

    def handle_pong(self, event: Frame) -> None:
        self.last_control_frame_at = self.loop.time()
        if self._ping_payload is not None and bytes(event.data) == self._ping_payload:
            self._ping_payload = None
            if self.pong_handler is not None:
                self.pong_handler()
        super().handle_pong(event)

    def handle_ping(self) -> None:
        if self.transport.is_closing():
            return  # cut off already: the rest of a flood gets no pong and no log line
        self.last_control_frame_at = self.loop.time()
        super().handle_ping()
        if self.transport.get_write_buffer_size() > self.max_pending_bytes:
            logger.warning(
                "%s: cut off: %d bytes of pongs unread (limit %d)",
                self.client,
                self.transport.get_write_buffer_size(),
                self.max_pending_bytes,
            )
            self._abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        failed = self.conn.handshake_exc
        if failed is not None and not self.handshake_initiated and not self.close_sent:
            self._refuse_handshake(failed)

    def _refuse_handshake(self, failed: Exception) -> None:
        """The upgrade request did not parse (a header line over the WebSocket library's
        8 KiB, say): answer it (the library queues a reply that uvicorn never writes) and close,
        so the connection neither hangs nor breaks the server's shutdown."""
        too_large = isinstance(failed, SecurityError)
        status = 431 if too_large else 400
        logger.info("%s: WebSocket upgrade refused (%d): %s", self.client, status, failed)
        message = f"the WebSocket upgrade request was refused: {failed}"
        self.handshake_complete = self.close_sent = True  # shutdown() only closes it now
        self.transport.write(http_error(status, InvalidRequest(message)))
        self.transport.close()

    def shutdown(self) -> None:
        """uvicorn's shutdown of this connection, which must not stop the server's own: a
        connection in a state it did not foresee is closed all the same."""
        try:
            super().shutdown()
        except Exception as exc:
            logger.warning("%s: closed at shutdown after %r", self.client, exc)
            self.transport.close()

    def handle_parser_exception(self) -> None:
        if isinstance(self.conn.parser_exc, PayloadTooBig):
            error = PayloadTooLarge(f"frame exceeds the limit of {self.config.ws_max_size} bytes")
            frame = encode_error(error) if self.seal is None else self.seal(encode_error(error))
            self.transport.write(_framed((frame,)))
        super().handle_parser_exception()

    def _abort(self) -> None:
        if not self.transport.is_closing():
            self.transport.abort()


def _framed(frames: Sequence[bytes | str]) -> bytes:
    """Server frames, ready to write: a text frame for each ``str``, a binary one for bytes."""
    parts: list[bytes] = []
    for frame in frames:
        if isinstance(frame, str):
            data = frame.encode()
            parts.append(_frame_header(0x81, len(data)))
        else:
            data = frame
            parts.append(_frame_header(0x82, len(data)))
        parts.append(data)
    return b"".join(parts)


def _frame_header(first_byte: int, length: int) -> bytes:
    """The header of an unmasked, final, uncompressed server frame (RFC 6455 section 5.2)."""
    if length < 126:
        return _HEADER_SHORT.pack(first_byte, length)
    if length < 65536:
        return _HEADER_MEDIUM.pack(first_byte, 126, length)
    return _HEADER_LONG.pack(first_byte, 127, length)


_HEADER_SHORT = struct.Struct("!BB")
_HEADER_MEDIUM = struct.Struct("!BBH")
_HEADER_LONG = struct.Struct("!BBQ")


def websocket_protocol(max_pending_bytes: int) -> type[SeedanceWebSocketProtocol]:
    """The protocol class for uvicorn's ``ws=`` with this server's limits."""
    return type(
        "SeedanceWebSocketProtocol",
        (SeedanceWebSocketProtocol,),
        {"max_pending_bytes": max_pending_bytes},
    )
