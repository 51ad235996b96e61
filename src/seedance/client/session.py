"""Asyncio client for ``/v2/infer``, built on :mod:`seedance.protocol` and ``websockets``.

::

    async with connect("ws://127.0.0.1:8000", session_id="abc") as session:
        async for chunk in session.generate("hello", max_tokens=32, resumable=True):
            print(chunk.text, end="", flush=True)
        rtt_s = await session.ping()

Server errors are raised as the typed exceptions of :mod:`seedance.protocol.errors`.

When the connection drops (no close frame, a server restart or shutdown, 1011, 1013), the
session reconnects on its own (:class:`Reconnect`: jittered, doubling waits, a bounded number
of tries) to the same session and resumes every ``resumable`` stream from the last token it
holds: the iterator goes on as if nothing happened, every token once. A stream the server can
no longer resume raises :class:`~seedance.protocol.errors.HistoryLost` with its ``reason``; a
stream that was not resumable raises :class:`~seedance.protocol.errors.ConnectionClosed`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import ssl as ssl_module
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgspec
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed as WsConnectionClosed
from websockets.exceptions import InvalidHandshake

from seedance.protocol.codec import decode_server_text, encode_client_message
from seedance.protocol.e2e import SEALED, Channel, ClientHandshake, load_pinned
from seedance.protocol.errors import (
    ConnectionClosed,
    EncryptionFailed,
    InvalidRequest,
    SeedanceError,
    error_from_wire,
)
from seedance.protocol.messages import (
    HEARTBEAT_PING,
    HEARTBEAT_PONG,
    SUBPROTOCOL,
    Cancel,
    ChatMessage,
    DoneFrame,
    Embed,
    EmbeddingsFrame,
    EmbeddingsUsage,
    EndSession,
    ErrorFrame,
    Generate,
    Ping,
    PongFrame,
    Resume,
    ServerFrame,
    SessionFrame,
    StartFrame,
    TokenFrame,
    TokenLogprob,
)
from seedance.protocol.qos import QoS
from seedance.protocol.tensors import TENSOR, Tensor, decode_tensor, encode_tensor

logger = logging.getLogger(__name__)

#: Close codes after which the session reconnects: no close frame, the server going away or
#: restarting, a fault of the server, try again later.
RECONNECT_CODES = frozenset({1001, 1006, 1011, 1012, 1013})


@dataclass(frozen=True, slots=True)
class Reconnect:
    """How a session reconnects after its connection dropped: up to ``attempts`` tries, each
    after a wait drawn uniformly below ``first_delay_s`` doubled per try (at most
    ``max_delay_s``): full jitter, so that many clients of one server do not come back at once."""

    attempts: int = 6
    first_delay_s: float = 0.1
    max_delay_s: float = 5.0

    def delays(self, rng: random.Random) -> Iterator[float]:
        for attempt in range(self.attempts):
            yield rng.uniform(0, min(self.max_delay_s, self.first_delay_s * 2**attempt))


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Text of one token frame: tokens ``seq`` .. ``seq + n - 1`` of the reply (and their log
    probabilities, one each, when the request asked for ``logprobs``; the tensor frames sent
    with it by name, when it asked for ``tensors``: ``token_ids`` an int32 array of ``n``)."""

    text: str
    seq: int
    n: int = 1
    logprobs: list[TokenLogprob] | None = None
    tensors: dict[str, np.ndarray] | None = None


def infer_url(url: str, **params: str | None) -> str:
    """``ws://host:port`` (path optional) plus query parameters, pointing at ``/v2/infer``."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise InvalidRequest(f"url must start with ws:// or wss://, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/v2/infer"
    query = urlencode({k: v for k, v in params.items() if v is not None})
    if parts.query:
        query = f"{parts.query}&{query}" if query else parts.query
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


def tls_context(
    url: str, ca_file: str | None, context: ssl_module.SSLContext | None
) -> ssl_module.SSLContext | None:
    """The TLS context for ``url``: ``context`` if given, else the system's CAs (``ca_file``'s
    instead when given) for ``wss://``; None for ``ws://``."""
    if context is not None:
        return context
    if not url.startswith("wss://"):
        if ca_file is not None:
            raise InvalidRequest("ca_file is for wss:// URLs")
        return None
    return ssl_module.create_default_context(cafile=ca_file)


