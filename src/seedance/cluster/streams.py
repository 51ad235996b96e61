"""Stream logs in Redis: a reader on any node resumes any generation, and a dead node's
generations are taken over.

One Redis Stream per generation (``sd:{s:TENANT:SESSION}:log:REQUEST``) whose entry ids carry
the ``seq``: the ``start`` frame is ``0-1``, a token entry of the tokens from ``seq`` is
``SEQ-2`` (fields ``t``, the text, and ``n``, the count: every token a generation logged
between two exchanges, which its readers also get as one delta; ``l`` and ``i``, the tokens'
log probabilities and ids, when the request asked for them), the end (``done``/``error``)
is ``NEXT_SEQ-3``. Beside it a hash (``...:gen:REQUEST``) holds what a takeover needs (the request,
its prompt, its tenant and session), ``...:current`` names the session's latest generation and
``...:epoch`` the session's epoch: made afresh whenever Redis lost it, so a cursor from before
is refused with ``history_lost`` ``epoch_changed``, never answered with a gap. Everything has a
TTL (the resume window, a minute more).

**Writing** (:class:`ReplicatedLog`, on the node that runs the generation): tokens are logged
in memory as on a single node, and a node-wide :class:`Replicator` sends what the logs added,
at the pace of the frame merging, with the node's next batch
(:class:`~seedance.cluster.link.Batch`); each log's entries go through one fenced script (it
writes only while the generation's session lock still holds the writer's fencing token, so a
node that lost its lease cannot write a frame). Readers get a frame only once Redis
acknowledged it: what a client saw is always in Redis, whatever node dies next. The end entry
saves the session's new turns (:class:`~seedance.cluster.sessions.SessionSave`) and releases
the session lock in the same script, so the next request of the session may start on any node
the moment its client sees ``done``, and finds the turns saved.

**Reading elsewhere**: a resume on a node that does not run the generation builds a mirror of
the log from Redis (``XRANGE``) and follows it live (``XREAD BLOCK``); its readers attach to it
exactly as to a local log. When no entry came for half a lease and the owner's lock is gone,
the node takes the generation over (through the server's ``take_over``, set by its state:
:mod:`seedance.server.lifecycle.takeover`): the mirror becomes the log of a local generation
that continues at the next ``seq``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import msgspec
from redis.exceptions import RedisError

from seedance.cluster.atrest import AtRest, Unreadable
from seedance.cluster.link import ClusterLink, script, session_key
from seedance.cluster.sessions import SAVE_TURNS, SessionSave
from seedance.protocol.codec import decode_server_text, encode_frame
from seedance.protocol.errors import HistoryLost
from seedance.protocol.messages import DoneFrame, ErrorFrame, StartFrame, TokenLogprob
from seedance.streams.log import StreamLog
from seedance.streams.store import MemoryStreamStore

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

    from seedance.cluster.claims import Claims


class Pace(Protocol):
    """The server's frame merging, as the replicator keeps its pace
    (:class:`~seedance.server.outbound.FrameMerger`)."""

    #: The merge window in force now, seconds.
    current_s: float

    def hold(self, out: Any) -> None:
        """Call ``out.release_held()`` when the window in force now ends."""


logger = logging.getLogger(__name__)

Value = TypeVar("Value", str, bytes)  # what Redis keeps: text, or bytes

START_ID: Final = "0-1"
#: The arguments of one entry in the append scripts.
ENTRY_ARGS: Final = 5
#: An entry's kind, the second part of its id.
START, TOKEN, END = 1, 2, 3
#: Kept past the resume window.
TTL_MARGIN_S: Final = 60.0
#: After a failed exchange, a log's entries are sent again this much later.
RETRY_S: Final = 0.1
#: Entries read from Redis at a time by a follower.
READ_COUNT: Final = 1024

# KEYS: lock, stream, gen, current, epoch. ARGV: holder, TTL (ms), epoch, request id, header
# ('' once written), release ('1' with the end: the session lock goes with it), then entries
# of ENTRY_ARGS (entry id, text or frame, token count, the tokens' log probabilities, their
# ids; '' for what a frame or the request lacks). An entry at or before the stream's last id
# was written by an exchange whose reply was lost: skipped. 0: fenced out.
_APPEND_HEAD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local ttl = ARGV[2]
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], 'header', ARGV[5])
  redis.call('SET', KEYS[4], ARGV[4], 'PX', ttl)
  redis.call('SET', KEYS[5], ARGV[3], 'NX', 'PX', ttl)
end
local added
for i = first, #ARGV, 5 do
  if ARGV[i + 2] == '' then
    added = redis.pcall('XADD', KEYS[2], ARGV[i], 'f', ARGV[i + 1])
  elseif ARGV[i + 3] == '' and ARGV[i + 4] == '' then
    added = redis.pcall('XADD', KEYS[2], ARGV[i], 't', ARGV[i + 1], 'n', ARGV[i + 2])
  else
    added = redis.pcall('XADD', KEYS[2], ARGV[i], 't', ARGV[i + 1], 'n', ARGV[i + 2],
      'l', ARGV[i + 3], 'i', ARGV[i + 4])
  end
  if type(added) == 'table' and added.err and not string.find(added.err, 'smaller') then
    return added
  end
end
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[4], ttl)
redis.call('PEXPIRE', KEYS[5], ttl, 'GT')
"""
_APPEND = (
    "local first = 7\n"
    + _APPEND_HEAD
    + "if ARGV[6] == '1' then redis.call('DEL', KEYS[1]) end\nreturn 1\n"
)

