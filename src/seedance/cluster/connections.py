"""A tenant's open connections counted across the cluster, for its ``connections`` quota.

Each connection of a tenant with that quota is a member of a sorted set by expiry
(``sd:{t:TENANT}:connections``; the member is the node, its process and a number). One script
sweeps the expired members, counts the rest and adds the new one only under the limit, so N
nodes (or workers) never hold more than the limit between them. The node renews its members'
expiry while their connections are open, and removes each when it closes; a node that dies
leaves its members to expire within :data:`LEASE_MS`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from typing import TYPE_CHECKING, Final

from seedance.cluster.link import ClusterLink, script, tenant_key
from seedance.tenants.usage import connections_refused

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

logger = logging.getLogger(__name__)

#: How long a connection stays counted without its node renewing it.
LEASE_MS: Final = 30_000
#: How often a node renews its connections.
RENEW_S: Final = 10.0

# KEYS: the tenant's connections. ARGV: member, limit, lease (ms). 1: counted; 0: at the limit.
_OPEN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: the tenant's connections. ARGV: lease (ms), then members: still open.
_RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


class Connections:
    """This node's side of the tenants' connection counts."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self._open = script(link, _OPEN)
        self._renew = script(link, _RENEW)
        # The node's name, and this process's own mark: the workers of a node share its name.
        self._members = f"{link.node_id}:{secrets.token_hex(3)}"
        self._numbers = itertools.count()
        self._held: dict[str, str] = {}  # member -> tenant

    def start(self) -> None:
        self.link.spawn(self._renew_forever(), "cluster-connections")

    async def open(self, tenant: str, limit: int) -> str:
        """Count a connection of ``tenant`` (``quota_exceeded`` at ``limit``, ``overloaded``
        while Redis does not answer); the member to :meth:`close` it with."""
        self.link.check()
        member = f"{self._members}:{next(self._numbers)}"
        key = tenant_key(tenant, "connections")
        (counted,) = await self.link.exchange(
            lambda pipe: self._open.queue(pipe, [key], [member, limit, LEASE_MS])
        )
        if not counted:
            raise connections_refused(tenant, limit)
        self._held[member] = tenant
        return member

    def close(self, member: str) -> None:
        """The connection closed: it no longer counts (in the background)."""
        tenant = self._held.pop(member, None)
        if tenant is not None:
            key = tenant_key(tenant, "connections")
            self.link.spawn(self._remove(key, member), "cluster-connection-closed")

    async def _remove(self, key: str, member: str) -> None:
        try:
            await self.link.exchange(lambda pipe: pipe.zrem(key, member))
        except Exception as exc:  # Redis down: the member expires within the lease
            logger.debug("connection %s not removed from %s: %s", member, key, exc)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            by_tenant: dict[str, list[str]] = {}
            for member, tenant in self._held.items():
                by_tenant.setdefault(tenant, []).append(member)
            if not by_tenant:
                continue

            def queue(pipe: Pipeline, by_tenant: dict[str, list[str]] = by_tenant) -> None:
                for tenant, members in by_tenant.items():
                    key = tenant_key(tenant, "connections")
                    self._renew.queue(pipe, [key], [LEASE_MS, *members])

            try:
                await self.link.exchange(queue)
            except Exception as exc:  # Redis down: the link says so; next period
                logger.debug("connections not renewed: %s", exc)