class Stream:
    """One request's reply: an async iterator of :class:`TokenChunk`.

    After the iteration ends, :attr:`done` holds the ``done`` frame (usage, timing,
    ``finish_reason``) and :attr:`text` the whole reply.
    """

    def __init__(self, session: ClientSession, message: Generate) -> None:
        self._tensor: bytes | None = None  # a tensor frame the request sends first
        self._session = session
        self._message = message
        self.request_id: str = message.request_id or ""
        self.start: StartFrame | None = None
        self.done: DoneFrame | None = None
        self.resumable = message.resumable
        #: The index of the last token received (-1: none): where a resume starts from.
        self.last_seq = -1
        self._parts: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._tensors: dict[str, list[np.ndarray]] = {}  # by name, the chunks' in order
        self._pending: list[Tensor] = []  # tensor frames that wait for their token frame
        # Unbounded: the reader never waits on one stream (heartbeats keep flowing).
        self._queue: asyncio.Queue[ServerFrame | Tensor | BaseException] = asyncio.Queue()
        self._sent = False
        self._on_wire = False  # its generate went out on a connection
        self._failure: BaseException | None = None

    @property
    def text(self) -> str:
        if self.done is not None and self.done.text is not None:
            return self.done.text
        return "".join(self._parts)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Each token's log probability, in order, when the request asked for ``logprobs``."""
        if self.done is not None and self.done.logprobs is not None:
            return self.done.logprobs
        return self._logprobs

    def tensor(self, name: str) -> np.ndarray:
        """The tensor frames named ``name`` of the reply so far, joined along their first
        dimension (``token_ids``: one int32 per token)."""
        parts = self._tensors.get(name)
        if not parts:
            raise KeyError(f"no {name!r} tensor came with this reply (ask for tensors=[...])")
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._failure is not None:
            raise self._failure
        if not self._sent:
            self._sent = True
            await self._session._send_generate(self)
        while self.done is None:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._failure = item
                raise item
            if isinstance(item, Tensor):  # its token frame comes next
                self._pending.append(item)
                continue
            if isinstance(item, TokenFrame):
                pending, self._pending = self._pending, []
                last = item.seq + item.n - 1
                if last <= self.last_seq:  # already held (a resume after a drop)
                    continue
                self.last_seq = last
                self._parts.append(item.token)
                if item.logprobs is not None:
                    self._logprobs.extend(item.logprobs)
                tensors = None
                if pending:
                    tensors = {t.name: t.array for t in pending if t.seq == item.seq}
                    for name, array in tensors.items():
                        self._tensors.setdefault(name, []).append(array)
                return TokenChunk(item.token, item.seq, item.n, item.logprobs, tensors)
            if isinstance(item, StartFrame):
                self.start = self.start or item  # a resume sends it again
            elif isinstance(item, DoneFrame):
                self.done = item
        raise StopAsyncIteration

    async def collect(self) -> DoneFrame:
        """Read the reply to its end and return the ``done`` frame."""
        async for _ in self:
            pass
        assert self.done is not None
        return self.done

    async def cancel(self) -> None:
        await self._session.cancel(self.request_id)


@dataclass(frozen=True, slots=True)
class Opened:
    """A connection as the handshake left it: the socket, the ``session`` frame, and the
    end-to-end encryption agreed (None: none asked for)."""

    ws: ClientConnection
    info: SessionFrame
    channel: Channel | None = None


Opener = Callable[[str], Awaitable[Opened]]


@dataclass(frozen=True, slots=True)
class Embeddings:
    """The answer of :meth:`ClientSession.embed_array`: a float32 row per input, read
    straight from the server's tensor frame (no copy, read-only)."""

    vectors: np.ndarray
    model: str
    usage: EmbeddingsUsage
    request_id: str


