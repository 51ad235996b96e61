"""This node's link to the cluster's Redis: the client, its health, and the key names."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from seedance.config import ServerConfig
from seedance.protocol.errors import Overloaded

logger = logging.getLogger(__name__)

#: A Redis call that takes longer than this fails (and the node counts Redis as down).
TIMEOUT_S: Final = 1.0
#: How often the node checks that Redis answers.
PING_INTERVAL_S: Final = 0.5
#: What a client refused because Redis is down is told to wait.
RETRY_AFTER_S: Final = 1.0
#: Connections to Redis one node opens at most (exchanges are pipelined over them).
MAX_CONNECTIONS: Final = 32
#: Connections that wait for new stream entries (one per followed stream, at most).
MAX_BLOCKING_CONNECTIONS: Final = 256
#: Every key of Seedance starts with this.
PREFIX: Final = "sd:"

T = TypeVar("T")


def session_key(tenant: str, session_id: str, what: str) -> str:
    """A key of one session: every key of a session hashes to one Redis Cluster slot."""
    return f"{PREFIX}{{s:{tenant}:{session_id}}}:{what}"


def tenant_key(tenant: str, what: str) -> str:
    """A key of one tenant (its quota counters): one slot per tenant."""
    return f"{PREFIX}{{t:{tenant}}}:{what}"


def default_node_id(config: ServerConfig) -> str:
    return f"{socket.gethostname()}:{config.port}-{secrets.token_hex(3)}"


def redacted(url: str) -> str:
    """The URL without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return parts._replace(netloc=f"{user}{host}{port}").geturl()


class ClusterLink:
    """The Redis client of this node, and whether Redis answers.

    A call that fails marks Redis down at once; a ping every :data:`PING_INTERVAL_S` marks it
    up again. While it is down :meth:`check` refuses new requests with ``overloaded``
    (retryable) instead of letting them wait on a timeout.
    """

    def __init__(self, config: ServerConfig) -> None:
        assert config.redis_url is not None
        self.url = redacted(config.redis_url)
        self.node_id = config.node_id or default_node_id(config)
        self.lease_s = config.lease_s
        # A bounded pool that waits for a free connection (the default one refuses).
        pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url,
            max_connections=MAX_CONNECTIONS,
            timeout=TIMEOUT_S,
            socket_timeout=TIMEOUT_S,
            socket_connect_timeout=TIMEOUT_S,
        )
        self.redis: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        # Reads that wait for new entries (XREAD BLOCK) hold a connection each, for up to
        # half a lease: a pool of their own, with a timeout past the wait.
        blocking = aioredis.BlockingConnectionPool.from_url(
            config.redis_url,
            max_connections=MAX_BLOCKING_CONNECTIONS,
            timeout=TIMEOUT_S,
            socket_timeout=config.lease_s + TIMEOUT_S,
            socket_connect_timeout=TIMEOUT_S,
        )
        self.blocking: aioredis.Redis = aioredis.Redis(connection_pool=blocking)
        self.error: str | None = "not connected yet"
        self.scripts: list[Script] = []
        self._run_id: str | None = None  # the Redis process the scripts were loaded into
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._ping()
        if self.error is not None:
            logger.error(
                "cluster: Redis at %s does not answer (%s); requests are refused until it does",
                self.url,
                self.error,
            )
        else:
            logger.info("cluster: node %s on Redis at %s", self.node_id, self.url)
        self.spawn(self._watch(), "cluster-health")

    def spawn(self, work: Awaitable[None], name: str) -> None:
        """Run ``work`` until the link closes (a background task of the cluster mode)."""
        self._tasks = [t for t in self._tasks if not t.done()]
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.append(task)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for client in (self.redis, self.blocking):
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
                await client.connection_pool.disconnect()

    # ------------------------------------------------------------------ health

    def check(self) -> None:
        """Refuse a new request while Redis does not answer."""
        if self.error is not None:
            raise self.unreachable()

    def unreachable(self) -> Overloaded:
        return Overloaded(
            f"the cluster's store (Redis at {self.url}) does not answer ({self.error}); "
            "retry shortly",
            retry_after_s=RETRY_AFTER_S,
        )

    def health(self) -> tuple[bool, str]:
        if self.error is None:
            return True, ""
        return False, f"Redis at {self.url} does not answer: {self.error}"

    async def call(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis exchange (``work`` makes it: it may be made twice, when the scripts
        had to be loaded again); a failure marks Redis down and raises ``overloaded``."""
        try:
            try:
                return await work()
            except NoScriptError:  # Redis restarted since the scripts were loaded: again
                await self.load_scripts()
                return await work()
        except (RedisError, OSError) as exc:
            self.failed(exc)
            raise self.unreachable() from exc

    def failed(self, exc: BaseException) -> None:
        """A Redis exchange failed: Redis counts as down until a ping answers."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.error is None:
            logger.error("cluster: Redis at %s failed (%s); refusing new requests", self.url, error)
        self.error = error

    async def load_scripts(self) -> None:
        """Load every script (one exchange)."""
        pipe = self.redis.pipeline(transaction=False)
        for each in self.scripts:
            pipe.script_load(each.source)
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            self.failed(exc)

    async def _ping(self) -> None:
        try:
            run_id = (await self.redis.info("server"))["run_id"]
        except (RedisError, OSError) as exc:
            self.failed(exc)
            return
        if self.error is not None and self.error != "not connected yet":
            logger.info("cluster: Redis at %s answers again", self.url)
        if run_id != self._run_id:  # a Redis we have not loaded the scripts into
            await self.load_scripts()
            self._run_id = run_id
        self.error = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            await self._ping()


class Script:
    """A Lua script of the cluster mode, run by its hash. Queued on a pipeline it goes out as a
    bare ``EVALSHA`` (redis-py's own scripts ask ``SCRIPT EXISTS`` first, a round trip per
    pipeline); the link loads every script when Redis first answers, again whenever Redis
    comes back, and when a reply says one is missing (a Redis that restarted in between)."""

    def __init__(self, link: ClusterLink, source: str) -> None:
        self.source = source
        self._script = link.redis.register_script(source)  # a direct call loads it if missing
        self.sha: str = self._script.sha
        link.scripts.append(self)

    async def __call__(self, keys: list[str], args: list[Any], client: Any = None) -> Any:
        if client is None:
            return await self._script(keys, args)
        client.evalsha(self.sha, len(keys), *keys, *args)
        return None


def script(link: ClusterLink, source: str) -> Script:
    return Script(link, source)
