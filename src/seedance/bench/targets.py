"""The servers ``seedance bench`` drives: a Seedance WebSocket endpoint, or any
OpenAI-compatible server over HTTP + SSE.

A target opens :class:`Conn` objects, one per simulated user; a connection runs one request at a
time and fills in its :class:`~seedance.bench.metrics.Sample`. The clients are built for a low
cost per token (picows for WebSocket, aiohttp for HTTP), so the load generator is not what is
being measured.

A WebSocket target may ask for end-to-end encryption (docs/protocol.md, section 9), pinning the
server's identity: each connection agrees its keys, seals its requests and opens every frame
it receives, and a frame's time is taken once it is opened, as an application would see it, so
the figures include the client's share of the cost. ``wss://`` URLs take a TLS context (a CA
file's, for a private CA).
"""

from __future__ import annotations

import abc
import asyncio
import ssl
import time
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from seedance.bench.metrics import Sample
from seedance.protocol import e2e
from seedance.protocol.errors import EncryptionFailed
from seedance.protocol.messages import HEARTBEAT_PING, HEARTBEAT_PONG, SUBPROTOCOL
from seedance.protocol.openai import ChunkUsage, decode_stream_chunk, sse_data

try:
    import aiohttp
    from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"seedance bench needs the 'bench' extra ({exc.name} is missing): "
        "pip install 'seedance[bench]'"
    ) from exc


class BenchError(Exception):
    """A request failed; ``code`` is the server's error code or a transport failure."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code


class Conn(abc.ABC):
    """One simulated user's connection."""

    @abc.abstractmethod
    async def request(self, sample: Sample, prompt: str, max_tokens: int, clock: Clock) -> None:
        """Run one request, filling ``sample``; raises :class:`BenchError` on failure."""

    async def heartbeat(self) -> float:
        """One heartbeat round trip in seconds (WebSocket targets only)."""
        raise BenchError("unsupported", "this target has no heartbeat")

    @abc.abstractmethod
    async def close(self) -> None: ...


class Target(abc.ABC):
    name: str
    #: Extra fields of every request (``{"temperature": 0}``), the same on every target kind.
    fields: dict[str, Any] = {}  # replaced, never mutated

    async def prepare(self) -> None:  # noqa: B027 - optional hook
        """Anything to do once before the first connection."""

    @abc.abstractmethod
    async def connect(self) -> Conn: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`prepare` took."""


class Clock:
    """Seconds since the start of the run."""

    __slots__ = ("origin",)

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin


# --------------------------------------------------------------------------- WebSocket


class _ErrorBody(msgspec.Struct):
    code: str = "error"
    message: str = ""


class _Timing(msgspec.Struct):
    queue_ms: float | None = None
    ttft_ms: float | None = None


class _Frame(msgspec.Struct):
    """The fields of a server frame the load generator looks at (others are skipped)."""

    type: str
    timing: _Timing | None = None
    n: int = 1
    finish_reason: str | None = None
    error: _ErrorBody | None = None
    prompt_tokens: int | None = None


_decode_frame = msgspec.json.Decoder(_Frame).decode
_TOKEN_PREFIX = b'{"type":"token"'
_SEALED = bytes((e2e.SEALED,))


class _Hello(msgspec.Struct):
    """The ``session`` frame's fields an encrypting client needs."""

    type: str
    session_id: str = ""
    offer: e2e.Offer | None = msgspec.field(default=None, name="e2e")
    error: _ErrorBody | None = None


_decode_hello = msgspec.json.Decoder(_Hello).decode


