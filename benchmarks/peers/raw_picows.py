"""The same minimal token server as :mod:`.raw_websockets`, on picows (a WebSocket library
written in Cython): what the fastest Python WebSocket stack gives without any of Seedance.
Used by ``make bench`` to decide Seedance's server stack.

    python -m benchmarks.peers.raw_picows --port 9003 [--tokens-per-s R] [--ttft-ms T]
"""

from __future__ import annotations

import asyncio
import json

from picows import WSFrame, WSListener, WSMsgType, WSTransport, WSUpgradeRequest, ws_create_server

from benchmarks.peers._common import (
    GenerateFrame,
    decode_generate,
    done_frame,
    encode,
    engine_request,
    peer_main,
)
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.messages import (
    HEARTBEAT_PING,
    HEARTBEAT_PONG,
)


class _Handler(WSListener):
    def __init__(self, engine: SyntheticEngine) -> None:
        self.engine = engine
        self.number = 0
        self.task: asyncio.Task[None] | None = None

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type == WSMsgType.BINARY:
            if frame.get_payload_as_bytes() == HEARTBEAT_PING:
                transport.send(WSMsgType.BINARY, HEARTBEAT_PONG)
        elif frame.msg_type == WSMsgType.TEXT:
            request = decode_generate(frame.get_payload_as_bytes())
            if request.type == "generate":
                self.number += 1
                self.task = asyncio.create_task(self._generate(transport, request))
        elif frame.msg_type == WSMsgType.CLOSE:
            transport.send_close(frame.get_close_code())
            transport.disconnect()

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _generate(self, transport: WSTransport, request: GenerateFrame) -> None:
        request_id = request.request_id or f"r{self.number}"
        send = transport.send
        send(WSMsgType.TEXT, encode({"type": "start", "request_id": request_id}))
        completion = 0
        finish = "stop"
        engine = self.engine
        async for delta in engine.generate(engine_request(engine, request, request_id)):
            if delta.tokens:
                frame = {
                    "type": "token",
                    "token": delta.text,
                    "seq": completion,
                    "request_id": request_id,
                }
                send(WSMsgType.TEXT, encode(frame))
                completion += delta.tokens
            if delta.finish_reason is not None:
                finish = delta.finish_reason
        send(WSMsgType.TEXT, done_frame(request_id, finish, completion))


async def run(host: str, port: int, engine: SyntheticEngine) -> None:
    def factory(_: WSUpgradeRequest) -> WSListener:
        return _Handler(engine)

    server = await ws_create_server(factory, host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(json.dumps({"listening": f"ws://{host}:{bound}/"}), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    peer_main(__doc__, 9003, run, argv)


if __name__ == "__main__":
    main()
