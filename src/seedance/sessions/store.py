"""Session stores: where sessions live between connections.

:class:`SessionStore` is the interface the server uses; :class:`MemorySessionStore` keeps
sessions in this process. A store for a cluster (Redis) implements the same methods.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from seedance.protocol.errors import Overloaded, QuotaExceeded
from seedance.protocol.messages import SessionId, TenantId
from seedance.sessions.session import Session, SessionKey

if TYPE_CHECKING:
    from seedance.streams.log import StreamLog

logger = logging.getLogger(__name__)


def new_session_id() -> SessionId:
    return SessionId("s-" + secrets.token_urlsafe(12))


class SessionStore(Protocol):
    """What the server needs from a session store."""

    ttl_s: float

    @property
    def bytes(self) -> int:
        """History held by all sessions (of this process)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def attach(
        self, tenant: TenantId, session_id: SessionId | None, max_for_tenant: int | None = None
    ) -> tuple[Session, bool]:
        """The session ``session_id`` of ``tenant`` (a new one if unknown or None) and whether
        it was created.

        Raises :class:`Overloaded` when the store is full of sessions in use, and
        :class:`QuotaExceeded` when creating one would pass ``max_for_tenant``.
        """
        ...

    async def detach(self, session: Session) -> None:
        """A connection let go of ``session``; its TTL starts counting."""
        ...

    async def reserve(self, session: Session, size: int, max_for_tenant: int | None) -> None:
        """Make room for ``size`` more bytes of history in ``session``, evicting idle sessions
        (least recently used first) when the store or the tenant (``max_for_tenant`` bytes)
        would pass its budget.

        Raises :class:`Overloaded` when the store's budget cannot be met, and
        :class:`QuotaExceeded` when the tenant's cannot; nothing is evicted then.
        """
        ...

    async def save(self, session: Session, *, with_end: StreamLog | None = None) -> None:
        """Persist ``session`` after its context changed; ``with_end``: the log of the
        generation that changed it, whose end may carry the save (in a cluster: saved in one
        step with the end and the release of the session's lock)."""
        ...

    async def delete(self, session: Session) -> None: ...

    async def end(self, tenant: TenantId, session_id: SessionId) -> bool:
        """Delete the session wherever it is stored (held here or not); whether it was."""
        ...

    async def usage(self, tenants: Sequence[TenantId]) -> dict[TenantId, tuple[int, int]]:
        """Each tenant's live sessions and the history bytes they hold, as its ``sessions``
        and ``session_bytes`` quotas count them (across the cluster, in the cluster mode)."""
        ...

    def __len__(self) -> int: ...

    def get(self, tenant: TenantId, session_id: SessionId) -> Session | None:
        """The session if this process holds it."""
        ...