# The end of a generation that continued a session, and the session's save (atomic: the next
# generation, on any node, finds the lock gone only with the turns saved). KEYS: _APPEND's,
# the session's hash and turns. ARGV: _APPEND's six, then the save's (SessionSave.args: TTL,
# cleared, turns kept, how many added, the turns added), then the entries (the end last).
# Saved only when the end entry is new (an exchange sent again after a lost reply saves
# once). {1, the session's version}.
_APPEND_SAVING = (
    "local hash, turns = KEYS[6], KEYS[7]\n"
    + "local from, upto = 11, 10 + tonumber(ARGV[10])\n"
    + "local first = upto + 1\n"
    + _APPEND_HEAD
    + "if type(added) ~= 'table' or not added.err then\n"
    + "  local ttl, cleared, kept = ARGV[7], ARGV[8], ARGV[9]\n"
    + SAVE_TURNS
    + "  redis.call('HINCRBY', hash, 'version', 1)\n"
    + "end\n"
    + "redis.call('DEL', KEYS[1])\n"
    + "return {1, tonumber(redis.call('HGET', hash, 'version'))}\n"
)

# The common exchange of a running generation: one token entry, nothing else.
# KEYS: lock, stream. ARGV: holder, then the entry as _APPEND has it (without the log
# probabilities and ids when it has neither).
_APPEND_TOKENS = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local added
if #ARGV == 4 then
  added = redis.pcall('XADD', KEYS[2], ARGV[2], 't', ARGV[3], 'n', ARGV[4])
else
  added = redis.pcall('XADD', KEYS[2], ARGV[2], 't', ARGV[3], 'n', ARGV[4], 'l', ARGV[5],
    'i', ARGV[6])
end
if type(added) == 'table' and added.err and not string.find(added.err, 'smaller') then
  return added
