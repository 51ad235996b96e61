"""The two ends of suite 20's relay runs, each run in a region's network namespace
(``ip netns exec``) by :mod:`benchmarks.relay_suite`; each prints one JSON line.

``quic FAR_URL CA KEY STREAMS TOKENS COPIES``
    In the edge's namespace: ``STREAMS`` relayed requests at once to the far gateway over one
    QUIC connection (Seedance's own link, :class:`seedance.relay.client.Peer`, each request a
    stream with its relay token; each packet sent ``COPIES`` times both ways), every token's
    arrival timed.
``ws-far PORT CERT KEY CA FAR_HTTP DEFLATE``
    In the far's namespace: the baseline's far end, a WebSocket server over TLS that takes
    requests tagged with an id on one connection, has the far gateway serve each
    (``POST /v2/relay`` on loopback) and sends its lines back on that one connection.
``ws URL CA KEY STREAMS TOKENS DEFLATE``
    In the edge's namespace: the same requests as ``quic``, over the one WebSocket (over TCP
    and TLS) to ``ws-far``.

Each request's timings: its time to first token, and every token's gap after the one before
(tokens of one line arrive together: the first has the gap, the others none).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
from typing import Any

from seedance.keyfiles import load_private
from seedance.relay.tokens import mint

PROMPT = "Tell me about the weather over the Atlantic today, in detail."


def _body(index: int, tokens: int) -> bytes:
    messages = [{"role": "user", "content": f"{PROMPT} ({index})"}]
    return json.dumps({"generate": {"messages": messages, "max_tokens": tokens}}).encode()


class Timings:
    def __init__(self) -> None:
        self.ttft_ms: list[float] = []
        self.gaps_ms: list[float] = []
        self.tokens = 0
        self.errors = 0

    def request(self) -> _Request:
        return _Request(self)

    def result(self, wall_s: float) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft_ms,
            "gaps_ms": self.gaps_ms,
            "tokens": self.tokens,
            "errors": self.errors,
            "wall_s": wall_s,
        }


class _Request:
    def __init__(self, timings: Timings) -> None:
        self.timings = timings
        self.sent = time.perf_counter()
        self.last: float | None = None

    def line(self, line: bytes) -> bool:
        """One line of the reply; true at its end."""
        frame = json.loads(line)
        now = time.perf_counter()
        if frame["type"] == "token":
            n = int(frame["n"])
            if self.last is None:
                self.timings.ttft_ms.append((now - self.sent) * 1000)
            else:
                self.timings.gaps_ms.append((now - self.last) * 1000)
            self.timings.gaps_ms.extend([0.0] * (n - 1))
            self.timings.tokens += n
            self.last = now
        elif frame["type"] == "error":
            self.timings.errors += 1
            return True
        return bool(frame["type"] == "done")


def _token(key_file: str) -> str:
    return mint(
        load_private(key_file), issuer="edge-1", audience="far-1", tenant="bench", session=None
    )


async def quic(
    far_url: str, ca: str, key_file: str, streams: int, tokens: int, copies: int
) -> dict[str, Any]:
    from seedance.relay.client import Peer

    peer = Peer(far_url, ca_file=ca, copies=copies)
    timings = Timings()

    async def one(index: int) -> None:
        request = timings.request()
        headers = [(b"authorization", f"Bearer {_token(key_file)}".encode())]
        try:
            response = await peer.post("/v2/relay", headers, _body(index, tokens))
            pending = b""
            async for chunk in response.body:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    request.line(line)
        except Exception:
            timings.errors += 1

    await peer.post("/v2/relay", [(b"authorization", f"Bearer {_token(key_file)}".encode())],
                    _body(-1, 1))  # fmt: skip  # the connection up first: not a request's cost
    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - started
    await peer.close()
    return timings.result(wall)


async def ws_far(port: int, cert: str, key: str, ca: str, far_http: str, deflate: bool) -> None:
    import aiohttp
    import websockets

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=ca)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trusted, limit=0))

    async def serve(ws: Any) -> None:
        async def one(message: dict[str, Any]) -> None:
            headers = {"authorization": f"Bearer {message['token']}"}
            async with http.post(far_http, data=message["body"], headers=headers) as answer:
                async for line in answer.content:
                    await ws.send(json.dumps({"id": message["id"], "line": line.decode()}))

        tasks = set()
        async for raw in ws:
            task = asyncio.create_task(one(json.loads(raw)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    compression = "deflate" if deflate else None
    async with websockets.serve(serve, "0.0.0.0", port, ssl=context, compression=compression,
                                max_size=None, ping_interval=None):  # fmt: skip
        print(json.dumps({"ready": port}), flush=True)
        await asyncio.Future()


async def ws(
    url: str, ca: str, key_file: str, streams: int, tokens: int, deflate: bool
) -> dict[str, Any]:
    import websockets

    context = ssl.create_default_context(cafile=ca)
    timings = Timings()
    requests: dict[int, _Request] = {}
    finished: dict[int, asyncio.Future[None]] = {}
    compression = "deflate" if deflate else None
    async with websockets.connect(url, ssl=context, compression=compression, max_size=None,
                                  ping_interval=None) as socket:  # fmt: skip

        async def read() -> None:
            async for raw in socket:
                message = json.loads(raw)
                index = message["id"]
                if requests[index].line(message["line"].encode()):
                    finished[index].set_result(None)

        reader = asyncio.create_task(read())
        warm = -1  # a first request, not counted: the connection's TCP and TLS set up
        requests[warm] = Timings().request()
        finished[warm] = asyncio.get_running_loop().create_future()
        await socket.send(json.dumps({"id": warm, "token": _token(key_file),
                                      "body": _body(warm, 1).decode()}))  # fmt: skip
        await finished[warm]
        started = time.perf_counter()
        for index in range(streams):
            requests[index] = timings.request()
            finished[index] = asyncio.get_running_loop().create_future()
            await socket.send(json.dumps({"id": index, "token": _token(key_file),
                                          "body": _body(index, tokens).decode()}))  # fmt: skip
        await asyncio.gather(*(finished[i] for i in range(streams)))
        wall = time.perf_counter() - started
        reader.cancel()
    return timings.result(wall)


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "quic":
        far_url, ca, key, streams, tokens, copies = args
        result = asyncio.run(quic(far_url, ca, key, int(streams), int(tokens), int(copies)))
    elif mode == "ws":
        url, ca, key, streams, tokens, deflate = args
        result = asyncio.run(ws(url, ca, key, int(streams), int(tokens), deflate == "1"))
    elif mode == "ws-far":
        port, cert, key, ca, far_http, deflate = args
        asyncio.run(ws_far(int(port), cert, key, ca, far_http, deflate == "1"))
        return
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
