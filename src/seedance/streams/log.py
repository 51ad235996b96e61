"""The stream log of one generation: its ``start`` frame, its tokens by ``seq``, its end.

A generation appends; transports read. A reader attached to a running log is handed every
token as it is appended (a direct call, no queue, no task: the token path stays as short as
before the log), and one that attaches later, or again after a disconnect, first gets what it
lacks from the log. Tokens are addressed by index (``seq``): a reader gets every index after
its cursor once, in order, however the frames were merged the first time.

A reader whose socket falls behind says so (:meth:`StreamLog.set_behind`); the generation then
waits (:meth:`StreamLog.wait_writable`) before it takes the next token from the engine, which
is how a slow client slows the engine down for its own request only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from seedance.protocol.errors import HistoryLost, InvalidRequest
from seedance.protocol.messages import DoneFrame, ErrorFrame, StartFrame, TokenLogprob

#: What a frame other than a token counts as in a log's size (bytes).
FRAME_BYTES = 256

#: Hands ``tokens`` tokens whose text is ``text`` to a reader.
Push = Callable[[str, int], None]


class LogReader(Protocol):
    """A transport reading one generation's log (a WebSocket connection, an SSE response)."""

    def on_start(self, frame: StartFrame) -> None:
        """The generation's ``start`` frame (again, for a reader that attaches later)."""

    @property
    def on_tokens(self) -> Push:
        """Takes tokens, in ``seq`` order from where the reader's cursor was (a method, or an
        attribute holding its writer's own method, which saves a call per token)."""

    def on_end(self, frame: DoneFrame | ErrorFrame | None) -> None:
        """The ``done`` or ``error`` frame (None: aborted with no word to readers); the reader
        is detached."""