end
return 1
"""


_encode = msgspec.json.Encoder().encode
_logprobs = msgspec.json.Decoder(list[TokenLogprob])
_ids = msgspec.json.Decoder(list[int])


def log_keys(tenant: str, session_id: str, request_id: str) -> list[str]:
    """The keys the append script names: lock, stream, gen, current, epoch."""
    return [
        session_key(tenant, session_id, "lock"),
        session_key(tenant, session_id, f"log:{request_id}"),
        session_key(tenant, session_id, f"gen:{request_id}"),
        session_key(tenant, session_id, "current"),
        session_key(tenant, session_id, "epoch"),
    ]


class _Plan:
    """One exchange of one log: what it sends, and where the log stands once it is acked."""

    __slots__ = ("args", "end", "entries", "groups", "header", "light", "seq", "start", "tokens")

    def __init__(self) -> None:
        self.args: list[Any] = []
        #: The token entries it sends: (first, after) of the log's texts, and their tokens.
        self.groups: list[tuple[int, int, int]] = []
        #: Their arguments (ENTRY_ARGS each), sent again as they are if the exchange fails.
        self.tokens: list[Any] = []
        self.entries = 0
        self.seq = 0
        self.start: StartFrame | None = None
        self.end = False
        self.header = False
        self.light = False  # one token entry and nothing else: _APPEND_TOKENS


class ReplicatedLog(StreamLog):
    """A stream log kept in Redis too: written by a local generation (``own``), or a mirror
    of another node's, followed from Redis (until this node takes it over)."""

    __slots__ = (
        "_deliver",
        "_ended",
        "_held",
        "_pending_start",
        "_queued",
        "_regaining",
        "_resend",
        "acked",
        "acked_seq",
        "end_pending",
        "finished",
        "header",
        "holder",
        "keys",
        "lost",
        "on_lost",
        "replicator",
        "saving",
        "sent",
        "sent_seq",
        "tokens_at",
        "ttl_at",
    )

    def __init__(
        self,
        request_id: str,
        epoch: str,
        *,
        resumable: bool,
        stream: bool,
        keys: list[str],
        replicator: Replicator,
    ) -> None:
        super().__init__(request_id, epoch, resumable=resumable, stream=stream)
        self.keys = keys
        self.replicator = replicator
        self.holder: str | None = None  # the lock value of the generation writing here
        self.header = b""  # written with the first exchange
        self.sent = self.sent_seq = 0  # entries handed to Redis, and the seq after them
        self.acked = self.acked_seq = 0  # entries Redis acknowledged
        self._pending_start: StartFrame | None = None
        self.end_pending: tuple[DoneFrame | ErrorFrame | None] | None = None
        #: The session's save that goes with the end (:meth:`saves_with_end`).
        self.saving: SessionSave | None = None
        self._ended: asyncio.Future[bool] | None = None
        self._queued = False  # in the replicator's next exchange
        self._held = False  # held for the rest of the merge window
        self._regaining = False  # its lock was gone: being taken again (Replicator.regain)
        self.finished = False  # its end is in Redis: nothing more to send
        self._resend: _Plan | None = None  # an exchange that failed: its entries go again
        self.tokens_at = -1.0  # loop time of the last exchange with tokens (-1: none yet)
        self.ttl_at = -1.0  # loop time the keys' TTLs were last set (-1: never)
        self._deliver: Callable[[str, int], None] | None = None
        self.lost = False
        #: Called when Redis refused this node's writes (another node holds the lock now).
        self.on_lost: Callable[[], None] | None = None

    # What readers may see: what Redis acknowledged.
    @property
    def next_seq(self) -> int:
        return self.acked_seq

    @property
    def entries(self) -> int:
        return self.acked

    @property
    def owned(self) -> bool:
        return self.holder is not None

    def own(self, holder: str, header: bytes) -> None:
        """A local generation writes this log from now on, under the lock value ``holder``."""
        self.holder = holder
        if not self.sent:
            self.header = self.replicator.seal(header, self.keys[2])

    def _rewire(self) -> None:
        super()._rewire()
        self._deliver = self.push
        self.push = self._stage  # the generation's tokens go to Redis first

    def _stage(self, text: str, tokens: int) -> None:
        if not (self._queued or self._held):
            self.replicator.mark(self)

    def open(self, frame: StartFrame) -> None:
        if not self.owned:  # a mirror: the frame came from Redis
            super().open(frame)
            return
        self._pending_start = frame
        self.replicator.mark(self, now=True)

    def saves_with_end(self, save: object) -> bool:
        """The session's save goes in the end's script: one step with the end and the release
        of the session's lock, so the next generation, on any node, finds the turns saved."""
        if self.lost or not self.owned or self.end_pending is not None:
            return False
        assert isinstance(save, SessionSave)
        self.saving = save
        return True

    async def write_end(self, frame: DoneFrame | ErrorFrame | None) -> bool:
        """Write the end (releasing the session lock) after every token; false when this
        node may not write any more (fenced out, or Redis did not take it)."""
        if self.lost or not self.owned or self.replicator.link.batch.closed is not None:
            return False
        self.end_pending = (frame,)
        self._ended = asyncio.get_running_loop().create_future()
        self.replicator.mark(self, now=True)
        return await self._ended

    # ------------------------------------------------------------------ exchanges

    def plan(self, now: float) -> _Plan | None:
        """The next exchange at loop time ``now``: entries not yet sent (None: nothing to
        send)."""
        self._queued = self._held = False
        if self.lost or self.holder is None or self._regaining or self.finished:
            return None
        plan = _Plan()
        args = plan.args
        seal = self.replicator.seal
        if self._pending_start is not None and self.start is None:
            plan.start = self._pending_start
            args += [START_ID, seal(encode_frame(self._pending_start), self.keys[1]), "", "", ""]
        # Token entries an exchange that failed sent go again as they were (Redis may have
        # taken them: the same ids are skipped, and a group cut otherwise would lose the
        # tokens its id already covers).
        resend, self._resend = self._resend, None
        if resend is not None:
            plan.tokens += resend.tokens
            plan.groups += resend.groups
        # Each group of what was logged since the last exchange is one entry: readers are
        # handed it as one delta, so no cursor can fall inside it.
        texts = self.texts
        entries, seq = len(texts), len(texts) + self.extra
        if entries > self.sent:
            at = self.sent_seq
            for first, after in self._groups(entries):
                count = after - first + sum(self.multi.get(i, 1) - 1 for i in range(first, after))
                text = seal("".join(texts[first:after]), self.keys[1])
                plan.tokens += [f"{at}-{TOKEN}", text, count, *self._typed(at, count)]
                plan.groups.append((first, after, count))
                at += count
            self.tokens_at = now
        args += plan.tokens
        plan.entries, plan.seq = entries, seq
        if self.end_pending is not None:
            (frame,) = self.end_pending
            end = "" if frame is None else seal(encode_frame(frame), self.keys[1])
            args += [f"{seq}-{END}", end, "", "", ""]
            plan.end = True
        if not args and not self.header:
            return None
        plan.header = bool(self.header)
        # The keys' TTLs are set by the first exchange and the end, and renewed every quarter
        # of their span: the common exchange is one token entry and nothing else.
        ttl_due = now - self.ttl_at > self.replicator.ttl_ms / 4000 or self.ttl_at < 0
        plan.light = len(args) == ENTRY_ARGS and not (
            plan.start or plan.end or plan.header or ttl_due
        )
        if not plan.light:
            self.ttl_at = now
        self.sent, self.sent_seq = plan.entries, plan.seq
        return plan

    def _typed(self, seq: int, count: int) -> tuple[bytes | str, bytes | str]:
        """The log probabilities and ids of ``count`` tokens from ``seq``, as an entry keeps
        them ('' when the request did not ask for them)."""
        seal, key = self.replicator.seal, self.keys[1]
        logprobs, ids = self.logprobs, self.token_ids
        return (
            "" if logprobs is None else seal(_encode(logprobs[seq : seq + count]), key),
            "" if ids is None else seal(_encode(ids[seq : seq + count]), key),
        )

    def _groups(self, entries: int) -> list[tuple[int, int]]:
        """The logged entries ``sent`` up to ``entries``, grouped as readers get them: each
        alone without frame merging (``--merge-window-ms 0``); with it, the reply's first token
        alone (it travels at once, as it does from one process), the rest together."""
        sent = self.sent
        if self.replicator.merger is None:
            return [(i, i + 1) for i in range(sent, entries)]
        if sent == 0 and entries > 1:
            return [(0, 1), (1, entries)]
        return [(sent, entries)]

    def script_args(self, plan: _Plan) -> list[Any]:
        if plan.light:
            args = plan.args
            return [self.holder, *(args if args[3] or args[4] else args[:3])]
        ttl_ms = self.replicator.ttl_ms
        release = "1" if plan.end else "0"
        head = [self.holder, ttl_ms, self.epoch, self.request_id, self.header, release]
        if plan.end and self.saving is not None:
            return [*head, *self.saving.args, *plan.args]
        return [*head, *plan.args]

    def acked_by(self, plan: _Plan, reply: Any) -> None:
        """Redis answered ``plan``'s exchange: hand its frames to the readers."""
        if isinstance(reply, Exception) or not reply:
            self._resend = plan  # its entries go again, as they were
            self.ttl_at = -1.0  # and the keys' TTLs with them
            if self.lost:
                return
            if reply == 0:  # fenced out: the lock is another claim's, or Redis lost it
                self.replicator.regain(self, plan)
            else:
                self.replicator.retry(self)
            return
        if plan.header:
            self.header = b""
        if plan.start is not None:
            self._pending_start = None
            super().open(plan.start)
        self.acked, self.acked_seq = plan.entries, plan.seq
        if self.stream and self._deliver is not None:
            for first, after, count in plan.groups:
                self._deliver("".join(self.texts[first:after]), count)
        if plan.end and self.saving is not None:
            self.saving.saved(int(reply[1]))
            self.saving = None
        if plan.end:
            self.finished = True
            if self._ended is not None and not self._ended.done():
                self._ended.set_result(True)

    def lose(self, why: str = "") -> None:
        """This node may not write the log any more: the generation stops here (its readers
        resume on the node that has it now)."""
        if self.lost:
            return
        self.lost = True
        logger.error(
            "request %s: %s; the generation stops here",
            self.request_id,
            why
            or "Redis refused this node's frames (its lock is another node's now, or Redis "
            "lost it)",
        )
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(False)
        if self.on_lost is not None:
            self.on_lost()

    # ------------------------------------------------------------------ mirrors

    def load(self, entry_id: bytes, fields: dict[bytes, bytes], now: float) -> bool:
        """Apply one entry read from Redis (a mirror); true at the end."""
        kind = int(entry_id.rsplit(b"-", 1)[1])
        open_ = self.replicator.open
        if kind == TOKEN:
            text = open_(fields[b"t"], self.keys[1]).decode()
            n = int(fields.get(b"n", b"1"))
            if self.logprobs is not None and fields.get(b"l"):
                self.logprobs.extend(_logprobs.decode(open_(fields[b"l"], self.keys[1])))
            if self.token_ids is not None and fields.get(b"i"):
                self.token_ids.extend(_ids.decode(open_(fields[b"i"], self.keys[1])))
            self.texts.append(text)
            if n != 1:
                self.counted(n)
            self.acked = self.sent = len(self.texts)
            self.acked_seq = self.sent_seq = self.acked_seq + n
            if self.stream and self._deliver is not None:
                self._deliver(text, n)
            return False
        frame = decode_server_text(open_(fields[b"f"], self.keys[1])) if fields.get(b"f") else None
        if kind == START and isinstance(frame, StartFrame):
            super().open(frame)
            return False
        self.close(frame if isinstance(frame, DoneFrame | ErrorFrame) else None, now)
        return True


