"""A minimal token server written directly on the ``websockets`` library.

It speaks just enough of protocol v2 for ``seedance bench``: a ``generate`` text frame gets
``start``, one ``token`` frame per token and ``done``; a binary heartbeat ping gets a pong. It has
no sessions, no admission control, no limits and no merging: what a team writes by hand in an
afternoon, and the bar Seedance's token path is measured against.

    python -m benchmarks.peers.raw_websockets --port 9001 [--tokens-per-s R] [--ttft-ms T]
"""

from __future__ import annotations

import asyncio
import json

from websockets.asyncio.server import ServerConnection, serve

from benchmarks.peers._common import (
    decode_generate,
    done_frame,
    encode,
    engine_request,
    peer_main,
)
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.messages import HEARTBEAT_PING, HEARTBEAT_PONG


async def _serve_connection(ws: ServerConnection, engine: SyntheticEngine) -> None:
    number = 0
    async for message in ws:
        if isinstance(message, bytes):
            if message == HEARTBEAT_PING:
                await ws.send(HEARTBEAT_PONG, text=False)
            continue
        request = decode_generate(message)
        if request.type != "generate":
            continue
        number += 1
        request_id = request.request_id or f"r{number}"
        await ws.send(encode({"type": "start", "request_id": request_id}), text=True)
        completion = 0
        finish = "stop"
        stream = engine.generate(engine_request(engine, request, request_id))
        async for delta in stream:
            if delta.tokens:
                await ws.send(
                    encode(
                        {
                            "type": "token",
                            "token": delta.text,
                            "seq": completion,
                            "request_id": request_id,
                        }
                    ),
                    text=True,
                )
                completion += delta.tokens
            if delta.finish_reason is not None:
                finish = delta.finish_reason
        await ws.send(done_frame(request_id, finish, completion), text=True)


async def run(host: str, port: int, engine: SyntheticEngine) -> None:
    async def handler(ws: ServerConnection) -> None:
        await _serve_connection(ws, engine)

    async with serve(
        handler,
        host,
        port,
        subprotocols=None,
        ping_interval=None,
        compression=None,
        max_size=1 << 20,
        backlog=4096,
    ) as server:
        ports = [s.getsockname()[1] for s in server.sockets]
        print(json.dumps({"listening": f"ws://{host}:{ports[0]}/"}), flush=True)
        await asyncio.Future()


def main(argv: list[str] | None = None) -> None:
    peer_main(__doc__, 9001, run, argv)


if __name__ == "__main__":
    main()
