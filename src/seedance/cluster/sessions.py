"""Sessions in Redis: any node of the cluster serves any session.

A session is a hash (``sd:{s:TENANT:SESSION}:session``: a ``version`` that every save
increments, when it was created) and a list of its turns, one JSON document each
(``...:turns``), both with the session TTL, renewed while a connection holds it. A save sends
only what changed (the turns an exchange added, and how many the context keeps: the oldest go
when it outgrows the model's window), so a turn costs the same at the hundredth exchange as at
the first. Each tenant has a sorted set of its live sessions by expiry and a hash of
their history bytes (``sd:{t:TENANT}:sessions``, ``:history``), for its ``sessions`` and
``session_bytes`` quotas across the cluster; a session is counted in one atomic script, so N
nodes never create more than the limit.

A node keeps the sessions its connections hold in memory (the turns a prompt is built from);
saves happen only under the session's cluster lock (one generation per session), and a
generation first reloads the turns when another node saved a newer version
(:meth:`RedisSessionStore.refresh`), so a reply always continues the latest context.

What a single node does and this store does not: evict idle sessions to stay under
``--max-sessions`` and ``--max-session-bytes`` (Redis's own ``maxmemory`` bounds the cluster;
a tenant over its ``session_bytes`` is refused, nothing of another session is dropped).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgspec

from seedance.cluster.atrest import AtRest, Unreadable
from seedance.cluster.link import ClusterLink, script, session_key, tenant_key
from seedance.protocol.errors import QuotaExceeded
from seedance.protocol.messages import SessionId, TenantId
from seedance.sessions.session import Session, SessionKey, Turn
from seedance.sessions.store import new_session_id

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

    from seedance.streams.log import StreamLog

logger = logging.getLogger(__name__)

#: The longest a held session's TTL goes unrenewed.
RENEW_MAX_S: Final = 10.0

# KEYS: the tenant's sessions (by expiry), its history bytes. ARGV: session id, limit (-1:
# none), TTL (ms). Sweeps the expired, then counts the session in; {1} or {0, live}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
  redis.call('HDEL', KEYS[2], unpack(gone))
end
local live = redis.call('ZCARD', KEYS[1])
local limit = tonumber(ARGV[2])
if limit >= 0 and not redis.call('ZSCORE', KEYS[1], ARGV[1]) and live >= limit then
  return {0, live}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {1, live}
"""

# KEYS: the tenant's sessions, its history bytes. ARGV: TTL (ms), then session id and its bytes
# (-1: unchanged) pairs. Renews the sessions' expiry in the tenant's set.
_RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], until_ms, ARGV[i])
  if tonumber(ARGV[i + 1]) >= 0 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# KEYS: the tenant's sessions, its history bytes. ARGV: the session id. The other live
# sessions' history bytes.
_HISTORY = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = 0
local sizes = redis.call('HGETALL', KEYS[2])
for i = 1, #sizes, 2 do
  local expires = redis.call('ZSCORE', KEYS[1], sizes[i])
  if sizes[i] ~= ARGV[1] and expires and tonumber(expires) > now then
    held = held + tonumber(sizes[i + 1])
  end
end
return held
"""

# KEYS: the tenant's sessions, its history bytes. Its live sessions and their history bytes.
_USAGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
local held = 0
for _, id in ipairs(live) do held = held + (tonumber(redis.call('HGET', KEYS[2], id)) or 0) end
return {#live, held}
"""

