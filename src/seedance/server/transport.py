"""Moving frames: the ASGI WebSocket adapter, the bounded outbound queue, and the uvicorn
protocol that bounds what the WebSocket library does on its own.

Everything the server holds for a client is bounded:

- frames wait in :class:`Outbound`; a request's stream waits for the socket when more than
  ``high_water_bytes`` are queued (backpressure reaches the engine);
- control replies (pongs, errors) do not wait, so a client that sends and never reads could
  grow the queue: past ``max_pending_bytes`` it is cut off;
- a socket that accepts nothing for ``write_timeout_s`` is cut off (checked by the
  connection's timer through :attr:`Outbound.stalled_since`);
- :class:`SeedanceWebSocketProtocol` applies the same limit to the automatic pongs that
  answer standard WebSocket pings, and sends a ``payload_too_large`` error frame before the
  1009 close of a frame over the size limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig
from websockets.frames import Frame, Opcode

from seedance.protocol.codec import encode_error
from seedance.protocol.errors import PayloadTooLarge

logger = logging.getLogger(__name__)

# What SeedanceWebSocketProtocol offers the app in ``scope["extensions"]``.
TRANSPORT_EXTENSION = "seedance.transport"
# What a queued frame costs beyond its payload (the Python object and deque slot).
FRAME_OVERHEAD_BYTES = 64

OutFrame = str | bytes


class AsgiWebSocket:
    """The ASGI side of one WebSocket: receive events, send frames, close, abort."""

    __slots__ = ("_abort", "_last_control", "_receive", "_send", "scope")

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        extension = (scope.get("extensions") or {}).get(TRANSPORT_EXTENSION) or {}
        self._abort: Callable[[], None] | None = extension.get("abort")
        self._last_control: Callable[[], float] | None = extension.get("last_control_frame_at")

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

    def last_control_frame_at(self) -> float:
        """Loop time of the last ping or pong control frame received (0: none, or unknown)."""
        return self._last_control() if self._last_control is not None else 0.0

    def abort(self) -> bool:
        """Drop the TCP connection now, when the server offers it; false otherwise."""
        if self._abort is None:
            return False
        self._abort()
        return True


class Outbound:
    """The frames waiting for one client's socket, written in order by one task."""

    def __init__(
        self,
        ws: AsgiWebSocket,
        *,
        max_pending_bytes: int,
        on_overflow: Callable[[], None],
        high_water_bytes: int = 64 * 1024,
    ) -> None:
        self._ws = ws
        self._queue: deque[OutFrame] = deque()
        self._wakeup = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._on_overflow = on_overflow
        self.max_pending_bytes = max_pending_bytes
        self.high_water_bytes = high_water_bytes
        self.pending_bytes = 0
        self.stalled_since: float | None = None
        self.closed = False
        self._close: tuple[int, str] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbound")

    def put(self, frame: OutFrame) -> None:
        """Queue a frame without waiting. Past ``max_pending_bytes`` the client is cut off."""
        if self.closed or self._close is not None:
            return
        self._queue.append(frame)
        self.pending_bytes += len(frame) + FRAME_OVERHEAD_BYTES
        if self.pending_bytes > self.high_water_bytes:
            self._writable.clear()
            if self.pending_bytes > self.max_pending_bytes:
                self.closed = True
                self._on_overflow()
        self._wakeup.set()

    async def wait_writable(self) -> None:
        """Wait until the queue is below the high-water mark (backpressure for streams)."""
        if not self._writable.is_set():
            await self._writable.wait()

    @property
    def congested(self) -> bool:
        return not self._writable.is_set()

    def close(self, code: int, reason: str = "") -> None:
        """Send what is queued, then the close frame."""
        if self._close is None and not self.closed:
            self._close = (code, reason)
            self._wakeup.set()

    async def stop(self) -> None:
        """Stop writing (the connection is gone)."""
        self.closed = True
        self._writable.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        queue, ws = self._queue, self._ws
        try:
            while not self.closed:
                if not queue:
                    if self._close is not None:
                        code, reason = self._close
                        self.closed = True
                        await ws.close(code, reason)
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                frame = queue.popleft()
                self.stalled_since = loop.time()
                await ws.send(frame)
                self.stalled_since = None
                self.pending_bytes -= len(frame) + FRAME_OVERHEAD_BYTES
                if self.pending_bytes <= self.high_water_bytes // 2:
                    self._writable.set()
        except Exception as exc:  # the client went away mid-write
            logger.debug("outbound writer stopped: %r", exc)
        finally:
            self.closed = True
            self._writable.set()


class SeedanceWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol with Seedance's bounds.

    - automatic pongs: uvicorn writes one for every ping without looking at the write buffer;
      here a client whose unread data passes ``max_pending_bytes`` is cut off;
    - a frame over ``ws_max_size`` gets a ``payload_too_large`` error frame before the 1009;
    - the ``seedance.transport`` extension lets the app drop a connection that does not read,
      and see control frames (which count as inbound traffic for the idle timeout).
    """

    max_pending_bytes = 1024 * 1024
    last_control_frame_at = 0.0

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][TRANSPORT_EXTENSION] = {
                "abort": self._abort,
                "last_control_frame_at": lambda: self.last_control_frame_at,
            }

    def handle_pong(self, event: Frame) -> None:
        self.last_control_frame_at = self.loop.time()
        super().handle_pong(event)

    def handle_ping(self) -> None:
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

    def handle_parser_exception(self) -> None:
        if isinstance(self.conn.parser_exc, PayloadTooBig):
            error = PayloadTooLarge(f"frame exceeds the limit of {self.config.ws_max_size} bytes")
            frame = Frame(Opcode.TEXT, encode_error(error).encode())
            self.transport.write(frame.serialize(mask=False))
        super().handle_parser_exception()

    def _abort(self) -> None:
        if not self.transport.is_closing():
            self.transport.abort()


def websocket_protocol(max_pending_bytes: int) -> type[SeedanceWebSocketProtocol]:
    """The protocol class for uvicorn's ``ws=`` with this server's limits."""
    return type(
        "SeedanceWebSocketProtocol",
        (SeedanceWebSocketProtocol,),
        {"max_pending_bytes": max_pending_bytes},
    )
