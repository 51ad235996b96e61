"""The one reader of a stream log, for every API.

A :class:`Reading` is a reader's hold on one generation's log from a cursor: entering it
attaches the reader at the cursor (a cursor past the log's end, or inside a frame, is refused
there), and tells the generation it has a reader; leaving it detaches the reader and tells the
generation, which then decides what having no reader means (stop at once, run on for the
resume grace, or run to its end: :meth:`~seedance.server.lifecycle.generation.Generation.
reader_left`).

The transports that render entries in a task of their own (SSE, the Responses API, Realtime)
iterate it: ``async for text, last_seq in reading`` gives the text of the tokens after the
cursor, as much as has come at each wake (a slow client gets fewer, larger pieces), to the
log's end, which is then :attr:`Reading.end`. Past :data:`HIGH_WATER_BYTES` of text not yet
taken, the generation waits for the reader (backpressure). ``/v2/infer`` takes the same
reading with a sink of its own that the log pushes tokens into, on the token path (no task
switch per token: make bench-compare measures it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final

from seedance.protocol.errors import EngineError, SeedanceError, error_from_wire
from seedance.protocol.messages import DoneFrame, ErrorFrame, StartFrame
from seedance.streams.log import LogReader, StreamLog

if TYPE_CHECKING:
    from types import TracebackType

    from seedance.server.lifecycle.generation import Generation

#: Reply text waiting for a reader past which the generation waits (backpressure).
HIGH_WATER_BYTES: Final = 64 * 1024


class Pull:
    """A log reader whose text waits here for its task, which takes all of it at once."""

    __slots__ = ("_texts", "_wake", "behind", "end", "ended", "last_seq", "log", "size")

    def __init__(self, log: StreamLog, after_seq: int = -1) -> None:
        self.log = log
        self._texts: list[str] = []
        self.size = 0
        self.last_seq = after_seq  # the seq of the last token taken or waiting
        self.behind = False
        self.ended = False
        self.end: DoneFrame | ErrorFrame | None = None
        self._wake = asyncio.Event()

    def on_start(self, frame: StartFrame) -> None:
        self._wake.set()

    def on_tokens(self, text: str, tokens: int) -> None:
        self._texts.append(text)
        self.size += len(text)
        self.last_seq += tokens
        self._wake.set()
        if self.size > HIGH_WATER_BYTES and not self.behind:
            self.behind = True
            self.log.set_behind(True)

    def on_end(self, frame: DoneFrame | ErrorFrame | None) -> None:
        self.ended = True
        self.end = frame
        self._wake.set()

    async def wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def take(self) -> tuple[str, int]:
        """The text waiting, and the seq of its last token."""
        text = "".join(self._texts)
        self._texts.clear()
        self.size = 0
        self.caught_up()
        return text, self.last_seq

    def caught_up(self) -> None:
        if self.behind:
            self.behind = False
            self.log.set_behind(False)


class Reading:
    """A reader's hold on ``log`` after ``after_seq`` (see the module). ``generation``: the
    one writing it here (None: it has ended, or runs on another node); ``sink``: a reader of
    the caller's own, pushed every token (default: a :class:`Pull`, for ``async for``)."""

    __slots__ = ("_pull", "after_seq", "generation", "log", "open", "sink")

    def __init__(
        self,
        log: StreamLog,
        generation: Generation | None,
        after_seq: int = -1,
        sink: LogReader | None = None,
    ) -> None:
        self.log = log
        self.generation = generation if generation is not None and generation.log is log else None
        self.after_seq = after_seq
        self._pull = Pull(log, after_seq) if sink is None else None
        self.sink: LogReader = sink if sink is not None else self._pull  # type: ignore[assignment]
        self.open = False

    def __enter__(self) -> Reading:
        self.log.attach(self.sink, self.after_seq)  # refuses a cursor it cannot serve
        self.open = True
        if self.generation is not None:
            self.generation.reader_joined()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading (idempotent); the generation decides what that means."""
        if not self.open:
            return
        self.open = False
        self.log.detach(self.sink)
        if self._pull is not None:
            self._pull.caught_up()
        if self.generation is not None:
            self.generation.reader_left()

    @property
    def running(self) -> Generation | None:
        """The generation still writing the log here (None: it has ended)."""
        generation = self.generation
        if generation is None or generation.task is None or generation.task.done():
            return None
        return generation

    @property
    def end(self) -> DoneFrame | ErrorFrame | None:
        """The log's last frame, once the iteration is over (None: none came)."""
        return self._pull.end if self._pull is not None else self.log.end

    async def __aiter__(self) -> AsyncIterator[tuple[str, int]]:
        pull = self._pull
        assert pull is not None, "a reading with a sink of its own is pushed, not iterated"
        while True:
            await pull.wait()
            text, last_seq = pull.take()
            if text:
                yield text, last_seq
            if pull.ended:
                return


def end_error(end: ErrorFrame) -> SeedanceError:
    """The error a log ended with, as the exception that raises it again."""
    body = end.error
    return error_from_wire(
        body.code,
        body.message,
        request_id=end.request_id,
        retry_after_s=body.retry_after,
        reason=body.reason,
    )


async def read_to_end(log: StreamLog, generation: Generation | None) -> DoneFrame:
    """Read ``log`` whole (its text stays in the log) and return its ``done``; a log that ends
    with an error raises it, one that ends with nothing (the log was dropped) raises an
    :class:`EngineError`."""
    with Reading(log, generation) as reading:
        async for _ in reading:
            pass
    end = reading.end
    if isinstance(end, ErrorFrame):
        raise end_error(end)
    if end is None:
        raise EngineError(f"the reply to {log.request_id} ended without a result")
    return end
