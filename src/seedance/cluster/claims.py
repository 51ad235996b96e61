"""What a running generation holds in Redis, and how it gets it: its session's lock and its
tenant's quota reservation, both leases that a live node renews.

One exchange with Redis (two scripts, in the node's next batch) claims both when a generation
starts:

- **The session's lock** (``sd:{s:TENANT:SESSION}:lock``): one generation per session across
  every node. Its value names the node, the request and a fencing token (a counter of the
  session's claims), so that a node that lost its lease (frozen past it, or Redis lost the
  key) can tell and is refused by every fenced write.
- **The quota reservation** (``sd:{t:TENANT}:requests|tokens|generations``): requests per minute
  and tokens per minute are sliding windows of 60 s in sorted sets, concurrent generations a
  sorted set of leases; the script checks and records in one atomic step, so N nodes never
  admit more than the limit. Tokens are reserved up front (the prompt and ``max_tokens``) and
  reconciled at the end (the prompt at the start, the reply's tokens at the end), so a tenant
  never passes ``tokens_per_minute``, even for a moment.

Time is Redis's own (``TIME``), the one clock every node agrees on. Whichever claim fails, the
other is given back. A node renews its claims every third of ``--lease``; those of a node that
died expire on their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from seedance.cluster.link import ClusterLink, script, session_key, tenant_key
from seedance.protocol.errors import QuotaExceeded, SessionBusy
from seedance.tenants.config import Quotas
from seedance.tenants.usage import rate_refusal

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

logger = logging.getLogger(__name__)

#: How long a session's fencing counter is kept after its last claim.
FENCE_TTL_MS: Final = 7 * 24 * 3600 * 1000

# KEYS: lock, fence, and the session's hash (optional). ARGV: node and request, lease (ms),
# the fence's TTL (ms). Returns {fence, "", version} when claimed (version: the session's
# stored version, false without a hash), {0, holder} when another claim holds the lock. A
# claim sent again (its reply lost in a failover) finds its own lock: claimed, not busy.
_LOCK = """
local held = redis.call('GET', KEYS[1])
local fence
if held then
  if string.sub(held, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return {0, held} end
  fence = tonumber(string.sub(held, #ARGV[1] + 2))
else
  fence = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. fence, 'PX', ARGV[2])
end
local version = false
if KEYS[3] then version = redis.call('HGET', KEYS[3], 'version') end
return {fence, '', version}
"""

# Renews a claim's lock; with ARGV[3] '1', takes it again when Redis lost it (a failover
# longer than the lease, or to a replica that lacked it) and no claim came since: the fencing
# counter still says this claim's token. Only a generation's own log asks that, never between
# its writes (a renewal could take again a lock its end just dropped). KEYS: lock, fence.
# ARGV: the value the claim set, lease (ms), retake. 0 when the claim is lost.
_HOLD = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if held or ARGV[3] ~= '1' then return 0 end
if redis.call('GET', KEYS[2]) ~= string.match(ARGV[1], '(%d+)$') then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lock. ARGV: the value the claim set.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: requests, tokens, generations. ARGV: request id, requests per minute, tokens per minute,
# generations (-1: no limit), tokens to reserve, lease (ms). Members of tokens are "ID:COUNT".
# Returns {"ok", now} or {what is at its limit, ms until it would pass}.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = 60000
local id, rpm, tpm, gens = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local need, lease = tonumber(ARGV[5]), tonumber(ARGV[6])
local made = redis.call('ZSCORE', KEYS[1], id)
if made then return {'ok', tonumber(made)} end  -- sent again: reserved once
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if gens >= 0 and redis.call('ZCARD', KEYS[3]) >= gens then return {'generations', 1000} end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if rpm >= 0 and redis.call('ZCARD', KEYS[1]) >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {'requests', tonumber(oldest[2]) + window - now}
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
if tpm >= 0 then
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  local used = 0
  for i = 1, #entries, 2 do used = used + tonumber(string.match(entries[i], ':(%d+)$')) end
  if used + need > tpm then
    for i = 1, #entries, 2 do
      used = used - tonumber(string.match(entries[i], ':(%d+)$'))
      if used + need <= tpm then return {'tokens', tonumber(entries[i + 1]) + window - now} end
    end
    return {'tokens', window}
  end
end
redis.call('ZADD', KEYS[1], now, id)
redis.call('ZADD', KEYS[2], now, id .. ':' .. need)
redis.call('ZADD', KEYS[3], now + lease, id)
redis.call('PEXPIRE', KEYS[1], window)
redis.call('PEXPIRE', KEYS[2], window)
redis.call('PEXPIRE', KEYS[3], window + lease)
return {'ok', now}
"""

# KEYS: tokens, generations. ARGV: request id, tokens reserved, prompt tokens, reply tokens,
# when the reservation was made (ms).
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
redis.call('ZREM', KEYS[2], id)
if redis.call('ZREM', KEYS[1], id .. ':' .. ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[1], ARGV[5], id .. ':' .. ARGV[3])
  if tonumber(ARGV[4]) > 0 then redis.call('ZADD', KEYS[1], now, id .. '+:' .. ARGV[4]) end
  redis.call('PEXPIRE', KEYS[1], 60000)
end
return 1
"""

# KEYS: generations. ARGV: lease (ms), request ids. Extends the leases still held.
_RENEW_SLOTS = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 60000 + tonumber(ARGV[1]))
return 1
"""


def _limit(value: int | None) -> int:
    return -1 if value is None else value


@dataclass(slots=True)
class Claim:
    """One generation's hold on its session and its tenant's quotas."""

    request_id: str
    tenant: str
    #: The session's lock key and the value this claim set (None: no session, no lock).
    lock: tuple[str, str] | None = None
    fence: int = 0
    #: Tokens reserved, and when (Redis's ms); 0: the tenant has no limits, nothing reserved.
    reserved: int = 0
    reserved_at: int = 0
    limited: bool = False
    #: The session's stored version, read in the same exchange (``peek``).
    session_version: int | None = None
    lost: bool = False  # the lock was gone at a renewal
    ending: bool = False  # the end is being written (which drops the lock)
    #: Called when this node gives the claim up, cut off from Redis past its lease (the
    #: generation stops: another node may run it by now).
    on_lost: Callable[[str], None] | None = None


class Claims:
    """Claims of this node's running generations, renewed while they run."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self.lease_ms = max(1, int(link.lease_s * 1000))
        self.running: dict[str, Claim] = {}
        #: Loop time of the last renewal Redis took (or of the last period without claims).
        self.renewed_at = 0.0
        #: Cut off from Redis this long, a node gives its claims up: the lease (they expired
        #: in Redis), or a sentinel failover's longest wait (a claim may be taken again after
        #: a failover: :data:`_HOLD`).
        self.cut_off_s = max(link.lease_s, link.ride_s)
        self._lock = script(link, _LOCK)
        self._hold = script(link, _HOLD)
        self._unlock = script(link, _UNLOCK)
        self._reserve = script(link, _RESERVE)
        self._settle = script(link, _SETTLE)
        self._renew_slots = script(link, _RENEW_SLOTS)

    def start(self) -> None:
        self.link.spawn(self._renew_forever(), "cluster-leases")

    async def claim(
        self,
        request_id: str,
        tenant: str,
        session_id: str | None,
        quotas: Quotas,
        tokens: int,
        peek: str | None = None,
    ) -> Claim:
        """Lock the session and reserve the tenant's quotas in one exchange, or refuse
        (``session_busy``, ``quota_exceeded``; ``overloaded`` when Redis does not answer).
        ``peek``: a session's hash, whose ``version`` is read in the same exchange."""
        link = self.link
        await link.ready()
        claim = Claim(request_id, tenant)
        claim.limited = any(
            v is not None
            for v in (quotas.requests_per_minute, quotas.tokens_per_minute, quotas.generations)
        )
        if session_id is None and not claim.limited:
            return claim
        tpm = quotas.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise QuotaExceeded(
                f"the prompt and max_tokens ({tokens} tokens) are over tenant {tenant}'s limit "
                f"of {tpm} tokens per minute; lower max_tokens"
            )
        holder = f"{link.node_id} {request_id}"
        keys = (
            []
            if session_id is None
            else [
                session_key(tenant, session_id, "lock"),
                session_key(tenant, session_id, "fence"),
            ]
        )
        limits = [
            request_id,
            _limit(quotas.requests_per_minute),
            _limit(tpm),
            _limit(quotas.generations),
            tokens,
            self.lease_ms,
        ]

        if keys and peek is not None:
            keys.append(peek)

        def queue(pipe: Pipeline) -> None:
            """Both scripts in one exchange."""
            if keys:
                self._lock.queue(pipe, keys, [holder, self.lease_ms, FENCE_TTL_MS])
            if claim.limited:
                self._reserve.queue(pipe, self._quota_keys(tenant), limits)

        replies = await link.exchange(queue, idempotent=True)
        refusal: Exception | None = None
        if keys:
            fence, held_by, *version = replies.pop(0)
            if fence:
                claim.fence = int(fence)
                claim.lock = (keys[0], f"{holder} {claim.fence}")
                if version and version[0] is not None:
                    claim.session_version = int(version[0])
            else:
                other = held_by.decode().split(" ")
                refusal = SessionBusy(
                    f"request {other[1] if len(other) > 1 else '?'} is still running on this "
                    "session (on another node); cancel it or wait for its done frame"
                )
        if claim.limited:
            what, value = replies.pop(0)
            if what == b"ok":
                claim.reserved, claim.reserved_at = tokens, int(value)
            elif refusal is None:
                refusal = _quota_refusal(tenant, what.decode(), int(value), quotas)
        if refusal is not None:
            await self.release(claim, 0, 0)
            raise refusal
        self.running[request_id] = claim
        return claim

    async def release(self, claim: Claim, prompt_tokens: int, completion_tokens: int) -> None:
        """Give the claim back: unlock the session, settle the tokens. Never raises: a claim
        that cannot be given back expires with its lease."""
        self.running.pop(claim.request_id, None)
        if claim.lock is None and not claim.reserved:
            return

        def queue(pipe: Pipeline) -> None:
            if claim.lock is not None:
                self._unlock.queue(pipe, [claim.lock[0]], [claim.lock[1]])
            if claim.reserved:
                keys = self._quota_keys(claim.tenant)
                settled = [
                    claim.request_id,
                    claim.reserved,
                    prompt_tokens,
                    completion_tokens,
                    claim.reserved_at,
                ]
                self._settle.queue(pipe, [keys[1], keys[2]], settled)

        try:
            await self.link.exchange(queue, idempotent=True)
        except Exception as exc:
            logger.warning(
                "request %s: its claim could not be given back (%s); it expires in %.1f s",
                claim.request_id,
                exc,
                self.link.lease_s,
            )

    @staticmethod
    def _quota_keys(tenant: str) -> list[str]:
        return [tenant_key(tenant, w) for w in ("requests", "tokens", "generations")]

    async def renew(self) -> None:
        """Extend every running claim's lease by one period (one pipelined exchange)."""
        claims = list(self.running.values())
        if not claims:
            self.renewed_at = asyncio.get_running_loop().time()
            return
        locked = [c for c in claims if c.lock is not None]
        by_tenant: dict[str, list[str]] = {}
        for c in claims:
            if c.reserved:
                by_tenant.setdefault(c.tenant, []).append(c.request_id)

        def queue(pipe: Pipeline) -> None:
            for c in locked:
                assert c.lock is not None
                self._hold.queue(pipe, [*_lock_keys(c.lock[0])], [c.lock[1], self.lease_ms, "0"])
            for tenant, ids in by_tenant.items():
                slots = [tenant_key(tenant, "generations")]
                self._renew_slots.queue(pipe, slots, [self.lease_ms, *ids])

        replies = await self.link.exchange(queue)
        self.renewed_at = asyncio.get_running_loop().time()
        for c, kept in zip(locked, replies, strict=False):
            if not kept and not c.lost and not c.ending:
                c.lost = True
                logger.error(
                    "request %s: its session's lock was lost (expired or Redis lost it); "
                    "another node may run this session now",
                    c.request_id,
                )

    async def _renew_forever(self) -> None:
        period = self.link.lease_s / 3
        loop = asyncio.get_running_loop()
        self.renewed_at = loop.time()
        while True:
            await asyncio.sleep(period)
            try:
                await self.renew()
            except Exception as exc:  # Redis down: the link says so; try again next period
                logger.debug("leases not renewed: %s", exc)
                if loop.time() - self.renewed_at > self.cut_off_s:
                    self.give_up()

    def give_up(self) -> None:
        """Cut off from Redis past the lease: every running claim has expired there, and
        another node may have taken its generation over; stop them here (their readers move
        to that node) rather than run on unseen."""
        why = (
            f"this node has not reached Redis for over {self.cut_off_s:g} s (its claim expired "
            "there: another node may run this generation now)"
        )
        for claim in list(self.running.values()):
            # An ending generation whose end is not written yet gives it up too (its readers
            # wait for it); one whose end is written holds nothing any more.
            if claim.on_lost is not None and not claim.lost and claim.lock is not None:
                claim.lost = True
                claim.on_lost(why)

    async def hold(self, lock: tuple[str, str]) -> bool:
        """Whether the claim that set ``lock`` (its key and value) holds it, taken again if
        Redis lost it and no other claim came since (:data:`_HOLD`)."""
        keys, args = [*_lock_keys(lock[0])], [lock[1], self.lease_ms, "1"]
        (held,) = await self.link.exchange(
            lambda pipe: self._hold.queue(pipe, keys, args), idempotent=True
        )
        return bool(held)


def _lock_keys(lock: str) -> tuple[str, str]:
    """A session's lock key, and its fencing counter's."""
    return lock, lock.removesuffix("lock") + "fence"


def _quota_refusal(tenant: str, what: str, wait_ms: int, quotas: Quotas) -> QuotaExceeded:
    if what == "generations":
        return QuotaExceeded(
            f"tenant {tenant} runs {quotas.generations} generations, its limit (across the "
            "cluster); retry when one ends",
            retry_after_s=1.0,
        )
    limit = (
        f"{quotas.requests_per_minute} requests per minute"
        if what == "requests"
        else f"{quotas.tokens_per_minute} tokens per minute"
    )
    return rate_refusal(tenant, f"{limit} (across the cluster)", wait_ms / 1000)