class _Listener(WSListener):
    """Routes the frames of one connection to the request running on it."""

    def __init__(self, hello: bool = False) -> None:
        self.sample: Sample | None = None
        self.clock: Clock | None = None
        self.done: asyncio.Future[None] | None = None
        self.pong: asyncio.Future[float] | None = None
        self.closed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.transport: WSTransport | None = None
        #: End-to-end encryption: the ``session`` frame (``hello``: made before the handshake,
        #: as the frame may come in the same read as the upgrade), then every frame that comes
        #: is opened with ``channel`` (None: a plain connection).
        self.hello: asyncio.Future[bytes] | None = (
            asyncio.get_running_loop().create_future() if hello else None
        )
        self.channel: e2e.Channel | None = None

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        kind = frame.msg_type
        if kind == WSMsgType.TEXT:
            self._on_text(frame.get_payload_as_bytes())
        elif kind == WSMsgType.BINARY:
            payload = frame.get_payload_as_bytes()
            if self.channel is not None and payload[:1] == _SEALED:
                self._on_sealed(transport, self.channel, payload)
            elif payload == HEARTBEAT_PING:
                transport.send(WSMsgType.BINARY, HEARTBEAT_PONG)
            elif payload == HEARTBEAT_PONG and self.pong is not None and not self.pong.done():
                self.pong.set_result(time.perf_counter())
        elif kind == WSMsgType.CLOSE:
            code = int(frame.get_close_code().value)
            self._fail(BenchError(f"closed_{code}", f"the server closed with {code}"))
            if not self.closed.done():
                self.closed.set_result(code)

    def _on_sealed(self, transport: WSTransport, channel: e2e.Channel, payload: bytes) -> None:
        try:
            text = channel.open(payload)
        except EncryptionFailed as exc:  # nothing of it is counted; the connection is over
            self._fail(BenchError("encryption_failed", f"{exc.reason}: {exc.message}"))
            transport.disconnect()
            return
        self._on_text(text.encode() if isinstance(text, str) else text)

    def _on_text(self, payload: bytes) -> None:
        sample, clock = self.sample, self.clock
        if sample is None or clock is None:
            if self.hello is not None and not self.hello.done():
                self.hello.set_result(payload)
            return
        now = clock.now()
        if payload.startswith(_TOKEN_PREFIX):
            n = _decode_frame(payload).n if b'"n":' in payload else 1
            sample.add_chunk(now, n)
            return
        frame = _decode_frame(payload)
        if frame.type == "start":
            sample.prompt_tokens = frame.prompt_tokens
        elif frame.type == "done":
            sample.end = now
            sample.finish_reason = frame.finish_reason
            if frame.timing is not None:
                sample.server_ttft_ms = frame.timing.ttft_ms
                sample.server_queue_ms = frame.timing.queue_ms
            self._finish(None)
        elif frame.type == "error":
            sample.end = now
            error = frame.error or _ErrorBody()
            self._fail(BenchError(error.code, error.message))

    def _finish(self, error: BaseException | None) -> None:
        done = self.done
        if done is not None and not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def _fail(self, error: BaseException) -> None:
        self._finish(error)
        if self.pong is not None and not self.pong.done():
            self.pong.set_exception(error)
        if self.hello is not None and not self.hello.done():
            self.hello.set_exception(error)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self._fail(BenchError("disconnected", "the connection dropped"))
        if not self.closed.done():
            self.closed.set_result(1006)


class WebSocketConn(Conn):
    def __init__(self, transport: WSTransport, listener: _Listener, fields: dict[str, Any]) -> None:
        self.transport = transport
        self.listener = listener
        self.fields = fields
        self.number = 0

    async def request(self, sample: Sample, prompt: str, max_tokens: int, clock: Clock) -> None:
        listener = self.listener
        if listener.closed.done():
            raise BenchError("disconnected", "the connection is closed")
        self.number += 1
        loop = asyncio.get_running_loop()
        listener.sample, listener.clock = sample, clock
        listener.done = loop.create_future()
        message = _encode(
            {
                "type": "generate",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "request_id": f"b{self.number}",
                "reset": True,
                **self.fields,
            }
        )
        if not sample.sent:
            sample.sent = clock.now()
        channel = listener.channel
        if channel is None:
            self.transport.send(WSMsgType.TEXT, message)
        else:  # sealed after ``sent``: the request's time includes it
            sealed = channel.seal(message.decode(), f"b{self.number}")
            self.transport.send(WSMsgType.BINARY, sealed)
        try:
            await listener.done
        finally:
            listener.sample = listener.clock = listener.done = None

    async def heartbeat(self) -> float:
        listener = self.listener
        if listener.closed.done():
            raise BenchError("disconnected", "the connection is closed")
        listener.pong = asyncio.get_running_loop().create_future()
        sent = time.perf_counter()
        self.transport.send(WSMsgType.BINARY, HEARTBEAT_PING)
        try:
            return await listener.pong - sent
        finally:
            listener.pong = None

    async def close(self) -> None:
        if not self.listener.closed.done():
            self.transport.send_close()
            self.transport.disconnect()
        await self.transport.wait_disconnected()


_encode = msgspec.json.Encoder().encode


