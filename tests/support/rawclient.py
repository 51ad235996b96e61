"""A blocking WebSocket client over a plain socket, framing by the ``websockets`` sans-I/O
protocol: it sends what a test says and reads only when told, so tests can play a client that
never reads."""

from __future__ import annotations

import json
import socket
from collections import deque
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri


class RawClient:
    def __init__(self, port: int, query: str = "", *, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        uri = parse_uri(f"ws://127.0.0.1:{port}/v2/infer" + (f"?{query}" if query else ""))
        self.proto = ClientProtocol(uri, max_size=None)
        self._frames: deque[Frame] = deque()  # parsed, not yet returned
        self.proto.send_request(self.proto.connect())
        self.flush()
        self.session = self.recv_json()

    def flush(self) -> None:
        for data in self.proto.data_to_send():
            if data:
                self.sock.sendall(data)

    def send_text(self, text: str) -> None:
        self.proto.send_text(text.encode())
        self.flush()

    def send_json(self, obj: Any) -> None:
        self.send_text(json.dumps(obj))

    def send_binary(self, data: bytes) -> None:
        self.proto.send_binary(data)
        self.flush()

    def send_ping(self, payload: bytes) -> None:
        self.proto.send_ping(payload)
        self.flush()

    def recv_frame(self) -> Frame:
        while True:
            for event in self.proto.events_received():  # every event parsed: keep them all
                if isinstance(event, Frame):
                    self._frames.append(event)
                else:
                    assert isinstance(event, Response) and event.status_code == 101, event
            if self._frames:
                return self._frames.popleft()
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.proto.receive_data(data)

    def recv_json(self) -> Any:
        while True:
            frame = self.recv_frame()
            if frame.opcode == Opcode.TEXT:
                return json.loads(frame.data)

    def close(self) -> None:
        self.sock.close()
