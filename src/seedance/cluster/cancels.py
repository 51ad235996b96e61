"""Cancels across the cluster: a client that reads a generation running on another node (or
another worker of ``--workers N``) cancels it there.

The cancel is published on the channel ``sd:cancel`` (tenant, session, request id); every node
listens, and the one that runs that request cancels it as if its own client had asked. Its
``done`` frame (``cancelled``) then reaches every reader through the stream log, as a reply's
end always does. A cancel published while Redis does not answer is lost (logged): the client
may send it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import msgspec
from redis.exceptions import RedisError

from seedance.cluster.link import PREFIX, ClusterLink

logger = logging.getLogger(__name__)

CHANNEL: Final = PREFIX + "cancel"


class Cancels:
    """Sends this node's cancels of generations elsewhere, and applies the other nodes'
    (``apply``)."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        #: Takes (tenant, session or log key, request id): cancel it if it runs here (set by
        #: the server).
        self.apply: Callable[[str, str, str], object] | None = None

    def start(self) -> None:
        self.link.listen(CHANNEL, self._received)

    def send(self, tenant: str, log_key: str, request_id: str) -> None:
        """Ask the node that runs ``request_id`` to cancel it (in the background)."""
        self.link.spawn(self._send(tenant, log_key, request_id), "cluster-cancel")

    async def _send(self, tenant: str, log_key: str, request_id: str) -> None:
        try:
            await self.link.redis.publish(
                CHANNEL, msgspec.json.encode([tenant, log_key, request_id])
            )
        except (RedisError, OSError) as exc:
            logger.warning("cancel of %s not told to the cluster: %s", request_id, exc)

    def _received(self, data: bytes) -> None:
        try:
            tenant, log_key, request_id = msgspec.json.decode(data, type=tuple[str, str, str])
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("cluster: a cancel that does not parse: %r", data[:200])
            return
        if self.apply is not None:
            self.apply(tenant, log_key, request_id)
