"""A node of a cluster: what ``--redis`` adds to the server, started and stopped with it."""

from __future__ import annotations

from seedance.cluster.claims import Claims
from seedance.cluster.link import ClusterLink
from seedance.cluster.revocations import Revocations
from seedance.cluster.sessions import RedisSessionStore
from seedance.cluster.streams import RedisStreamStore
from seedance.config import ServerConfig


class ClusterNode:
    def __init__(self, config: ServerConfig) -> None:
        self.link = ClusterLink(config)
        self.claims = Claims(self.link)
        self.sessions = RedisSessionStore(self.link, ttl_s=config.session_ttl_s)
        self.revocations = Revocations(self.link)
        self.streams = RedisStreamStore(
            self.link,
            window_s=config.resume_window_s,
            max_bytes_per_tenant=config.resume_max_bytes,
            session_ttl_s=config.session_ttl_s,
        )

    @property
    def node_id(self) -> str:
        return self.link.node_id

    async def start(self) -> None:
        await self.link.start()
        self.claims.start()
        self.streams.start()
        await self.revocations.start()

    async def close(self) -> None:
        await self.link.close()

    def check(self) -> None:
        """Refuse a new request while Redis does not answer (``overloaded``, retryable)."""
        self.link.check()

    def health(self) -> tuple[bool, str]:
        return self.link.health()