class Replicator:
    """Sends every queued log's new entries to Redis, with the node's next batch.

    A log's tokens are sent at the pace of the server's frame merging (``merger``,
    :class:`~seedance.server.outbound.FrameMerger`): the first ones at once, then at most one
    token entry per merge window (stretched while the node is CPU-bound), which is also when
    its readers would have got their next frame; a start or an end goes at once."""

    def __init__(
        self,
        link: ClusterLink,
        ttl_s: float,
        at_rest: AtRest | None = None,
        claims: Claims | None = None,
    ) -> None:
        self.link = link
        self.claims = claims  # takes a lock Redis lost again (regain)
        self.ttl_ms = int(ttl_s * 1000)
        self.at_rest = at_rest
        #: The server's merge window (None: every log's tokens go at the next exchange).
        self.merger: Pace | None = None
        self._queued: list[ReplicatedLog] = []
        self._held: list[ReplicatedLog] = []  # until the merger's window ends
        self._loop: asyncio.AbstractEventLoop  # set by start()
        self._in_batch = False  # added to the node's next batch
        #: In the batch in flight: each log's plan, and how many commands it queued.
        self._sent: list[tuple[ReplicatedLog, _Plan, int]] = []
        self._append = script(link, _APPEND)
        self._append_saving = script(link, _APPEND_SAVING)
        self._append_tokens = script(link, _APPEND_TOKENS)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def seal(self, value: Value, key: str) -> Value | bytes:
        """A value as Redis keeps it under ``key``: sealed with ``--encrypt-at-rest``."""
        return value if self.at_rest is None else self.at_rest.seal(value, key)

    def open(self, value: bytes, key: str) -> bytes:
        """A value read from Redis (:class:`~seedance.cluster.atrest.Unreadable` if it does
        not open)."""
        return value if self.at_rest is None else self.at_rest.open(value, key)

    def mark(self, log: ReplicatedLog, *, now: bool = False) -> None:
        """Queue ``log``'s new entries for the next exchange; tokens of a log that sent some
        less than a merge window ago wait for the rest of the window (``now``: they do not)."""
        if log._queued:
            return
        merger = self.merger
        if now or merger is None or self._loop.time() - log.tokens_at >= merger.current_s:
            self._go(log)
        elif not log._held:
            log._held = True
            if not self._held:
                merger.hold(self)  # the merger's one timer releases them with the frames
            self._held.append(log)

    def release_held(self) -> None:
        """The merge window ended (:class:`~seedance.server.outbound.Held`)."""
        held, self._held = self._held, []
        for log in held:
            if log._held:  # else queued since
                self.mark(log, now=True)

    def retry(self, log: ReplicatedLog) -> None:
        if self.link.batch.closed is None:
            self._loop.call_later(RETRY_S, functools.partial(self.mark, log, now=True))
        elif log._ended is not None and not log._ended.done():
            log._ended.set_result(False)  # this node stops: its end is not written

    def regain(self, log: ReplicatedLog, plan: _Plan) -> None:
        """Redis refused ``plan``, ``log``'s writes: its lock is gone. If the plan carried the
        end and Redis has it (the end, which drops the lock, went through, and its reply was
        lost in a failover), the end is written. Else the claim takes the lock again if no
        other claim came since (a failover to a replica that lacked it, or one longer than
        the lease), and the entries go again; else the log is lost and its generation
        stops."""
        log._regaining = True
        self.link.spawn(self._regain(log, plan), "regain")

    async def _regain(self, log: ReplicatedLog, plan: _Plan) -> None:
        assert log.holder is not None
        try:
            version = await self._written_end(log, plan) if plan.end else None
            if version is not None:
                log._regaining = False
                log._resend = None
                log.acked_by(plan, [1, version])
                return
            held = self.claims is not None and await self.claims.hold((log.keys[0], log.holder))
        except Exception as exc:
            logger.warning("request %s: its lock could not be checked (%s)", log.request_id, exc)
            held = False
        log._regaining = False
        if not held:
            log.lose()
            return
        logger.warning("request %s: its lock was gone from Redis; taken again", log.request_id)
        self.mark(log, now=True)

    async def _written_end(self, log: ReplicatedLog, plan: _Plan) -> int | None:
        """None unless Redis has ``plan``'s end entry; then the version its save gave the
        session (0 without a save). One exchange."""
        end = f"{plan.seq}-{END}"
        stream = log.keys[1]
        hash_key = None if log.saving is None else log.saving.keys[0]

        def queue(pipe: Pipeline) -> None:
            pipe.xrange(stream, end, end)
            if hash_key is not None:
                pipe.hget(hash_key, "version")

        found, *version = await self.link.exchange(queue, idempotent=True)
        if not found:
            return None
        return int(version[0] or 0) if version else 0

    def _go(self, log: ReplicatedLog) -> None:
        log._queued = True
        self._queued.append(log)
        if not self._in_batch:
            self._in_batch = True
            self.link.batch.add(self)

    # The replicator's part of the node's batch (:class:`~seedance.cluster.link.Exchange`).

    def queue(self, pipe: Pipeline) -> None:
        """Each queued log's new entries, through one script each."""
        self._in_batch = False
        batch, self._queued = self._queued, []
        now = self._loop.time()
        for log in batch:
            plan = log.plan(now)
            if plan is None:
                continue
            saving = log.saving if plan.end else None
            if plan.light:
                self._append_tokens.queue(pipe, log.keys[:2], log.script_args(plan))
            elif saving is not None:
                self._append_saving.queue(pipe, [*log.keys, *saving.keys], log.script_args(plan))
                saving.queue_after(pipe)
            else:
                self._append.queue(pipe, log.keys, log.script_args(plan))
            self._sent.append((log, plan, 1 if saving is None else 2))

    def answered(self, replies: list[Any] | BaseException) -> None:
        sent, self._sent = self._sent, []
        at = 0
        for log, plan, commands in sent:
            log.acked_by(plan, replies if isinstance(replies, BaseException) else replies[at])
            at += commands