# A session's save, in Lua, given the locals hash and turns (its keys), ttl (ms), cleared ('1':
# a reset cleared the turns first), kept (how many turns the context keeps) and from, upto
# (where in ARGV the turns added lie, oldest first): appends them and drops the oldest beyond
# those kept.
SAVE_TURNS = """
if cleared == '1' or kept == '0' then redis.call('DEL', turns) end
for i = from, upto do redis.call('RPUSH', turns, ARGV[i]) end
if kept ~= '0' then redis.call('LTRIM', turns, -tonumber(kept), -1) end
redis.call('PEXPIRE', hash, ttl)
redis.call('PEXPIRE', turns, ttl)
"""
# KEYS: the session's hash, its turns. ARGV: when it was created ('': saved before), the
# save's id, then a save's arguments (SessionSave.args). Counts the version up (0 when
# created); returns it. A save sent again (its reply lost in a failover) is saved once.
_SAVE = (
    "local hash, turns = KEYS[1], KEYS[2]\n"
    "if redis.call('HGET', hash, 'save') == ARGV[2] then\n"
    "  return tonumber(redis.call('HGET', hash, 'version'))\n"
    "end\n"
    "local ttl, cleared, kept = ARGV[3], ARGV[4], ARGV[5]\n"
    "local from, upto = 7, 6 + tonumber(ARGV[6])\n"
    + SAVE_TURNS
    + """
redis.call('HSET', hash, 'save', ARGV[2])
if ARGV[1] ~= '' then
  redis.call('HSET', hash, 'version', 0, 'created', ARGV[1])
  return 0
end
return redis.call('HINCRBY', hash, 'version', 1)
"""
)


@dataclass(slots=True)
class SessionSave:
    """A session's save that goes with its generation's end, in the end's own script
    (:meth:`RedisSessionStore.save` hands it to the generation's log)."""

    #: The session's hash and turns.
    keys: list[str]
    #: TTL (ms), cleared ('1' or '0'), how many turns the context keeps, how many it added,
    #: then the turns added.
    args: list[Any]
    #: Queues what goes in the same exchange (the tenant's history bytes).
    queue_after: Callable[[Pipeline], None]
    #: Called with the version Redis saved.
    saved: Callable[[int], None]


_turn = msgspec.json.Encoder()
_read_turn = msgspec.json.Decoder(Turn)


