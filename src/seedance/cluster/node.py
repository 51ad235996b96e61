"""A node of a cluster: what ``--redis`` adds to the server, started and stopped with it."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedance.cluster.asks import Asks
from seedance.cluster.atrest import AtRest
from seedance.cluster.cancels import Cancels
from seedance.cluster.claims import Claims
from seedance.cluster.connections import Connections
from seedance.cluster.link import PREFIX, ClusterLink
from seedance.cluster.revocations import Revocations
from seedance.cluster.sessions import RedisSessionStore
from seedance.cluster.streams import RedisStreamStore
from seedance.config import ServerConfig


class ClusterNode:
    def __init__(self, config: ServerConfig, identity: Ed25519PrivateKey | None = None) -> None:
        """``identity``: the server's (``--e2e-key``), which ``--encrypt-at-rest`` needs."""
        self.link = ClusterLink(config)
        self.claims = Claims(self.link)
        at_rest = None
        if config.cluster.encrypt_at_rest and identity is not None:
            at_rest = AtRest.from_identity(identity)
        self.sessions = RedisSessionStore(self.link, ttl_s=config.session_ttl_s, at_rest=at_rest)
        self.revocations = Revocations(self.link)
        self.cancels = Cancels(self.link)
        self.connections = Connections(self.link)
        self.asks = Asks(self.link)
        self.streams = RedisStreamStore(
            self.link,
            window_s=config.resume.window_s,
            max_bytes_per_tenant=config.resume.max_bytes,
            session_ttl_s=config.session_ttl_s,
            at_rest=at_rest,
            claims=self.claims,
        )

    @property
    def node_id(self) -> str:
        return self.link.node_id

    async def start(self) -> None:
        await self.link.start()
        self.claims.start()
        self.streams.start()
        await self.revocations.start()
        self.cancels.start()
        self.connections.start()
        self.asks.start()

    async def close(self) -> None:
        await self.link.close()

    async def first_use(self, name: str, until: float) -> bool:
        """Whether no node took ``name`` before (kept until ``until``, a Unix time): a relay
        token, taken once by whichever node or worker it reaches. ``overloaded`` while Redis
        does not answer."""
        self.link.check()
        ms = int(until * 1000)
        (fresh,) = await self.link.exchange(
            lambda pipe: pipe.set(PREFIX + name, 1, nx=True, pxat=ms)
        )
        return bool(fresh)

    def check(self) -> None:
        """Refuse a new request while Redis does not answer (``overloaded``, retryable)."""
        self.link.check()

    def health(self) -> tuple[bool, str]:
        return self.link.health()