class StreamLog:
    """One generation's frames, in memory (the embedded default).

    The token path is an append and one call: the generation
    (:class:`~seedance.server.lifecycle.generation.Generation`) writes it inline (``texts``,
    then :attr:`push`) and :meth:`append` is the same for other writers. An entry holds one
    token unless :meth:`counted` said otherwise (a delta of several tokens, rare), so nothing
    else is touched per token: at a thousand streams, every object a token touches is a cache
    miss.
    """

    __slots__ = (
        "_caught_up",
        "behind",
        "end",
        "ended_at",
        "epoch",
        "extra",
        "logprobs",
        "meta",
        "multi",
        "push",
        "readers",
        "request_id",
        "resumable",
        "size",
        "start",
        "stream",
        "tensors",
        "texts",
        "token_ids",
    )

    def __init__(self, request_id: str, epoch: str, *, resumable: bool, stream: bool) -> None:
        self.request_id = request_id
        self.epoch = epoch
        self.resumable = resumable
        #: Token frames are sent (``stream: true``); otherwise only the ``done`` carries text.
        self.stream = stream
        self.start: StartFrame | None = None
        self.texts: list[str] = []  # one entry per append
        self.multi: dict[int, int] = {}  # entries of other than one token: index -> tokens
        self.extra = 0  # tokens beyond one per entry
        self.end: DoneFrame | ErrorFrame | None = None
        self.ended_at: float | None = None  # the store's clock (time.monotonic)
        self.size = 0  # bytes held (frames; texts counted at the end), for the tenant's cap
        self.readers: list[LogReader] = []
        #: Hands a token delta to the readers: the one reader's own writer (the common case:
        #: no loop), a loop over several, or None (no reader, or ``stream: false``).
        self.push: Push | None = None
        self.behind = 0  # readers whose socket is behind
        self._caught_up: asyncio.Future[None] | None = None
        #: What a transport needs to render the frames again (the OpenAI API's shape).
        self.meta: dict[str, Any] | None = None
        #: Each token's log probability, by ``seq``, when the request asked for them (else
        #: None); logged before the token is pushed, so a reader finds them there.
        self.logprobs: list[TokenLogprob] | None = None
        #: The outputs the request asked for as tensor frames, and its tokens' ids by ``seq``
        #: when ``token_ids`` is one of them (else None), logged as the log probabilities are.
        self.tensors: tuple[str, ...] = ()
        self.token_ids: list[int] | None = None

    def keeps(self, logprobs: bool, tensors: Sequence[str]) -> None:
        """What the request asked for beside the text: its tokens' log probabilities, the
        outputs it wants as tensor frames (and the tokens' ids for one of them)."""
        if logprobs:
            self.logprobs = []
        if tensors:
            self.tensors = tuple(tensors)
            if "token_ids" in self.tensors:
                self.token_ids = []

    @property
    def running(self) -> bool:
        return self.ended_at is None

    @property
    def next_seq(self) -> int:
        """The index of the next token logged (the count so far)."""
        return len(self.texts) + self.extra

    @property
    def entries(self) -> int:
        """Entries a reader may be given (all of them here; a replicated log's are those the
        cluster's store acknowledged)."""
        return len(self.texts)

    # ------------------------------------------------------------------ writing

    def open(self, frame: StartFrame) -> None:
        self.start = frame
        self.size += FRAME_BYTES
        for reader in self.readers:
            reader.on_start(frame)

    def append(self, text: str, tokens: int) -> None:
        """Log ``tokens`` tokens whose text is ``text`` and hand them to every reader."""
        self.texts.append(text)
        if tokens != 1:
            self.counted(tokens)
        push = self.push
        if push is not None:
            push(text, tokens)

    def counted(self, tokens: int) -> None:
        """The entry just appended holds ``tokens`` tokens, not one."""
        self.multi[len(self.texts) - 1] = tokens
        self.extra += tokens - 1

    def saves_with_end(self, save: object) -> bool:
        """Write a session store's ``save`` with this log's end (true), as the cluster's logs
        do (:class:`~seedance.cluster.streams.ReplicatedLog`); a log in memory does not."""
        return False

    def close(self, frame: DoneFrame | ErrorFrame | None, now: float) -> None:
        """The generation ended with ``frame``: every reader gets it and is detached (None:
        an abort that no reader is told of)."""
        self.end = frame
        self.ended_at = now
        if self.resumable:  # kept for the resume window: counted against the tenant's cap
            self.size += FRAME_BYTES + sum(map(len, self.texts))
        readers, self.readers = self.readers, []
        self.push = None
        self.behind = 0
        self._wake()
        for reader in readers:
            reader.on_end(frame)

    def set_behind(self, behind: bool) -> None:
        """A reader's socket fell behind (True) or caught up (False)."""
        self.behind += 1 if behind else -1
        if self.behind <= 0:
            self.behind = 0
            self._wake()

    async def wait_writable(self) -> None:
        """Wait until no reader is behind."""
        while self.behind:
            if self._caught_up is None:
                self._caught_up = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._caught_up)

    def _wake(self) -> None:
        if self._caught_up is not None:
            if not self._caught_up.done():
                self._caught_up.set_result(None)
            self._caught_up = None

    # ------------------------------------------------------------------ reading

    def attach(self, reader: LogReader, after_seq: int = -1) -> None:
        """Hand ``reader`` the start frame, the tokens after ``after_seq``, and the end if the
        generation has ended; otherwise it stays attached and gets the rest live."""
        if self.start is None and self.ended_at is None and after_seq == -1:
            self.readers.append(reader)  # the first reader of a new generation
            self._rewire()
            return
        next_seq = self.next_seq
        if after_seq >= next_seq:
            raise HistoryLost(
                "cursor_ahead",
                f"after_seq {after_seq} is past the last token of {self.request_id} "
                f"({next_seq - 1})",
                request_id=self.request_id,
            )
        missing = self.missing(after_seq)
        if self.start is not None:
            reader.on_start(self.start)
        if missing is not None and self.stream:
            reader.on_tokens(*missing)
        if self.ended_at is not None:
            reader.on_end(self.end)
            return
        self.readers.append(reader)
        self._rewire()

    def detach(self, reader: LogReader) -> None:
        if reader in self.readers:
            self.readers.remove(reader)
            self._rewire()

    def _rewire(self) -> None:
        readers = self.readers
        if not self.stream or not readers:
            self.push = None
        elif len(readers) == 1:
            self.push = readers[0].on_tokens
        else:
            self.push = self._push_all

    def _push_all(self, text: str, tokens: int) -> None:
        for reader in self.readers:
            reader.on_tokens(text, tokens)

    def missing(self, after_seq: int) -> tuple[str, int] | None:
        """The text and count of the tokens after ``after_seq`` (None: none)."""
        next_seq = self.next_seq
        held = after_seq + 1  # tokens the reader holds: they must end an entry
        if held >= next_seq:
            return None
        entries = self.entries
        first = held  # entries of one token each: entry i holds token i
        if held and self.multi:
            multi = self.multi
            ends = itertools.accumulate(multi.get(i, 1) for i in range(entries))
            first, end = next((i, end) for i, end in enumerate(ends, 1) if end >= held)
            if end != held:
                raise InvalidRequest(
                    f"after_seq {after_seq} falls inside a token frame of {self.request_id}; "
                    "give the last seq of a frame held whole",
                    request_id=self.request_id,
                )
        return "".join(self.texts[first:entries]), next_seq - held
