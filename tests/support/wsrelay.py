"""A TCP relay that sees the WebSocket frames passing through it: it records their payloads
(unmasked) and may change a frame's bytes on the way, as a proxy or an attacker in between
could. Used to check what a TLS-terminating proxy forwards, and that altered frames fail."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

Direction = Literal["to_server", "to_client"]
#: Called with each frame (direction, opcode, payload unmasked); returns the payload to send
#: on (the same length), or None to pass it unchanged.
Tamper = Callable[[Direction, int, bytes], bytes | None]


@dataclass
class Frame:
    direction: Direction
    opcode: int
    payload: bytes


def _parse(buf: bytearray) -> tuple[int, int, int, bytes | None, int] | None:
    """(total length, header length, opcode, mask, payload length) of the frame at the start of
    ``buf``; None while it is incomplete."""
    if len(buf) < 2:
        return None
    opcode, second = buf[0] & 0x0F, buf[1]
    length, at = second & 0x7F, 2
    if length == 126:
        if len(buf) < 4:
            return None
        (length,), at = struct.unpack_from("!H", buf, 2), 4
    elif length == 127:
        if len(buf) < 10:
            return None
        (length,), at = struct.unpack_from("!Q", buf, 2), 10
    mask = None
    if second & 0x80:
        if len(buf) < at + 4:
            return None
        mask, at = bytes(buf[at : at + 4]), at + 4
    if len(buf) < at + length:
        return None
    return at + length, at, opcode, mask, length


def _unmask(data: bytes, mask: bytes | None) -> bytes:
    if mask is None:
        return data
    return bytes(b ^ mask[i % 4] for i, b in enumerate(data))


@dataclass
class Relay:
    """Listens on ``port``; each connection is relayed to ``upstream`` (host, port)."""

    upstream: tuple[str, int]
    tamper: Tamper | None = None
    frames: list[Frame] = field(default_factory=list)
    raw: dict[Direction, bytearray] = field(
        default_factory=lambda: {"to_server": bytearray(), "to_client": bytearray()}
    )
    port: int = 0

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: Direction
    ) -> None:
        buf = bytearray()
        upgraded = False
        try:
            while data := await reader.read(65536):
                self.raw[direction] += data
                buf += data
                if not upgraded:  # the HTTP upgrade goes as it is
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    writer.write(bytes(buf[: end + 4]))
                    del buf[: end + 4]
                    upgraded = True
                while (parsed := _parse(buf)) is not None:
                    total, header, opcode, mask, _ = parsed
                    payload = _unmask(bytes(buf[header:total]), mask)
                    self.frames.append(Frame(direction, opcode, payload))
                    changed = self.tamper(direction, opcode, payload) if self.tamper else None
                    if changed is not None:
                        assert len(changed) == len(payload)
                        buf[header:total] = _unmask(changed, mask)  # masking is its own inverse
                    writer.write(bytes(buf[:total]))
                    del buf[:total]
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, "to_server"),
            self._pump(up_reader, writer, "to_client"),
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Relay]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield self