class RedisSessionStore:
    """The :class:`~seedance.sessions.store.SessionStore` of the cluster mode."""

    def __init__(self, link: ClusterLink, *, ttl_s: float, at_rest: AtRest | None = None) -> None:
        self.link = link
        #: ``--encrypt-at-rest``: the turns are sealed in Redis (under their session's key).
        self.at_rest = at_rest
        self.ttl_s = ttl_s
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._held: dict[SessionKey, Session] = {}
        self._versions: dict[SessionKey, int] = {}  # the version each held copy holds
        self._admit = script(link, _ADMIT)
        self._renew = script(link, _RENEW)
        self._history = script(link, _HISTORY)
        self._usage = script(link, _USAGE)
        self._save = script(link, _SAVE)
        self._renewer: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    async def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever(), name="session-renewer")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
            self._renewer = None

    # ------------------------------------------------------------------ the store

    async def attach(
        self, tenant: TenantId, session_id: SessionId | None, max_for_tenant: int | None = None
    ) -> tuple[Session, bool]:
        await self.link.ready()
        key: SessionKey = (tenant, session_id or new_session_id())
        limit = -1 if max_for_tenant is None else max_for_tenant

        def queue(pipe: Pipeline) -> None:
            if session_id is not None:
                pipe.hget(self._key(key), "version")
                pipe.lrange(self._turns_key(key), 0, -1)
            self._admit.queue(pipe, self._tenant_keys(tenant), [key[1], limit, self.ttl_ms])

        *looked_up, admitted = await self.link.exchange(queue, idempotent=True)
        version, turns = looked_up if looked_up else (None, [])
        created = version is None
        if not admitted[0]:
            raise QuotaExceeded(
                f"tenant {tenant} has {max_for_tenant} live sessions, its limit (across the "
                "cluster); end one (end_session) or wait for one to expire"
            )
        session = self._held.get(key)
        if session is None:
            session = Session(key, time.monotonic())
            self._held[key] = session
        if created:
            await self._write(session, *self._save_args(session), created=True)
        else:
            self._load(session, turns, int(version))
        session.attached += 1
        session.last_active = time.monotonic()
        return session, created

    async def detach(self, session: Session) -> None:
        session.attached = max(0, session.attached - 1)
        session.last_active = time.monotonic()
        if self._held.get(session.key) is not session:
            return  # ended meanwhile (:meth:`end`): nothing to renew
        try:
            await self._renew_sessions([session])
        except Exception as exc:  # the TTL runs from the last renewal instead
            logger.debug("session %s not renewed: %s", session.session_id, exc)
        self._let_go(session)

    async def reserve(self, session: Session, size: int, max_for_tenant: int | None) -> None:
        if max_for_tenant is None:
            return
        (others,) = await self.link.exchange(
            lambda pipe: self._history.queue(
                pipe, self._tenant_keys(session.tenant), [session.session_id]
            ),
            idempotent=True,
        )
        if int(others) + session.size + size > max_for_tenant:
            raise QuotaExceeded(
                f"tenant {session.tenant}'s sessions would hold more than {max_for_tenant} "
                "bytes of history, its limit (across the cluster); end a session (end_session) "
                "or start this one afresh (reset)"
            )

    async def save(self, session: Session, *, with_end: StreamLog | None = None) -> None:
        session.last_active = time.monotonic()
        keys, args = self._save_args(session)
        if with_end is not None:
            queue_renew = functools.partial(self._queue_renew, session)
            save = SessionSave(keys, args, queue_renew, functools.partial(self._saved, session))
            if with_end.saves_with_end(save):
                return
        await self._write(session, keys, args, created=False)

    def hash_key(self, session: Session) -> str:
        """The session's hash (whose ``version`` a generation's claim reads)."""
        return self._key(session.key)

    def version(self, session: Session) -> int:
        """The version of the session's turns this node holds (0: as created)."""
        return self._versions.get(session.key, 0)

    async def refresh(self, session: Session, version: int | None) -> bool:
        """Reload the session's turns if another node saved a newer ``version`` than this
        node's copy; true if it did."""
        key = session.key
        if version is None or version == self.version(session):
            return False
        (turns,) = await self.link.exchange(
            lambda pipe: pipe.lrange(self._turns_key(key), 0, -1), idempotent=True
        )
        self._load(session, turns, version)
        return True

    async def delete(self, session: Session) -> None:
        await self.end(session.tenant, session.session_id)

    async def end(self, tenant: TenantId, session_id: SessionId) -> bool:
        key: SessionKey = (tenant, session_id)
        sessions, history = self._tenant_keys(tenant)

        def queue(pipe: Pipeline) -> None:
            pipe.delete(self._key(key), self._turns_key(key))
            pipe.zrem(sessions, session_id)
            pipe.hdel(history, session_id)

        held = self._held.get(key)
        if held is not None:  # first: a connection that lets go meanwhile renews nothing
            held.attached = 0
            self._drop(key)
        deleted, counted, _ = await self.link.exchange(queue)
        return bool(deleted or counted) or held is not None

    async def usage(self, tenants: Sequence[TenantId]) -> dict[TenantId, tuple[int, int]]:
        def queue(pipe: Pipeline) -> None:
            for tenant in tenants:
                self._usage.queue(pipe, self._tenant_keys(tenant), [])

        counts = await self.link.exchange(queue) if tenants else []
        return {
            tenant: (int(n), int(size)) for tenant, (n, size) in zip(tenants, counts, strict=True)
        }

    def get(self, tenant: TenantId, session_id: SessionId) -> Session | None:
        return self._held.get((tenant, session_id))

    # ------------------------------------------------------------------ Redis

    @staticmethod
    def _key(key: SessionKey) -> str:
        return session_key(key[0], key[1], "session")

    @staticmethod
    def _turns_key(key: SessionKey) -> str:
        return session_key(key[0], key[1], "turns")

    @staticmethod
    def _tenant_keys(tenant: str) -> list[str]:
        return [tenant_key(tenant, "sessions"), tenant_key(tenant, "history")]

    def _save_args(self, session: Session) -> tuple[list[str], list[Any]]:
        """A save's keys and arguments (:attr:`SessionSave.args`)."""
        keys = [self._key(session.key), self._turns_key(session.key)]
        added: list[bytes] = [_turn.encode(turn) for turn in session.unsaved_turns()]
        if self.at_rest is not None:
            added = [self.at_rest.seal(turn, keys[1]) for turn in added]
        cleared = "1" if session.cleared else "0"
        return keys, [self.ttl_ms, cleared, len(session.turns), len(added), *added]

    def _queue_renew(self, session: Session, pipe: Pipeline) -> None:
        """The session's expiry and history bytes in its tenant's counts."""
        renewed = [self.ttl_ms, session.session_id, session.size]
        self._renew.queue(pipe, self._tenant_keys(session.tenant), renewed)

    def _saved(self, session: Session, version: int) -> None:
        session.saved()
        self._versions[session.key] = version

    async def _write(
        self, session: Session, keys: list[str], args: list[Any], *, created: bool
    ) -> None:
        """Save ``session`` (``keys`` and ``args``: :meth:`_save_args`) in an exchange of its
        own."""

        head = [time.time() if created else "", secrets.token_hex(8)]

        def queue(pipe: Pipeline) -> None:
            self._save.queue(pipe, keys, [*head, *args])
            self._queue_renew(session, pipe)

        version, _ = await self.link.exchange(queue, idempotent=True)
        self._saved(session, int(version))

    def _load(self, session: Session, stored: list[bytes], version: int) -> None:
        turns_key = self._turns_key(session.key)
        try:
            if self.at_rest is not None:
                stored = [self.at_rest.open(turn, turns_key) for turn in stored]
            session.turns = [_read_turn.decode(turn) for turn in stored]
        except Unreadable as exc:  # --encrypt-at-rest switched, or the key changed
            logger.warning("session %s starts empty: %s", session.session_id, exc)
            session.turns = []
        session.saved()
        session.size = sum(t.size for t in session.turns)
        self._versions[session.key] = version

    @property
    def bytes(self) -> int:
        """History of the sessions held here (for the gauges: summed when asked)."""
        return sum(s.size for s in self._held.values())

    def _let_go(self, session: Session) -> None:
        """Forget a session that no connection or generation holds here any more."""
        if session.idle:
            self._drop(session.key)

    def _drop(self, key: SessionKey) -> None:
        if self._held.pop(key, None) is not None:
            self._versions.pop(key, None)

    async def _renew_sessions(self, sessions: list[Session]) -> None:
        """Extend the TTL of ``sessions`` (one pipelined exchange)."""
        by_tenant: dict[str, list[str]] = {}
        for session in sessions:
            by_tenant.setdefault(session.tenant, []).extend((session.session_id, "-1"))

        def queue(pipe: Pipeline) -> None:
            for session in sessions:
                pipe.pexpire(self._key(session.key), self.ttl_ms)
                pipe.pexpire(self._turns_key(session.key), self.ttl_ms)
            for tenant, pairs in by_tenant.items():
                self._renew.queue(pipe, self._tenant_keys(tenant), [self.ttl_ms, *pairs])

        await self.link.exchange(queue)

    async def _renew_forever(self) -> None:
        period = min(self.ttl_s / 3, RENEW_MAX_S)
        while True:
            await asyncio.sleep(period)
            for session in [s for s in self._held.values() if s.idle]:
                self._drop(session.key)  # its last generation ended after its connection left
            held = list(self._held.values())
            if not held:
                continue
            try:
                await self._renew_sessions(held)
            except Exception as exc:  # Redis down: the link says so; next period
                logger.debug("sessions not renewed: %s", exc)