class WebSocketTarget(Target):
    """A Seedance ``/v2/infer`` URL (or any server speaking the same frames); with ``pinned``
    (the server's identity) every connection is encrypted end to end, and ``tls`` is
    the context of a ``wss://`` URL (None: the system's CAs)."""

    def __init__(
        self, url: str, *, pinned: Ed25519PublicKey | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.url = url
        self.name = url
        self.pinned = pinned
        self.tls = tls

    async def connect(self) -> Conn:
        handshake = None if self.pinned is None else e2e.ClientHandshake(self.pinned)
        url = self.url if handshake is None else handshake.url(self.url)
        try:
            transport, listener = await ws_connect(
                lambda: _Listener(hello=handshake is not None),
                url,
                ssl_context=self.tls,
                extra_headers={"Sec-WebSocket-Protocol": SUBPROTOCOL},
                websocket_handshake_timeout=30,
                max_frame_size=16 * 1024 * 1024,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise BenchError("connect_failed", f"cannot connect to {self.url}: {exc}") from exc
        except Exception as exc:  # picows handshake errors
            raise BenchError("handshake_failed", f"{self.url}: {exc}") from exc
        if not isinstance(listener, _Listener):  # the server went away during the handshake
            raise BenchError("connect_failed", f"{self.url}: the connection closed at once")
        if handshake is not None:
            await self._agree(handshake, transport, listener)
        return WebSocketConn(transport, listener, self.fields)

    async def _agree(
        self, handshake: e2e.ClientHandshake, transport: WSTransport, listener: _Listener
    ) -> None:
        """Wait for the ``session`` frame and agree the connection's keys from its offer."""
        assert listener.hello is not None
        try:
            hello = _decode_hello(await asyncio.wait_for(listener.hello, 30))
            if hello.type == "error":
                error = hello.error or _ErrorBody()
                raise BenchError(error.code, error.message)
            listener.channel = handshake.finish(hello.offer, hello.session_id)
        except (BenchError, asyncio.TimeoutError, EncryptionFailed, msgspec.DecodeError) as exc:
            transport.disconnect()
            if isinstance(exc, BenchError):
                raise
            raise BenchError("handshake_failed", f"{self.url}: end-to-end: {exc}") from exc
        finally:
            listener.hello = None


# --------------------------------------------------------------------------- OpenAI HTTP + SSE


class OpenAIConn(Conn):
    def __init__(self, target: OpenAITarget, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session

    async def request(self, sample: Sample, prompt: str, max_tokens: int, clock: Clock) -> None:
        target = self.target
        body = {
            "model": target.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **target.fields,
        }
        if not sample.sent:
            sample.sent = clock.now()
        usage: ChunkUsage | None = None
        try:
            async with await self._post(_encode(body)) as response:
                if response.status != 200:
                    raise BenchError(await _http_error_code(response), f"HTTP {response.status}")
                async for data in sse_data(response.content):
                    chunk = decode_stream_chunk(data)
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        if choice.content or choice.calls:
                            sample.add_chunk(clock.now(), 1)
                        if choice.finish_reason is not None:
                            sample.finish_reason = choice.finish_reason
        except aiohttp.ClientError as exc:
            raise BenchError(f"http_failed: {type(exc).__name__}", str(exc)) from exc
        sample.end = clock.now()
        if usage is not None:
            sample.prompt_tokens = usage.prompt_tokens
            if usage.completion_tokens and sample.chunk_tokens:
                # Servers may pack several tokens into one event: trust the usage count.
                sample.chunk_tokens[-1] += usage.completion_tokens - sample.tokens
                sample.tokens = usage.completion_tokens

    async def _post(self, body: bytes) -> aiohttp.ClientResponse:
        target = self.target
        url = f"{target.base_url}/chat/completions"
        try:
            return await self.session.post(url, data=body, headers=target.headers)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if target.new_connection or isinstance(exc, aiohttp.ClientConnectorError):
                raise  # a new connection failed: nothing was kept alive
            # The server closed a kept-alive connection before taking the request (llama.cpp's
            # server does after each stream): send it once more on a connection of its own.
            return await target.one_off().post(url, data=body, headers=target.headers)

    async def close(self) -> None:
        if self.session is not self.target.shared:
            await self.session.close()


async def _http_error_code(response: aiohttp.ClientResponse) -> str:
    try:
        body = await response.json(content_type=None)
        error = body.get("error") or {}
        return str(error.get("code") or error.get("type") or f"http_{response.status}")
    except Exception:
        return f"http_{response.status}"


class OpenAITarget(Target):
    """An OpenAI-compatible ``/v1`` base URL; ``model`` defaults to the first one it lists."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        new_connection: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.new_connection = new_connection
        self.shared: aiohttp.ClientSession | None = None
        self._one_off: aiohttp.ClientSession | None = None

    def one_off(self) -> aiohttp.ClientSession:
        """A session whose every request opens a connection of its own (for retries)."""
        if self._one_off is None:
            self._one_off = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            )
        return self._one_off

    async def prepare(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=self.new_connection)
        self.shared = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)
        )
        if self.model is None:
            try:
                async with self.shared.get(
                    f"{self.base_url}/models", headers=self.headers
                ) as response:
                    body: dict[str, Any] = await response.json(content_type=None)
                self.model = str(body["data"][0]["id"])
            except Exception as exc:
                raise BenchError(
                    "no_model", f"cannot list models at {self.base_url}/models: {exc}; pass --model"
                ) from exc

    async def connect(self) -> Conn:
        assert self.shared is not None, "prepare() first"
        return OpenAIConn(self, self.shared)

    async def close(self) -> None:
        for session in (self.shared, self._one_off):
            if session is not None:
                await session.close()