TakeOver = Callable[[ReplicatedLog, dict[str, Any]], Awaitable[bool]]


class RedisStreamStore(MemoryStreamStore):
    """The :class:`~seedance.streams.store.StreamStore` of the cluster mode: the logs this
    node runs or mirrors, in memory, and every log in Redis."""

    def __init__(
        self,
        link: ClusterLink,
        *,
        window_s: float,
        max_bytes_per_tenant: int,
        session_ttl_s: float,
        at_rest: AtRest | None = None,
        claims: Claims | None = None,
    ) -> None:
        super().__init__(window_s=window_s, max_bytes_per_tenant=max_bytes_per_tenant)
        self.link = link
        self.replicator = Replicator(link, window_s + TTL_MARGIN_S, at_rest, claims)
        self.epoch_ttl_ms = int((max(window_s, session_ttl_s) + TTL_MARGIN_S) * 1000)
        self._epochs: dict[tuple[str, str], str] = {}
        #: Takes a generation over (set by the server); true if this node runs it now.
        self.take_over: TakeOver | None = None

    def start(self) -> None:
        self.replicator.start()

    def _new_log(
        self, tenant: str, session_id: str, request_id: str, *, resumable: bool, stream: bool
    ) -> StreamLog:
        epoch = self._epochs.get((tenant, session_id), self.epoch)
        return ReplicatedLog(
            request_id,
            epoch,
            resumable=resumable,
            stream=stream,
            keys=log_keys(tenant, session_id, request_id),
            replicator=self.replicator,
        )

    async def epoch_of(self, tenant: str, session_id: str) -> str:
        key = session_key(tenant, session_id, "epoch")

        def queue(pipe: Pipeline) -> None:
            pipe.set(key, secrets.token_hex(8), nx=True, px=self.epoch_ttl_ms)
            pipe.get(key)
            pipe.pexpire(key, self.epoch_ttl_ms, gt=True)

        replies = await self.link.exchange(queue, idempotent=True)
        value: str = replies[1].decode()
        if len(self._epochs) > 100_000:
            self._epochs.clear()
        self._epochs[(tenant, session_id)] = value
        return value

    async def active(self, tenant: str, session_id: str) -> StreamLog | None:
        log = self.current(tenant, session_id)
        if log is not None:
            return log
        (request_id,) = await self.link.exchange(
            lambda pipe: pipe.get(session_key(tenant, session_id, "current")), idempotent=True
        )
        if request_id is None:
            return None
        try:
            return await self._mirror(tenant, session_id, request_id.decode())
        except HistoryLost:
            return None

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session was deleted: its log goes, here and in Redis (no node finds it)."""
        await super().forget(tenant, session_id)
        current = session_key(tenant, session_id, "current")
        (request_id,) = await self.link.exchange(lambda pipe: pipe.get(current))
        if request_id is not None:
            _, stream, gen, _, _ = log_keys(tenant, session_id, request_id.decode())
            await self.link.exchange(lambda pipe: pipe.delete(stream, gen, current))

    async def find(
        self, tenant: str, session_id: str, request_id: str, epoch: str | None
    ) -> StreamLog:
        if epoch is not None:
            current = await self.epoch_of(tenant, session_id)
            if epoch != current:
                raise HistoryLost(
                    "epoch_changed",
                    f"the cluster's store lost the stream log that epoch {epoch} refers to (it "
                    f"now keeps epoch {current}); send the request again",
                    request_id=request_id,
                )
        key = (tenant, session_id)
        log = self._logs.get(key)
        if log is not None and log.request_id == request_id:
            if log.running or await self._kept(log):
                return log
            self._drop(key, log)  # its session was deleted on another node
        return await self._mirror(tenant, session_id, request_id)

    async def _kept(self, log: StreamLog) -> bool:
        """Whether Redis still has the ended ``log`` (another node may have deleted it)."""
        assert isinstance(log, ReplicatedLog)
        gen = log.keys[2]
        (kept,) = await self.link.exchange(lambda pipe: pipe.exists(gen), idempotent=True)
        return bool(kept)

    async def _mirror(self, tenant: str, session_id: str, request_id: str) -> ReplicatedLog:
        """The log of ``request_id`` as Redis has it, followed live while it runs."""
        keys = log_keys(tenant, session_id, request_id)
        lock, stream, gen, current, _ = keys

        def queue(pipe: Pipeline) -> None:
            pipe.get(current)
            pipe.hget(gen, "header")
            pipe.xrange(stream, "-", "+")
            pipe.get(lock)

        now_current, raw_header, entries, holder = await self.link.exchange(queue, idempotent=True)
        if raw_header is None or not entries:
            raise HistoryLost(
                "expired",
                f"no stream {request_id} on this session to resume: it ended more than "
                f"{self.window_s:g} s ago, was not resumable, or never ran",
                request_id=request_id,
            )
        if now_current is not None and now_current.decode() != request_id:
            raise HistoryLost(
                "expired",
                f"stream {request_id} was replaced by a later request on this session",
                request_id=request_id,
            )
        try:
            header = msgspec.json.decode(self.replicator.open(raw_header, gen))
            log = ReplicatedLog(
                request_id,
                self._epochs.get((tenant, session_id), self.epoch),
                resumable=header["resumable"],
                stream=header["stream"],
                keys=keys,
                replicator=self.replicator,
            )
            log.meta = header.get("meta")
            request = header.get("request") or {}  # what a resume here hands on, as the owner
            log.keeps(request.get("logprobs") is not None, request.get("tensors") or ())
            now = time.monotonic()
            last_id = b"0-0"
            for entry_id, fields in entries:
                last_id = entry_id
                if log.load(entry_id, fields, now):
                    return log  # ended: nothing to follow
        except Unreadable as exc:  # --encrypt-at-rest switched, or the key changed
            logger.warning("request %s: cannot be resumed: %s", request_id, exc)
            raise HistoryLost(
                "expired",
                f"stream {request_id} is stored under another key: it cannot be read here",
                request_id=request_id,
            ) from None
        key = (tenant, session_id)
        previous = self._logs.get(key)
        if previous is not None and previous is not log:
            self._drop(key, previous)
        self._logs[key] = log
        self.link.spawn(self._follow(key, log, header, last_id, holder is None), "follow")
        return log

    async def _follow(
        self,
        key: tuple[str, str],
        log: ReplicatedLog,
        header: dict[str, Any],
        last_id: bytes,
        orphaned: bool,
    ) -> None:
        """Read the log's new entries as Redis gets them; take the generation over when its
        node is gone."""
        lock, stream = log.keys[0], log.keys[1]
        block_ms = max(100, int(self.link.lease_s * 500))
        while self._logs.get(key) is log and log.running and not log.owned:
            if orphaned and self.take_over is not None and await self.take_over(log, header):
                return
            try:
                reply: Any = await self.link.blocking.xread(
                    {stream: last_id}, count=READ_COUNT, block=block_ms
                )
            except (RedisError, OSError) as exc:
                logger.debug("request %s: not followed (%s); again", log.request_id, exc)
                await asyncio.sleep(RETRY_S)
                continue
            if reply:
                now = time.monotonic()
                for entry_id, fields in reply[0][1]:
                    last_id = entry_id
                    if log.load(entry_id, fields, now):
                        return
                continue
            if not log.readers:  # nobody reads it here any more: stop mirroring
                self._drop(key, log)
                return
            try:
                orphaned = await self.link.redis.get(lock) is None
            except (RedisError, OSError):
                orphaned = False
