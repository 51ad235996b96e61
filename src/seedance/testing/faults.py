"""A TCP proxy that puts network faults between a client and a server, on command: for the
SDKs' tests and for demos of what a client does when the network misbehaves.

::

    async with FaultProxy("127.0.0.1:8000") as proxy:   # listens on a free port
        async with connect(proxy.url) as session:         # ws://127.0.0.1:PORT
            proxy.delay_s = 0.075       # each direction: the round trip grows by 150 ms
            proxy.drop()                # close every connection (FIN)
            proxy.reset()               # abort every connection (RST)
            proxy.blackhole = True      # swallow every byte, leave connections open
            proxy.deaf = True           # swallow only the server's replies
            proxy.reset_rate = 0.048    # reset this share of new connections at once

From a shell, with commands on standard input (``delay 150``, ``drop``, ``reset``,
``blackhole on|off``, ``reset-rate 0.05``)::

    python -m seedance.testing.faults --listen 127.0.0.1:9000 --target 127.0.0.1:8000

Delays are added per chunk and direction without slowing the flow (a chunk goes out ``delay_s``
after it arrived, in order), as a long link does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import socket
import struct
import sys
from types import TracebackType

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


class _Link:
    """One client connection and its connection to the target."""

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []

    def close(self, *, abort: bool) -> None:
        for writer in (self.client, self.server):
            if abort:
                _abort(writer)
            else:
                writer.transport.close()
        for task in self.tasks:
            task.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a RST, not a FIN (linger on, for 0 s)."""
    with contextlib.suppress(OSError):
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Listens on ``listen`` (port 0: a free one) and forwards to ``target``, with faults."""

    def __init__(
        self, target: str, listen: str = "127.0.0.1:0", *, seed: int | None = None
    ) -> None:
        self.target = _address(target)
        self._listen = _address(listen)
        #: Added to each chunk, in each direction (seconds).
        self.delay_s = 0.0
        #: Swallow every byte (both ways), connections left open.
        self.blackhole = False
        #: Swallow what the target sends back, and only that: the client's requests are
        #: carried out, their replies never come (a reply lost on its way).
        self.deaf = False
        #: The share of new connections reset as soon as they are accepted.
        self.reset_rate = 0.0
        self.links: set[_Link] = set()
        #: Connections accepted, and those reset on arrival (``reset_rate``).
        self.accepted = 0
        self.refused = 0
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "start the proxy first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"ws://{self._listen[0]}:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, *self._listen)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self.drop()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def drop(self) -> None:
        """Close every open connection, both sides (a FIN each way)."""
        self._end_all(abort=False)

    def reset(self) -> None:
        """Abort every open connection, both sides (a RST each way)."""
        self._end_all(abort=True)

    def _end_all(self, *, abort: bool) -> None:
        links, self.links = self.links, set()
        for link in links:
            link.close(abort=abort)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.reset_rate and self._rng.random() < self.reset_rate:
            self.refused += 1
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            logger.info("fault proxy: target %s:%d refused: %s", *self.target, exc)
            writer.close()
            return
        link = _Link(writer, up_writer)
        self.links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, link)),
            asyncio.create_task(self._pump(up_reader, writer, link, back=True)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self.links.discard(link)
        link.close(abort=False)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        back: bool = False,
    ) -> None:
        """Forward one direction (``back``: the target's replies): each chunk goes out
        ``delay_s`` after it came, in order."""
        loop = asyncio.get_running_loop()

        def swallowed() -> bool:
            return self.blackhole or (back and self.deaf)

        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                when, data = await due.get()
                if not data:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                wait = when - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not swallowed():
                    writer.write(data)
                    await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if swallowed() and data:
                    continue
                due.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()


async def _main(args: argparse.Namespace) -> None:
    proxy = FaultProxy(args.target, args.listen)
    proxy.delay_s = args.delay_ms / 1000
    proxy.reset_rate = args.reset_rate
    async with proxy:
        print(f"fault proxy on {args.listen.rpartition(':')[0]}:{proxy.port} -> {args.target}")
        print("commands: delay MS | drop | reset | blackhole on|off | reset-rate SHARE | quit")
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                await asyncio.Event().wait()  # no terminal: serve until stopped
            words = line.split()
            match words:
                case ["delay", ms]:
                    proxy.delay_s = float(ms) / 1000
                case ["drop"]:
                    proxy.drop()
                case ["reset"]:
                    proxy.reset()
                case ["blackhole", ("on" | "off") as state]:
                    proxy.blackhole = state == "on"
                case ["reset-rate", share]:
                    proxy.reset_rate = float(share)
                case ["quit"]:
                    return
                case []:
                    continue
                case _:
                    print(f"unknown command: {line.strip()}")
                    continue
            print(
                f"delay {proxy.delay_s * 1000:g} ms, blackhole {'on' if proxy.blackhole else 'off'}"
                f", reset rate {proxy.reset_rate:g}, {len(proxy.links)} connection(s)"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m seedance.testing.faults", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (default a free port)")
    parser.add_argument("--target", required=True, help="HOST:PORT of the server")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added each way")
    parser.add_argument(
        "--reset-rate", type=float, default=0.0, help="share of new connections reset"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
