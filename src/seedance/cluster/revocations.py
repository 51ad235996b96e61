"""Key revocations across the cluster: a key revoked on one node is refused on every node.

A revocation is added to a Redis set (``sd:revoked``, kept: a node that starts later, or whose
tenants file still lists the key as valid, refuses it too) and published on the channel of the
same name; every node listens, refuses the key from then on and closes the connections that
hold it (4401). A node that lost its subscription reads the set again when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Final

from redis.exceptions import RedisError

from seedance.cluster.link import PREFIX, RESUBSCRIBE_S, ClusterLink

logger = logging.getLogger(__name__)

CHANNEL: Final = PREFIX + "revoked"
#: The longest a node holds its own closes for a revocation while Redis is told.
ANNOUNCED_S: Final = 0.5


class Revocations:
    """Publishes this node's revocations and applies the other nodes' (``apply``)."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        #: Takes key ids revoked elsewhere (set by the server: refuse them, close their
        #: connections).
        self.apply: Callable[[set[str]], None] | None = None
        self._sent: set[str] = set()

    async def start(self) -> None:
        """Refuse what was revoked before this node started, then listen."""
        try:
            await self._catch_up()
        except (RedisError, OSError) as exc:  # the listener catches up once Redis answers
            logger.warning("revocations not read from Redis at start: %s", exc)
        # Each time it subscribes, it reads what was revoked while it did not listen.
        self.link.listen(CHANNEL, lambda key_id: self._received({key_id.decode()}), self._catch_up)

    async def _catch_up(self) -> None:
        known = await self.link.redis.smembers(CHANNEL)
        self._received({k.decode() if isinstance(k, bytes) else k for k in known})

    def announce(self, key_ids: Iterable[str], then: Callable[[], None]) -> None:
        """Tell every node (in the background; a failure is logged, and retried once Redis
        answers again), and call ``then`` once Redis took it (at most ANNOUNCED_S later): what
        this node closes for the revocation closes after the other nodes were told, so a
        client that reconnects at once meets the refusal on any of them."""
        fresh = set(key_ids) - self._sent
        if not fresh:
            then()
            return
        self._sent |= fresh
        told = self.link.spawn(self._announce(fresh), "cluster-revoke")
        self.link.spawn(self._then(told, then), "cluster-revoked")

    @staticmethod
    async def _then(told: asyncio.Task[None], then: Callable[[], None]) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(told), ANNOUNCED_S)
        then()

    async def _announce(self, key_ids: set[str]) -> None:
        while True:
            try:
                pipe = self.link.redis.pipeline(transaction=False)
                pipe.sadd(CHANNEL, *sorted(key_ids))
                for key_id in sorted(key_ids):
                    pipe.publish(CHANNEL, key_id)
                await pipe.execute()
                return
            except (RedisError, OSError) as exc:
                logger.warning("revocation of %s not yet told to the cluster: %s", key_ids, exc)
                await asyncio.sleep(RESUBSCRIBE_S)

    def _received(self, key_ids: set[str]) -> None:
        if key_ids and self.apply is not None:
            self.apply(key_ids)
