"""The stream log of one generation: its ``start`` frame, its tokens by ``seq``, its end.

A generation appends; transports read. A reader attached to a running log is handed every
token as it is appended (a direct call, no queue, no task: the token path stays as short as
before the log), and one that attaches later, or again after a disconnect, first gets what it
lacks from the log. Tokens are addressed by index (``seq``): a reader gets every index after
its cursor once, in order, however the frames were merged the first time.
"""

from __future__ import annotations

from typing import Protocol

from seedance.protocol.errors import HistoryLost, InvalidRequest


class LogReader(Protocol):
    """A transport reading one generation's log (a WebSocket connection, an SSE response)."""

    def on_start(self, frame: str) -> None:
        """The generation's ``start`` frame (again, for a reader that attaches later)."""

    def on_tokens(self, text: str, tokens: int) -> None:
        """Tokens, in ``seq`` order from where the reader's cursor was."""

    def on_end(self, frame: str) -> None:
        """The ``done`` or ``error`` frame; the reader is detached."""

    @property
    def congested(self) -> bool:
        """The reader's socket is behind: the generation waits (backpressure)."""

    async def wait_writable(self) -> None: ...


class StreamLog:
    """One generation's frames, in memory (the embedded default)."""

    __slots__ = (
        "ended_at",
        "ends",
        "epoch",
        "next_seq",
        "readers",
        "request_id",
        "resumable",
        "size",
        "start",
        "stream",
        "terminal",
        "texts",
    )

    def __init__(self, request_id: str, epoch: str, *, resumable: bool, stream: bool) -> None:
        self.request_id = request_id
        self.epoch = epoch
        self.resumable = resumable
        #: Token frames are sent (``stream: true``); otherwise only the ``done`` carries text.
        self.stream = stream
        self.start: str | None = None
        self.texts: list[str] = []  # one entry per append
        self.ends: list[int] = []  # the seq after each entry
        self.next_seq = 0  # the index of the next token logged
        self.terminal: str | None = None
        self.ended_at: float | None = None  # loop time
        self.size = 0  # bytes held (texts and frames), for the tenant's cap
        self.readers: list[LogReader] = []

    @property
    def running(self) -> bool:
        return self.terminal is None

    # ------------------------------------------------------------------ writing

    def open(self, frame: str) -> None:
        self.start = frame
        self.size += len(frame)
        for reader in self.readers:
            reader.on_start(frame)

    def append(self, text: str, tokens: int) -> None:
        """Log ``tokens`` tokens whose text is ``text`` and hand them to every reader."""
        self.texts.append(text)
        self.next_seq += tokens
        self.ends.append(self.next_seq)
        self.size += len(text)
        if self.stream:
            for reader in self.readers:
                reader.on_tokens(text, tokens)

    def close(self, frame: str, now: float) -> None:
        """The generation ended with ``frame``: every reader gets it and is detached (``""``:
        an abort that no reader is told of)."""
        self.terminal = frame
        self.ended_at = now
        self.size += len(frame)
        readers, self.readers = self.readers, []
        for reader in readers:
            reader.on_end(frame)

    @property
    def congested(self) -> bool:
        return any(reader.congested for reader in self.readers)

    async def wait_writable(self) -> None:
        for reader in self.readers:
            if reader.congested:
                await reader.wait_writable()

    # ------------------------------------------------------------------ reading

    def attach(self, reader: LogReader, after_seq: int = -1) -> None:
        """Hand ``reader`` the start frame, the tokens after ``after_seq``, and the end if the
        generation has ended; otherwise it stays attached and gets the rest live."""
        if after_seq >= self.next_seq:
            raise HistoryLost(
                "cursor_ahead",
                f"after_seq {after_seq} is past the last token of {self.request_id} "
                f"({self.next_seq - 1})",
                request_id=self.request_id,
            )
        missing = self.missing(after_seq)
        if self.start is not None:
            reader.on_start(self.start)
        if missing is not None and self.stream:
            reader.on_tokens(*missing)
        if self.terminal is not None:
            reader.on_end(self.terminal)
        else:
            self.readers.append(reader)

    def detach(self, reader: LogReader) -> None:
        if reader in self.readers:
            self.readers.remove(reader)

    def missing(self, after_seq: int) -> tuple[str, int] | None:
        """The text and count of the tokens after ``after_seq`` (None: none)."""
        if after_seq + 1 >= self.next_seq:
            return None
        ends = self.ends
        first = 0
        if after_seq >= 0:
            lo, hi = 0, len(ends)
            while lo < hi:  # the first entry that ends past after_seq
                mid = (lo + hi) // 2
                if ends[mid] <= after_seq + 1:
                    lo = mid + 1
                else:
                    hi = mid
            first = lo
            if first == 0 or ends[first - 1] != after_seq + 1:
                raise InvalidRequest(
                    f"after_seq {after_seq} falls inside a token frame of {self.request_id}; "
                    "give the last seq of a frame held whole",
                    request_id=self.request_id,
                )
        return "".join(self.texts[first:]), self.next_seq - (after_seq + 1)
