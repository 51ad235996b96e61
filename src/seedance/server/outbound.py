"""Write scheduling: what waits for a client's socket, and when it goes.

Pure asyncio over :class:`~seedance.server.transport.AsgiWebSocket` (its direct
:class:`~seedance.server.transport.FrameWriter` where the server offers one). Everything the
server holds for a client is bounded:

- frames wait in :class:`Outbound`; a request's stream waits for the socket when more than
  ``high_water_bytes`` are queued (backpressure reaches the engine);
- control replies (pongs, errors) do not wait, so a client that sends and never reads could
  grow the queue: past ``max_pending_bytes`` it is cut off;
- a socket that accepts nothing for ``write_timeout_s`` is cut off (checked by the
  connection's timer through :attr:`Outbound.stalled_since`).

Token frames of a stream merge while they wait (:class:`TokenStream`), and hot streams are held
for a short window (:class:`FrameMerger`) so a fast stream sends fewer, larger frames.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from seedance.protocol.codec import TokenFrameEncoder
from seedance.protocol.messages import TokenLogprob
from seedance.protocol.tensors import Tensor, encode_tensor
from seedance.server.transport import AsgiWebSocket, OutFrame

logger = logging.getLogger(__name__)

# What a queued frame costs beyond its payload (the Python object and deque slot).
FRAME_OVERHEAD_BYTES = 64


class TokenStream:
    """The ``token`` frames of one request on one connection. While a frame waits for the
    socket (or for the merge window), later tokens join it: ``seq`` stays the first token's,
    ``n`` grows. Made by :meth:`Outbound.token_stream`; :meth:`push` is the token path."""

    __slots__ = (
        "_encoder",
        "_out",
        "_texts",
        "count",
        "last_sent",
        "logprobs",
        "request_id",
        "seq",
        "size",
        "tensors",
        "token_ids",
        "waiting",
    )

    def __init__(self, out: Outbound, request_id: str) -> None:
        self._out = out
        self.request_id = request_id
        self._encoder = TokenFrameEncoder(request_id)
        self._texts: list[str] = []
        self.size = 0  # bytes the frame being built is counted as in the queue
        self.count = 0  # tokens in the frame being built (0: none)
        self.seq = 0  # seq of the next frame
        self.last_sent = -1.0  # loop time of the last frame written (-1: none yet)
        self.waiting = False  # in the queue or held for the window
        #: The log's log probabilities by seq (None: the request asked for none): a frame
        #: carries those of its tokens.
        self.logprobs: list[TokenLogprob] | None = None
        #: The outputs the request asked for as tensor frames, each sent just before the token
        #: frame whose tokens it covers (:meth:`tensor_frames`), and the log's token ids.
        self.tensors: tuple[str, ...] = ()
        self.token_ids: list[int] | None = None

    def push(self, text: str, tokens: int) -> None:
        """Send the request's next tokens, merged with their neighbours where that costs no
        delay (see :class:`Outbound`). Written against the connection's :class:`Outbound`
        directly: it runs for every token."""
        out = self._out
        if out.closed or out._close is not None:
            return
        merger = out._merger
        if merger is None:  # merging off: one frame per token
            self.add(text, tokens)
            if self.tensors:
                for tensor in self.tensor_frames():
                    out.put(tensor)
            out.put(self.take(out._loop.time())[0])
            return
        if self.waiting:  # a frame of this stream is waiting: join it
            out._account(self.add(text, tokens))
            return
        size = self.add(text, tokens)
        now = out._loop.time()
        if self.last_sent >= 0 and now - self.last_sent < merger.current_s:
            self.waiting = True  # hot stream: hold for the rest of the window
            out._account(size)
            if not out._held:
                merger.hold(out)
            out._held.append(self)
            return
        out._send_stream(self)

    def add(self, text: str, tokens: int) -> int:
        """Add a token to the frame being built; returns the bytes it adds."""
        self._texts.append(text)
        self.count += tokens
        size = len(text) + (FRAME_OVERHEAD_BYTES if len(self._texts) == 1 else 0)
        self.size += size
        return size

    def tensor_frames(self) -> list[bytes]:
        """The tensor frames of the tokens of the frame being built (none unless the request
        asked for some), each with the frame's ``seq``: ``token_ids`` INT32 ``[n]``,
        ``logprobs`` FP32 ``[n]``, ``top_logprobs`` FP32 ``[n, k]``."""
        if not self.tensors:
            return []
        first, last = self.seq, self.seq + self.count
        frames = []
        for name in self.tensors:
            if name == "token_ids":
                assert self.token_ids is not None
                array = np.asarray(self.token_ids[first:last], dtype="<i4")
            else:
                assert self.logprobs is not None
                entries = self.logprobs[first:last]
                if name == "logprobs":
                    array = np.asarray([e.logprob for e in entries], dtype="<f4")
                else:
                    rows = [[t.logprob for t in e.top_logprobs] for e in entries]
                    array = np.asarray(rows, dtype="<f4").reshape(len(entries), -1)
            frames.append(encode_tensor(Tensor(self.request_id, name, array, seq=first)))
        return frames

    def take(self, now: float) -> tuple[str, int]:
        """The frame, and the bytes it was counted as; the stream is then empty."""
        texts = self._texts
        if len(texts) == 1:
            text = texts[0]
        else:
            merger = self._out._merger
            if merger is not None:
                merger.merged += len(texts) - 1  # deltas that joined an earlier frame
            text = "".join(texts)
        if self.logprobs is None:
            frame = self._encoder.encode(text, self.seq, self.count)
        else:
            entries = self.logprobs[self.seq : self.seq + self.count]
            frame = self._encoder.encode(text, self.seq, self.count, entries)
        size = self.size
        self.seq += self.count
        self.count = 0
        self.size = 0
        self._texts = []
        self.last_sent = now
        self.waiting = False
        return frame, size


class Held(Protocol):
    """What a merge window holds: told when the window ends (an :class:`Outbound`, or the
    cluster mode's replicator of stream logs)."""

    def release_held(self) -> None: ...


class FrameMerger:
    """The merge window of a server, and one timer for every stream it holds: each tick
    releases them all, so a token is held at most one window.

    The window stretches while the event loop runs late (the server is CPU-bound): a loop
    that lags by ``L`` holds hot streams for ``window + 4 L`` (at most 20 windows), so a
    saturated server spends its time on tokens rather than on frames. An idle loop does not
    lag, and the window is then the configured one.
    """

    PROBE_INTERVAL_S = 0.05
    LAG_FACTOR = 4.0
    MAX_STRETCH = 20.0

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.current_s = window_s  # the window in force now
        self.lag_s = 0.0  # smoothed lateness of the loop's timers
        self.merged = 0  # token deltas that joined an earlier frame (read by /metrics)
        self._held: list[Held] = []
        self._timer: asyncio.TimerHandle | None = None
        self._probe: asyncio.TimerHandle | None = None
        self._probe_due = 0.0

    def start(self) -> None:
        """Start watching the loop's lag (once, on the loop that serves)."""
        if self._probe is None:
            self._schedule_probe(asyncio.get_running_loop())

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    def _schedule_probe(self, loop: asyncio.AbstractEventLoop) -> None:
        self._probe_due = loop.time() + self.PROBE_INTERVAL_S
        self._probe = loop.call_at(self._probe_due, self._on_probe, loop)

    def _on_probe(self, loop: asyncio.AbstractEventLoop) -> None:
        lag = max(0.0, loop.time() - self._probe_due)
        self.lag_s += (lag - self.lag_s) * 0.3
        self.current_s = min(
            self.window_s + self.LAG_FACTOR * self.lag_s, self.window_s * self.MAX_STRETCH
        )
        self._schedule_probe(loop)

    def hold(self, out: Held) -> None:
        self._held.append(out)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.current_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        held, self._held = self._held, []
        for out in held:
            out.release_held()


_QueueItem = OutFrame | TokenStream


class Outbound:
    """The frames waiting for one client's socket, written in order.

    A frame is written at once when nothing is queued and the transport is not paused (the
    direct path: no task switch, one ``write``). Otherwise it waits in the queue, and a writer
    task sends the whole queue in one ``write`` as soon as the transport drains; on the direct
    path that task exists only while frames wait. Under an ASGI server without the direct path,
    one writer task per connection sends the queue frame by frame. Token frames merge (unless
    ``merger`` is None: one frame per token):

    - the first token of a request, and a token after a pause longer than the merge window,
      go out at once when the socket is idle;
    - tokens arriving while earlier frames wait for the socket join the queued frame;
    - tokens of a stream that wrote a frame less than the window ago are held for the rest of
      the window (at most one window) and go out as one frame.
    """

    def __init__(
        self,
        ws: AsgiWebSocket,
        *,
        max_pending_bytes: int,
        on_overflow: Callable[[], None],
        on_failure: Callable[[BaseException], None] | None = None,
        merger: FrameMerger | None = None,
        high_water_bytes: int = 64 * 1024,
    ) -> None:
        self._ws = ws
        self._direct = ws.writer
        self._loop = asyncio.get_running_loop()
        # Created when first needed: an idle connection holds neither (memory per connection).
        self._queue: deque[_QueueItem] | None = None
        self._held: list[TokenStream] = []
        self._soon: OutFrame | None = None  # see put_soon()
        self._batch: list[OutFrame] | None = None  # see release_held()
        self._congested = False
        self._drained: asyncio.Future[None] | None = None
        #: Told when the queue crosses the high-water mark, both ways (the stream it feeds).
        self.watcher: Callable[[bool], None] | None = None
        self._on_overflow = on_overflow
        self._on_failure = on_failure
        self._merger = merger
        self.max_pending_bytes = max_pending_bytes
        self.high_water_bytes = high_water_bytes
        self.pending_bytes = 0
        self.stalled_since: float | None = None
        self.closed = False
        self._close: tuple[int, str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._more: asyncio.Future[None] | None = None  # the idle ASGI writer waits on it
        #: End-to-end encryption: each frame is sealed as it is written, in the order written.
        self.seal: Callable[[OutFrame], OutFrame] | None = None

    def _wake_writer(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="outbound")
        elif self._more is not None and not self._more.done():
            self._more.set_result(None)

    @property
    def _open(self) -> bool:
        return not self.closed and self._close is None

    def put(self, frame: OutFrame) -> None:
        """Send a frame, in order, without waiting. Past ``max_pending_bytes`` queued the
        client is cut off."""
        if not self._open:
            return
        if self._held:  # the window's frames first: a reply's last tokens and its end, say
            self.release_held(then=frame)
            return
        if not self._queue and self._direct is not None and self._direct.writable.is_set():
            self._write_now(frame)
            return
        self._enqueue(frame, len(frame) + FRAME_OVERHEAD_BYTES)

    def put_soon(self, frame: OutFrame) -> None:
        """Send a frame with the next one written, or two loop turns from now at the latest: a
        request's ``start`` and a first token that follows at once share one ``write``."""
        if not self._open:
            return
        if self._soon is not None:
            self._flush_soon()
        self._soon = frame
        self._loop.call_soon(self._soon_tick, True)

    def _soon_tick(self, again: bool) -> None:
        if self._soon is None:
            return
        if again:  # one more turn: an engine that yields at once is then in time
            self._loop.call_soon(self._soon_tick, False)
            return
        self._flush_soon()

    def _flush_soon(self) -> None:
        frame, self._soon = self._soon, None
        if frame is not None:
            self.put(frame)

    def _write_now(self, frame: OutFrame) -> None:
        assert self._direct is not None
        soon, seal = self._soon, self.seal
        if soon is None:
            frames: tuple[OutFrame, ...] = (frame if seal is None else seal(frame),)
        else:
            self._soon = None
            frames = (soon, frame) if seal is None else (seal(soon), seal(frame))
        batch = self._batch
        if batch is None:
            self._direct.write_frames(frames)  # false: closing, and the frames are moot
        else:  # release_held: one write for all
            batch.extend(frames)

    def token_stream(self, request_id: str) -> TokenStream:
        """The token frames of request ``request_id`` on this connection (its :meth:`TokenStream.
        push` sends them)."""
        return TokenStream(self, request_id)

    def _send_stream(self, stream: TokenStream) -> None:
        """Write the stream's frame now, or queue it (its bytes are not counted yet)."""
        if not self._queue and self._direct is not None and self._direct.writable.is_set():
            if stream.tensors:
                for tensor in stream.tensor_frames():
                    self._write_now(tensor)
            self._write_now(stream.take(self._loop.time())[0])
            return
        stream.waiting = True
        self._enqueue(stream, stream.size)

    def release_held(self, then: OutFrame | None = None) -> None:
        """Send the frames the merge window holds (in the order they were held), then
        ``then``: in one write, where the socket takes them now (measured at 1,000 streams of
        128 tokens: a reply's end no longer costs a write of its own, 1.087 writes a frame to
        1.033)."""
        held, self._held = self._held, []
        if not self._open:
            return
        batch: list[OutFrame] = []
        self._batch = batch
        try:
            for stream in held:
                if stream.count:
                    self.pending_bytes -= stream.size  # counted again if it is queued
                    self._send_stream(stream)
            if then is not None:
                self.put(then)  # nothing is held now
        finally:
            self._batch = None
        if batch:
            assert self._direct is not None
            self._direct.write_frames(batch)

    def _account(self, size: int) -> None:
        self.pending_bytes += size
        if self.pending_bytes > self.high_water_bytes:
            if not self._congested:
                self._congested = True
                if self.watcher is not None:
                    self.watcher(True)
            if self.pending_bytes > self.max_pending_bytes:
                self.closed = True
                self._on_overflow()

    def _enqueue(self, item: _QueueItem, size: int) -> None:
        if self._queue is None:
            self._queue = deque()
        if self._soon is not None:
            soon, self._soon = self._soon, None
            self._queue.append(soon)
            self._account(len(soon) + FRAME_OVERHEAD_BYTES)
        self._queue.append(item)
        self._account(size)
        self._wake_writer()

    async def wait_writable(self) -> None:
        """Wait until the queue is below the high-water mark (backpressure for streams)."""
        if self._congested:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await asyncio.shield(self._drained)

    def _set_writable(self) -> None:
        if self._congested and self.watcher is not None:
            self.watcher(False)
        self._congested = False
        if self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None

    @property
    def congested(self) -> bool:
        return self._congested

    def close(self, code: int, reason: str = "") -> None:
        """Send what is queued, then the close frame."""
        if self._open:
            if self._held:
                self.release_held()
            self._flush_soon()
            self._close = (code, reason)
            self._wake_writer()

    async def stop(self) -> None:
        """Stop writing (the connection is gone)."""
        self.closed = True
        self._held.clear()
        self._soon = None
        self._set_writable()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _take_all(self) -> tuple[list[OutFrame], int]:
        now = self._loop.time()
        frames: list[OutFrame] = []
        size = 0
        queue = self._queue
        while queue:  # None or empty: nothing
            item = queue.popleft()
            if isinstance(item, TokenStream):
                if item.tensors:
                    frames += item.tensor_frames()
                text, counted = item.take(now)
                frames.append(text)
                size += counted
            else:
                frames.append(item)
                size += len(item) + FRAME_OVERHEAD_BYTES
        if self.seal is not None:
            frames = [self.seal(frame) for frame in frames]
        return frames, size

    def _written(self, size: int) -> None:
        self.pending_bytes -= size
        if self.pending_bytes <= self.high_water_bytes // 2:
            self._set_writable()

    async def _run(self) -> None:
        """Write what is queued (and the close, when asked), then end."""
        loop = self._loop
        ws, direct = self._ws, self._direct
        try:
            while not self.closed:
                if not self._queue:
                    if self._close is not None:
                        code, reason = self._close
                        self.closed = True
                        await close_websocket(ws, code, reason)
                        return
                    if direct is not None:
                        return  # the direct path needs no idle writer
                    self._more = loop.create_future()
                    await self._more
                    self._more = None
                    continue
                self.stalled_since = loop.time()
                if direct is not None:
                    # Wait for the socket to drain; tokens arriving meanwhile merge.
                    if not direct.writable.is_set():
                        await direct.writable.wait()
                    frames, size = self._take_all()
                    if not direct.write_frames(frames):
                        self.closed = True  # the connection is closing
                        return
                else:
                    frames, size = self._take_all()
                    for frame in frames:
                        await ws.send(frame)
                self.stalled_since = None
                self._written(size)
        except OSError as exc:  # the client went away mid-write
            logger.debug("outbound writer stopped: %r", exc)
            self.closed = True
        except Exception as exc:  # a fault of ours: the connection cannot go on
            self.closed = True
            if self._on_failure is None:
                logger.error("outbound writer failed", exc_info=exc)
            else:
                self._on_failure(exc)
        finally:
            self._task = None
            if self.closed:
                self._set_writable()


async def close_websocket(ws: AsgiWebSocket, code: int, reason: str) -> None:
    """Send the close frame, unless the connection is gone or closed already."""
    try:
        await ws.close(code, reason)
    except OSError:
        pass  # gone already
    except RuntimeError as exc:  # the server closed it already (after a protocol error)
        logger.debug("close %d not sent: %s", code, exc)