class MemorySessionStore:
    """Sessions in a dict ordered by last use; a reaper task expires them after ``ttl_s``.

    Sessions attached to a connection or running a generation never expire. When
    ``max_sessions`` is reached, the least recently used idle session is evicted; so are idle
    sessions when the history all sessions hold would pass ``max_bytes`` (see
    :meth:`reserve`).
    """

    def __init__(
        self,
        *,
        ttl_s: float,
        max_sessions: int,
        max_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.bytes = 0  # history held by all sessions, as last saved
        self._clock = clock
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self._per_tenant: dict[TenantId, int] = {}
        self._bytes_per_tenant: dict[TenantId, int] = {}
        self._counted: dict[SessionKey, int] = {}  # each session's bytes in the totals
        self._reaper: asyncio.Task[None] | None = None
        self.expired_total = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    async def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="session-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    async def attach(
        self, tenant: TenantId, session_id: SessionId | None, max_for_tenant: int | None = None
    ) -> tuple[Session, bool]:
        now = self._clock()
        key: SessionKey = (tenant, session_id or new_session_id())
        session = self._sessions.get(key)
        created = False
        if session is not None and self._expired(session, now):
            self._remove(key)
            self.expired_total += 1
            session = None
        if session is None:
            if max_for_tenant is not None and self.count(tenant) >= max_for_tenant:
                raise QuotaExceeded(
                    f"tenant {tenant} has {max_for_tenant} live sessions, its limit; end one "
                    "(end_session) or wait for one to expire"
                )
            if len(self._sessions) >= self.max_sessions:
                self._evict_one()
            session = Session(key, now)
            self._sessions[key] = session
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
            created = True
        else:
            self._sessions.move_to_end(key)
        session.attached += 1
        session.last_active = now
        return session, created

    async def detach(self, session: Session) -> None:
        session.attached = max(0, session.attached - 1)
        self.touch(session)

    async def save(self, session: Session, *, with_end: StreamLog | None = None) -> None:
        self.touch(session)
        key = session.key
        if key not in self._sessions:
            return  # deleted meanwhile
        delta = session.size - self._counted.get(key, 0)
        self._counted[key] = session.size
        self._add_bytes(session.tenant, delta)
        if self.bytes > self.max_bytes:  # the reply just saved: make room after the fact
            self._evict_bytes(self.bytes - self.max_bytes, keep=session)

    async def reserve(self, session: Session, size: int, max_for_tenant: int | None) -> None:
        tenant = session.tenant
        if max_for_tenant is not None:
            over = self._bytes_per_tenant.get(tenant, 0) + size - max_for_tenant
            if over > 0 and not self._evict_bytes(over, keep=session, tenant=tenant):
                raise QuotaExceeded(
                    f"tenant {tenant}'s sessions would hold more than {max_for_tenant} bytes of "
                    "history, its limit, and none of its idle sessions can make room; end a "
                    "session (end_session) or start this one afresh (reset)"
                )
        over = self.bytes + size - self.max_bytes
        if over > 0 and not self._evict_bytes(over, keep=session):
            raise Overloaded(
                f"the server's sessions would hold more than {self.max_bytes} bytes of history "
                "and none of the idle ones can make room; retry later"
            )

    def _evict_bytes(self, size: int, *, keep: Session, tenant: TenantId | None = None) -> bool:
        """Evict idle sessions (of ``tenant`` only, when given), least recently used first,
        until ``size`` bytes are freed; false, evicting nothing, when they cannot be."""
        chosen, freed = [], 0
        for key, other in self._sessions.items():
            if freed >= size:
                break
            if other is keep or not other.idle:
                continue
            if tenant is not None and key[0] != tenant:
                continue
            counted = self._counted.get(key, 0)
            if counted:
                chosen.append(key)
                freed += counted
        if freed < size:
            return False
        for key in chosen:
            self._remove(key)
        self.evicted_total += len(chosen)
        logger.info(
            "%d idle session(s) evicted to free %d bytes of history (%d held)",
            len(chosen),
            freed,
            self.bytes,
        )
        return True

    def _add_bytes(self, tenant: TenantId, delta: int) -> None:
        self.bytes += delta
        held = self._bytes_per_tenant.get(tenant, 0) + delta
        if held:
            self._bytes_per_tenant[tenant] = held
        else:
            self._bytes_per_tenant.pop(tenant, None)

    def bytes_of(self, tenant: TenantId) -> int:
        """History held by the sessions of ``tenant``."""
        return self._bytes_per_tenant.get(tenant, 0)

    async def delete(self, session: Session) -> None:
        self._remove(session.key)

    async def end(self, tenant: TenantId, session_id: SessionId) -> bool:
        held = (tenant, session_id) in self._sessions
        self._remove((tenant, session_id))
        return held

    async def usage(self, tenants: Sequence[TenantId]) -> dict[TenantId, tuple[int, int]]:
        return {tenant: (self.count(tenant), self.bytes_of(tenant)) for tenant in tenants}

    def touch(self, session: Session) -> None:
        session.last_active = self._clock()
        if session.key in self._sessions:
            self._sessions.move_to_end(session.key)

    def count(self, tenant: TenantId) -> int:
        """Live sessions of ``tenant``."""
        return self._per_tenant.get(tenant, 0)

    def get(self, tenant: TenantId, session_id: SessionId) -> Session | None:
        return self._sessions.get((tenant, session_id))

    def sweep(self) -> int:
        """Expire idle sessions past their TTL; returns how many went."""
        now = self._clock()
        expired = []
        for key, session in self._sessions.items():
            if now - session.last_active < self.ttl_s:
                break  # ordered by last use: the rest are younger
            if self._expired(session, now):
                expired.append(key)
        for key in expired:
            self._remove(key)
        self.expired_total += len(expired)
        return len(expired)

    def _expired(self, session: Session, now: float) -> bool:
        return session.idle and now - session.last_active >= self.ttl_s

    def _evict_one(self) -> None:
        for key, session in self._sessions.items():
            if session.idle:
                self._remove(key)
                self.evicted_total += 1
                logger.info("session %s evicted: %d sessions kept", key[1], self.max_sessions)
                return
        raise Overloaded(f"the server holds {self.max_sessions} sessions, all in use; retry later")

    def _remove(self, key: SessionKey) -> None:
        if self._sessions.pop(key, None) is not None:
            tenant = key[0]
            counted = self._counted.pop(key, 0)
            if counted:
                self._add_bytes(tenant, -counted)
            left = self._per_tenant[tenant] - 1
            if left:
                self._per_tenant[tenant] = left
            else:
                del self._per_tenant[tenant]

    async def _reap_forever(self) -> None:
        interval = min(max(self.ttl_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                count = self.sweep()
            except Exception:  # pragma: no cover - a bug; keep the reaper alive
                logger.exception("session reaper failed")
                continue
            if count:
                logger.info("expired %d idle session(s)", count)