#: A pinned server identity (see :func:`seedance.protocol.e2e.load_pinned`).
PinnedKey = str | bytes | Ed25519PublicKey


class ClientSession:
    """One connection to a server session. Create it with :func:`connect`."""

    def __init__(
        self,
        opened: Opened,
        reopen: Opener | None = None,
        reconnect: Reconnect | None = None,
    ) -> None:
        self._ws = opened.ws
        self.info = opened.info
        #: End-to-end encryption of this connection (None: not asked for); a new one per
        #: reconnect. Frames are sealed in the order they are sent (``_send_lock``).
        self.channel = opened.channel
        self._send_lock = asyncio.Lock()
        self._reopen = reopen
        self._reconnect_policy = reconnect if reopen is not None else None
        self._rng = random.Random()
        #: Times the session reconnected after a drop.
        self.reconnects = 0
        self._closing = False  # close() or end() was called: no reconnect
        self._connected = asyncio.Event()
        self._connected.set()
        self._streams: dict[str, Stream] = {}
        self._pongs: deque[tuple[asyncio.Future[float], float]] = deque()
        self._json_pongs: dict[str, asyncio.Future[float]] = {}
        self._embeds: dict[str, asyncio.Future[EmbeddingsFrame]] = {}
        #: The tensor frames received for the embeds waiting, by request id and name.
        self._tensors: dict[str, dict[str, np.ndarray]] = {}
        self._error: SeedanceError | None = None  # an error frame about the connection
        self._closed: ConnectionClosed | None = None
        self._reader = asyncio.create_task(self._read_forever(), name="seedance-client-reader")

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def model(self) -> str:
        return self.info.model

    @property
    def created(self) -> bool:
        return self.info.created

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def busy(self) -> bool:
        """A reply is running on the session (a session runs one at a time)."""
        return bool(self._streams)

    @property
    def close_code(self) -> int | None:
        return self._closed.received_code if self._closed else None

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
        stream: bool = True,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        request_id: str | None = None,
        reset: bool = False,
        priority: int = 0,
        resumable: bool = False,
        qos: QoS | str | None = None,
        schema: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tensors: Sequence[str] | None = None,
        prompt_ids: Sequence[int] | np.ndarray | None = None,
    ) -> Stream:
        """Ask for a reply; iterate the result for its tokens. ``priority`` (-10 to 10, within
        the tenant's maximum) orders the request in the server's admission queue.
        ``resumable``: the reply survives a dropped connection (the session reconnects and
        resumes it). ``qos``: this request's quality of service, instead of the session's
        (``X-QoS-Priority``: a class, an SLA tag, a health score). ``schema``: a JSON Schema
        the reply is bound to (a Pydantic model's ``model_json_schema()``, say): the reply is
        a JSON document valid for it, unless ``max_tokens`` cuts it (``finish_reason``
        ``length``). ``logprobs``: each token comes with its log probability and this many
        likeliest alternatives (0 to 20; :attr:`Stream.logprobs`, :attr:`TokenChunk.logprobs`).
        ``tools``, ``tool_choice``, ``parallel_tool_calls``: functions the reply may call, as
        OpenAI's Chat Completions takes them; the ``done`` frame's ``tool_calls`` holds the
        calls made, and a later request answers them with ``{"role": "tool", "tool_call_id":
        ..., "content": ...}`` messages. ``tensors``: outputs that come as tensor frames beside
        the token frames (``token_ids``, ``logprobs``, ``top_logprobs``): each chunk's in
        :attr:`TokenChunk.tensors`, the whole reply's from :meth:`Stream.tensor`.
        ``prompt_ids``: the prompt as the model's token ids instead of ``prompt``, continued as
        they are (no chat template, no session history; an integer array goes up as a tensor
        frame)."""
        fields: dict[str, Any] = {
            "prompt": prompt,
            "stream": stream,
            "seed": seed,
            "request_id": request_id or "c-" + secrets.token_hex(6),
            "reset": reset,
            "priority": priority,
            "resumable": resumable,
            "qos": qos.header() if isinstance(qos, QoS) else qos,
            "schema": dict(schema) if schema is not None else None,
            "logprobs": logprobs,
            "tools": [dict(tool) for tool in tools] if tools is not None else None,
            "tool_choice": dict(tool_choice) if isinstance(tool_choice, Mapping) else tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "tensors": list(tensors) if tensors is not None else None,
        }
        tensor = None
        if isinstance(prompt_ids, np.ndarray):
            fields["prompt_tensor"] = "prompt_ids"
            tensor = encode_tensor(Tensor(fields["request_id"], "prompt_ids", prompt_ids))
        elif prompt_ids is not None:
            fields["prompt_ids"] = [int(token) for token in prompt_ids]
        if messages is not None:
            fields["messages"] = [
                m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage)
                for m in messages
            ]
        for name, value in (
            ("max_tokens", max_tokens),
            ("temperature", temperature),
            ("top_p", top_p),
        ):
            if value is not None:
                fields[name] = value
        if stop is not None:
            fields["stop"] = stop if isinstance(stop, str) else list(stop)
        reply = Stream(self, Generate(**fields))
        reply._tensor = tensor
        return reply

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> DoneFrame:
        """Ask for a whole reply (``stream: false``); the ``done`` frame carries ``text``."""
        return await self.generate(prompt, stream=False, **kwargs).collect()

    async def embed(
        self,
        input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        model: str | None = None,
        encoding_format: Literal["float", "base64"] = "float",
        request_id: str | None = None,
    ) -> EmbeddingsFrame:
        """Vectors for ``input`` (a string, strings, token ids, or lists of them) from an
        embedding model (None: the server's first), in an ``embeddings`` frame; an error frame
        about it raises. A drop of the connection before the answer raises too (an ``embed``
        is not resumed: send it again). :meth:`embed_array` has them as one array."""
        items = input if isinstance(input, str) else [
            item if isinstance(item, (str, int)) else list(item) for item in input
        ]  # fmt: skip
        message = Embed(input=items, model=model, encoding_format=encoding_format)
        return await self._embed(message, request_id)

    async def embed_array(
        self,
        input: str | Sequence[str] | np.ndarray,
        *,
        model: str | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """Vectors for ``input`` as one float32 array, a row per input, sent by the server
        as a tensor frame (``encoding_format: tensor``). ``input``: text, or token ids as an
        integer array (one row, or a row per input), sent as a tensor frame of its own."""
        message = Embed(model=model, encoding_format="tensor")
        ids = None
        if isinstance(input, np.ndarray):
            message.input_tensor, ids = "input_ids", input
        else:
            message.input = input if isinstance(input, str) else list(input)
        frame = await self._embed(message, request_id, ids)
        tensors = self._tensors.pop(frame.request_id, {})
        if "embedding" not in tensors:
            raise InvalidRequest(f"the server sent no embedding tensor for {frame.request_id}")
        return Embeddings(tensors["embedding"], frame.model, frame.usage, frame.request_id)

    async def _embed(
        self, message: Embed, request_id: str | None, ids: np.ndarray | None = None
    ) -> EmbeddingsFrame:
        message.request_id = request_id = request_id or "e-" + secrets.token_hex(6)
        future: asyncio.Future[EmbeddingsFrame] = asyncio.get_running_loop().create_future()
        self._embeds[request_id] = future
        try:
            if ids is not None:
                await self._send(encode_tensor(Tensor(request_id, "input_ids", ids)))
            await self._send(encode_client_message(message))
            return await future
        finally:
            self._embeds.pop(request_id, None)
            if not future.done() or future.exception() is not None:
                self._tensors.pop(request_id, None)

    async def cancel(self, request_id: str | None = None) -> None:
        await self._send(encode_client_message(Cancel(request_id=request_id)))

    async def ping(self, timeout_s: float = 10.0) -> float:
        """Round trip of a binary heartbeat, in seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[float] = loop.create_future()
        self._pongs.append((future, loop.time()))
        await self._send(HEARTBEAT_PING)
        return await asyncio.wait_for(future, timeout_s)

    async def ping_json(self, timeout_s: float = 10.0) -> float:
        """Round trip of a JSON ``ping``, in seconds."""
        loop = asyncio.get_running_loop()
        ping_id = secrets.token_hex(4)
        future: asyncio.Future[float] = loop.create_future()
        self._json_pongs[ping_id] = future
        sent = loop.time()
        await self._send(encode_client_message(Ping(id=ping_id)))
        await asyncio.wait_for(future, timeout_s)
        return loop.time() - sent

    async def end(self) -> None:
        """Delete the session on the server (``end_session``) and wait for the close."""
        self._closing = True
        await self._send(encode_client_message(EndSession()))
        await asyncio.gather(self._reader, return_exceptions=True)

    async def close(self) -> None:
        """Close the connection; the session lives on on the server until its TTL."""
        self._closing = True
        await self._ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def send_raw(self, data: str | bytes) -> None:
        """Send a frame as is (for tools and tests of the protocol)."""
        await self._send(data)

    # ------------------------------------------------------------------ internals

    async def _send_generate(self, stream: Stream) -> None:
        self._streams[stream.request_id] = stream
        try:
            if stream._tensor is not None:
                await self._send(stream._tensor)
            await self._send(encode_client_message(stream._message))
        except BaseException:
            self._streams.pop(stream.request_id, None)
            raise
        stream._on_wire = True

    async def _send(self, data: str | bytes) -> None:
        while True:
            await self._connected.wait()  # not while reconnecting
            if self._closed is not None:
                raise self._error or self._closed
            ws = self._ws
            try:
                await self._send_on(ws, data)
                return
            except WsConnectionClosed:
                if self._ws is ws:  # the reader reconnects, or gives up and closes
                    self._connected.clear()

    async def _send_on(self, ws: ClientConnection, data: str | bytes) -> None:
        """Send a frame on ``ws``, sealed (in the order sent) when the connection is encrypted;
        heartbeats go as they are."""
        channel = self.channel
        if channel is None or (isinstance(data, bytes) and data[:1] != bytes((TENSOR,))):
            await ws.send(data)
            return
        async with self._send_lock:
            await ws.send(channel.seal_frame(data))

    async def _read_forever(self) -> None:
        try:
            while True:
                await self._read(self._ws)
                if not await self._reconnect():
                    return
        finally:
            ws = self._ws
            self._closed = ConnectionClosed(ws.close_code or 1006, ws.close_reason or "")
            self._connected.set()  # senders waiting for a reconnect: it will not come
            failure: BaseException = self._error or self._closed
            for stream in self._streams.values():
                stream._queue.put_nowait(failure)
            self._streams.clear()
            waiting: list[asyncio.Future[Any]] = [
                *(future for future, _ in self._pongs),
                *self._json_pongs.values(),
                *self._embeds.values(),
            ]
            for waiter in waiting:
                if not waiter.done():
                    waiter.set_exception(self._closed)

    async def _read(self, ws: ClientConnection) -> None:
        """Handle frames until the connection closes."""
        try:
            async for data in ws:
                if isinstance(data, bytes):
                    if self.channel is None or data[:1] != bytes((SEALED,)):
                        await self._on_binary(data)
                        continue
                    data = self.channel.open(data)
                    if isinstance(data, bytes):  # a tensor frame
                        await self._on_binary(data)
                        continue
                elif self.channel is not None:
                    raise EncryptionFailed(
                        "plaintext", "the server sent a text frame on an encrypted connection"
                    )
                frame = decode_server_text(data)
                if frame is not None:
                    self._on_frame(frame)
        except WsConnectionClosed:
            pass
        except SeedanceError as exc:  # the server broke the protocol, or a frame was forged
            self._error = exc
            if isinstance(exc, EncryptionFailed):
                logger.warning("end-to-end encryption failed (%s): %s", exc.reason, exc.message)
                await ws.close(exc.close_code or 1002, exc.code)
            else:
                await ws.close(1002, "protocol error")

    def _closed_by_us(self) -> bool:
        return self._closing

    async def _reconnect(self) -> bool:
        """After a drop: open the same session again and resume the resumable streams; the
        streams that are not resumable fail. False: no reconnect (closed on purpose, a close
        code that says not to, or every try failed)."""
        policy, reopen = self._reconnect_policy, self._reopen
        code = self._ws.close_code or 1006
        if policy is None or reopen is None or self._closing or self._error is not None:
            return False
        if code not in RECONNECT_CODES:
            return False
        self._connected.clear()
        dropped = ConnectionClosed(code, self._ws.close_reason or "")
        for stream in [s for s in self._streams.values() if s._on_wire and not s.resumable]:
            self._streams.pop(stream.request_id, None)
            stream._queue.put_nowait(dropped)
        epoch = self.info.epoch or None
        for attempt, delay in enumerate(policy.delays(self._rng), 1):
            await asyncio.sleep(delay)
            if self._closed_by_us():  # close() during the wait
                return False
            try:
                opened = await reopen(self.session_id)
            except (OSError, TimeoutError, SeedanceError) as exc:
                logger.info("reconnect %d/%d failed: %r", attempt, policy.attempts, exc)
                continue
            ws, self.info, self.channel = opened.ws, opened.info, opened.channel
            self._ws = ws
            self.reconnects += 1
            for stream in [s for s in self._streams.values() if s._on_wire]:
                resume = encode_client_message(
                    Resume(request_id=stream.request_id, after_seq=stream.last_seq, epoch=epoch)
                )
                try:
                    await self._send_on(ws, resume)
                except WsConnectionClosed:
                    break  # dropped again: the next round of reading notices
            self._connected.set()
            logger.info(
                "reconnected to session %s (%d stream(s) resumed)",
                self.session_id,
                len(self._streams),
            )
            return True
        return False

    async def _on_binary(self, data: bytes) -> None:
        if data[:1] == bytes((TENSOR,)):
            tensor = decode_tensor(data)
            stream = self._streams.get(tensor.request_id or "")
            if stream is not None:
                stream._queue.put_nowait(tensor)
            elif tensor.request_id in self._embeds:
                self._tensors.setdefault(tensor.request_id, {})[tensor.name] = tensor.array
            return
        if data == HEARTBEAT_PING:
            await self._ws.send(HEARTBEAT_PONG)
        elif data == HEARTBEAT_PONG and self._pongs:
            future, sent = self._pongs.popleft()
            if not future.done():
                future.set_result(asyncio.get_running_loop().time() - sent)

    def _on_frame(self, frame: ServerFrame) -> None:
        if isinstance(frame, PongFrame):
            future = self._json_pongs.pop(str(frame.id), None)
            if future is not None and not future.done():
                future.set_result(0.0)
            return
        if isinstance(frame, SessionFrame):
            self.info = frame
            return
        request_id = frame.request_id
        embedding = self._embeds.get(request_id) if request_id else None
        if embedding is not None:
            if isinstance(frame, EmbeddingsFrame):
                embedding.set_result(frame)
            elif isinstance(frame, ErrorFrame):
                body = frame.error
                embedding.set_exception(
                    error_from_wire(body.code, body.message, request_id=request_id)
                )
            return
        stream = self._streams.get(request_id) if request_id else None
        if isinstance(frame, ErrorFrame):
            body = frame.error
            error = error_from_wire(
                body.code,
                body.message,
                request_id=request_id,
                retry_after_s=body.retry_after,
                reason=body.reason,
            )
            if stream is None:
                self._error = error
                if len(self._streams) == 1:  # an error about the frame we just sent
                    stream = next(iter(self._streams.values()))
            if stream is not None:
                self._streams.pop(stream.request_id, None)
                stream._queue.put_nowait(error)
            return
        self._error = None
        if stream is not None:
            if isinstance(frame, DoneFrame):
                self._streams.pop(stream.request_id, None)
            stream._queue.put_nowait(frame)


class connect:
    """Open a session: ``async with connect(url) as session`` or ``await connect(url)``.

    ``url`` is ``ws://host:port`` (``/v2/infer`` is added) or a full ``/v2/infer`` URL.
    ``reconnect``: how the session comes back after a dropped connection (None: it does not).
    ``qos``: the quality of service of every request (the ``X-QoS-Priority`` header).
    ``wss://`` URLs are verified against the system's CAs, or ``ca_file``'s (PEM), or as
    ``ssl`` (an :class:`ssl.SSLContext`, for a client certificate) says.
    ``e2e``: encrypt every frame end to end with a server whose identity is this key (or one of
    these keys): an Ed25519 public key, its PEM (bytes or a file's path), or its base64url
    form; a server that does not prove it is refused (docs/protocol.md, section 9).
    """

    def __init__(
        self,
        url: str,
        *,
        session_id: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        open_timeout_s: float = 10.0,
        max_frame_bytes: int | None = 64 * 1024 * 1024,
        reconnect: Reconnect | None = Reconnect(),
        qos: QoS | str | None = None,
        ca_file: str | None = None,
        ssl: ssl_module.SSLContext | None = None,
        e2e: PinnedKey | Sequence[PinnedKey] | None = None,
    ) -> None:
        self.base_url = url
        self.model = model
        self.url = infer_url(url, session_id=session_id, model=model)
        self.api_key = api_key
        self.open_timeout_s = open_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.reconnect = reconnect
        self.qos = qos.header() if isinstance(qos, QoS) else qos
        self.ssl = tls_context(url, ca_file, ssl)
        keys: Sequence[PinnedKey] = (
            [] if e2e is None else [e2e] if isinstance(e2e, str | bytes | Ed25519PublicKey) else e2e
        )
        self.pinned = [load_pinned(k) for k in keys] if e2e is not None else None
        self._session: ClientSession | None = None

    async def _handshake(self, url: str) -> Opened:
        agreement = None
        if self.pinned is not None:  # a fresh ephemeral key for every connection
            agreement = ClientHandshake(self.pinned)
            url = agreement.url(url)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.qos is not None:
            headers["X-QoS-Priority"] = self.qos
        try:
            ws = await ws_connect(
                url,
                subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
                additional_headers=headers,
                open_timeout=self.open_timeout_s,
                ping_interval=None,  # the protocol's heartbeat keeps the connection alive
                max_size=self.max_frame_bytes,
                compression=None,
                ssl=self.ssl,
            )
        except InvalidHandshake as exc:  # cut, or answered by something else than a server
            raise ConnectionClosed(1006, f"the WebSocket handshake failed: {exc}") from exc
        try:
            first = await asyncio.wait_for(ws.recv(), self.open_timeout_s)
            frame = decode_server_text(first) if isinstance(first, str) else None
            if isinstance(frame, ErrorFrame):
                raise error_from_wire(
                    frame.error.code, frame.error.message, retry_after_s=frame.error.retry_after
                )
            if not isinstance(frame, SessionFrame):
                raise InvalidRequest("the server did not open a session")
            channel = None if agreement is None else agreement.finish(frame.e2e, frame.session_id)
        except WsConnectionClosed:
            raise ConnectionClosed(ws.close_code or 1006, ws.close_reason or "") from None
        except BaseException:
            await ws.close()
            raise
        return Opened(ws, frame, channel)

    async def _reopen(self, session_id: str) -> Opened:
        return await self._handshake(
            infer_url(self.base_url, session_id=session_id, model=self.model)
        )

    async def _open(self) -> ClientSession:
        return ClientSession(await self._handshake(self.url), self._reopen, self.reconnect)

    def __await__(self) -> Generator[Any, None, ClientSession]:
        return self._open().__await__()

    async def __aenter__(self) -> ClientSession:
        self._session = await self._open()
        return self._session

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
