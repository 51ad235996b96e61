"""This node's link to the cluster's Redis: the client, its health, and the key names.

Every short exchange of the node (a request's claim, a session's save, the stream logs' new
entries, the leases' renewals) goes through one :class:`Batch`: what was queued while a pipeline
was in flight goes out as the next one. One round trip, one connection and one parse of the
replies serve everything that happened meanwhile, instead of one of each per request: on a busy
node the client library's own cost per exchange is what the cluster mode costs the most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline, PubSub
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, RedisError

from seedance.cluster.urls import SentinelUrl, is_sentinel, redacted
from seedance.config import ServerConfig
from seedance.eventloop import timeout
from seedance.protocol.errors import Overloaded

logger = logging.getLogger(__name__)

#: A Redis call that takes longer than this fails (and the node counts Redis as down).
TIMEOUT_S: Final = 1.0
#: How often the node checks that Redis answers.
PING_INTERVAL_S: Final = 0.5
#: What a client refused because Redis is down is told to wait.
RETRY_AFTER_S: Final = 1.0
#: Connections to Redis one node opens at most besides the batch's (health pings, script
#: loads, revocations, a follower's lock checks).
MAX_CONNECTIONS: Final = 32
#: Connections that wait for new stream entries (one per followed stream, at most).
MAX_BLOCKING_CONNECTIONS: Final = 256
#: Every key of Seedance starts with this.
PREFIX: Final = "sd:"
#: How long a listener waits before it subscribes again after Redis went away.
RESUBSCRIBE_S: Final = 0.5
#: How long a listener's read waits for a message before it reads again.
LISTEN_POLL_S: Final = 1.0
#: How long new requests wait for a sentinel's failover (being called down, the sentinels'
#: vote, the promotion: 3 to 5 s with a ``down-after-milliseconds`` of 1 s) before they are
#: refused.
RIDE_THROUGH_S: Final = 10.0
#: How long an exchange waits for ``--redis-wait-replicas`` replicas to hold its writes.
WAIT_REPLICAS_MS: Final = 250
#: Under ``--redis-wait-strict`` a ping writes a key of the node's, kept this long, and waits
#: for the replicas to hold it.
PING_KEY_MS: Final = 60_000


class Unreplicated(RedisError):
    """Fewer replicas than ``--redis-wait-replicas`` acknowledged a write, under
    ``--redis-wait-strict``: the node acts as if Redis did not answer."""

    def __init__(self, acked: int, wanted: int) -> None:
        super().__init__(
            f"{acked} of {wanted} replica(s) acknowledged a write within {WAIT_REPLICAS_MS} ms "
            "(--redis-wait-strict)"
        )


def session_key(tenant: str, session_id: str, what: str) -> str:
    """A key of one session: every key of a session hashes to one Redis Cluster slot."""
    return f"{PREFIX}{{s:{tenant}:{session_id}}}:{what}"


def tenant_key(tenant: str, what: str) -> str:
    """A key of one tenant (its quota counters): one slot per tenant."""
    return f"{PREFIX}{{t:{tenant}}}:{what}"


def default_node_id(config: ServerConfig) -> str:
    return f"{socket.gethostname()}:{config.port}-{secrets.token_hex(3)}"


def _client(
    url: str,
    *,
    max_connections: int | None = None,
    timeout: float | None = None,
    packing: type | None = None,
    **options: Any,
) -> aioredis.Redis:
    """A client of the Redis ``url`` names (for a ``sentinel://`` URL: of the primary its
    sentinels name, asked again at each new connection). ``max_connections``: a pool that
    waits ``timeout`` for a free one; ``packing``: a mixin of the connections."""
    pool: aioredis.ConnectionPool
    if is_sentinel(url):
        target = SentinelUrl.parse(url)
        sentinels = Sentinel(  # type: ignore[no-untyped-call]
            list(target.sentinels),
            sentinel_kwargs={
                "password": target.sentinel_password or target.password,
                "socket_timeout": TIMEOUT_S,
                "socket_connect_timeout": TIMEOUT_S,
                # A sentinel that does not answer is passed over for the next one at once:
                # redis-py's own retries (ten, backing off) spent a connection's whole time on
                # a dead first sentinel, and no connection to the primary was ever made.
                "retry": Retry(NoBackoff(), 0),
            },
        )
        kwargs: dict[str, Any] = {
            "db": target.db,
            "username": target.username,
            "password": target.password,
            **options,
        }
        if max_connections is not None:
            kwargs |= {"max_connections": max_connections, "timeout": timeout}
        pool_class: Any = (
            SentinelConnectionPool if max_connections is None else _BlockingSentinelPool
        )
        connection = _packed(SentinelManagedConnection, packing)
        pool = pool_class(target.service, sentinels, connection_class=connection, **kwargs)
    elif max_connections is not None:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **options
        )
    else:
        pool = aioredis.ConnectionPool.from_url(url, **options)
        pool.connection_class = _packed(pool.connection_class, packing)
    return aioredis.Redis(connection_pool=pool)


def _packed(connection: type, packing: type | None) -> type:
    """``connection`` with ``packing`` mixed in (None: as it is)."""
    if packing is None:
        return connection
    return type("Hiredis" + connection.__name__, (packing, connection), {})


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The primary's connections, a bounded pool that waits for a free one."""


class ClusterLink:
    """The Redis client of this node, and whether Redis answers.

    A call that fails marks Redis down at once; a ping every :data:`PING_INTERVAL_S` marks it
    up again. While it is down :meth:`check` refuses new requests with ``overloaded``
    (retryable) instead of letting them wait on a timeout.
    """

    def __init__(self, config: ServerConfig) -> None:
        assert config.cluster.redis_url is not None
        self.url = redacted(config.cluster.redis_url)
        self.node_id = config.cluster.node_id or default_node_id(config)
        self.lease_s = config.cluster.lease_s
        url = config.cluster.redis_url
        sentinel = is_sentinel(url)
        wait = config.cluster.wait_replicas
        #: Replicas every exchange's writes wait for (WAIT), when that many are connected.
        self.wait_replicas = (1 if sentinel else 0) if wait is None else wait
        self.sentinel = sentinel
        #: Whether a write fewer replicas acknowledged counts as a failed exchange.
        self.strict = config.cluster.wait_strict and self.wait_replicas > 0
        #: How long a new request waits for Redis to answer again before it is refused: a
        #: sentinel's failover (a plain Redis gone: refused at once).
        self.ride_s = RIDE_THROUGH_S if sentinel else 0.0
        # A bounded pool that waits for a free connection (the default one refuses).
        self.redis: aioredis.Redis = _client(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=TIMEOUT_S,
            socket_timeout=TIMEOUT_S,
            socket_connect_timeout=TIMEOUT_S,
        )
        # Reads that wait for new entries (XREAD BLOCK) hold a connection each, for up to
        # half a lease: a pool of their own, with a timeout past the wait.
        self.blocking: aioredis.Redis = _client(
            url,
            max_connections=MAX_BLOCKING_CONNECTIONS,
            timeout=TIMEOUT_S,
            socket_timeout=config.cluster.lease_s + TIMEOUT_S,
            socket_connect_timeout=TIMEOUT_S,
        )
        # The batch's connection: no timer per reply (one per exchange covers them all), and
        # commands packed by hiredis.
        self.batched: aioredis.Redis = _client(
            url, socket_timeout=None, socket_connect_timeout=TIMEOUT_S, packing=HiredisPacking
        )
        self.error: str | None = "not connected yet"
        self._down_since = time.monotonic()
        self._up = asyncio.Event()
        #: Replicas connected to the primary at the last ping; and whether the last exchange's
        #: writes reached fewer than ``wait_replicas`` of them (logged once until they do).
        self.replicas = 0
        self.unreplicated = False
        self.scripts: list[Script] = []
        self.batch = Batch(self)
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
        self.spawn(self.batch.run(), "cluster-batch")

    def spawn(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run ``work`` until the link closes (a background task of the cluster mode)."""
        self._tasks = [t for t in self._tasks if not t.done()]
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.append(task)
        return task

    def listen(
        self,
        channel: str,
        received: Callable[[bytes], None],
        subscribed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Hand each message published on ``channel`` to ``received``, until the link closes;
        a subscription lost with Redis is made again (and ``subscribed`` awaited each time it
        is made: what was published while nobody listened is read there)."""
        self.spawn(self._listen_forever(channel, received, subscribed), f"cluster-{channel}")

    async def _listen_forever(
        self,
        channel: str,
        received: Callable[[bytes], None],
        subscribed: Callable[[], Awaitable[None]] | None,
    ) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                if subscribed is not None:
                    await subscribed()
                await _messages(pubsub, received)
            except (RedisError, OSError) as exc:
                logger.debug("%s: subscription lost (%s); subscribing again", channel, exc)
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(RESUBSCRIBE_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for client in (self.redis, self.blocking, self.batched):
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
        await self._disconnect()

    async def _disconnect(self) -> None:
        """Close every connection to Redis (new ones are made as needed: with a sentinel://
        URL, to the server the sentinels name the primary then; a primary cut off from its
        replicas and sentinels still answers, and still calls itself the primary)."""
        for client in (self.redis, self.blocking, self.batched):
            with contextlib.suppress(RedisError, OSError):
                await client.connection_pool.disconnect()

    # ------------------------------------------------------------------ health

    def check(self) -> None:
        """Refuse a new request while Redis does not answer (with a sentinel:// URL: once it
        has not answered for ``ride_s``, the longest a failover may take)."""
        if self.error is not None and not self.riding():
            raise self.unreachable()

    def riding(self) -> bool:
        """Whether Redis went away less than ``ride_s`` ago, when it answered before: a
        failover under way, which new requests wait out (:meth:`ready`)."""
        return self.error is not None and self._ride_left() > 0

    def _ride_left(self) -> float:
        """Seconds left to wait for Redis (0 when it never answered: nothing to fail over)."""
        if self._run_id is None:
            return 0.0
        return self.ride_s - (time.monotonic() - self._down_since)

    async def ready(self) -> None:
        """Return once Redis answers; ``overloaded`` when it does not within what is left of
        ``ride_s`` (at once without a sentinel)."""
        while self.error is not None:
            left = self._ride_left()
            if left <= 0:
                raise self.unreachable()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._up.wait(), left)

    def unreachable(self) -> Overloaded:
        return Overloaded(
            f"the cluster's store (Redis at {self.url}) does not answer ({self.error}); "
            "retry shortly",
            retry_after_s=RETRY_AFTER_S,
        )

    def health(self) -> tuple[bool, str]:
        """Healthy while Redis answers, or while its failover is under way (the node serves
        what it is sent once the sentinels promoted a replica: no reason to send it nothing)."""
        if self.error is None or self.riding():
            return True, ""
        return False, f"Redis at {self.url} does not answer: {self.error}"

    async def exchange(
        self, queue: Callable[[Pipeline], object], *, idempotent: bool = False
    ) -> list[Any]:
        """Send the commands ``queue`` adds to a pipeline with the node's next batch; their
        replies. A failure marks Redis down and raises ``overloaded``; so does an error reply.
        (``queue`` may run twice, when the scripts had to be loaded again.) ``idempotent``:
        commands that may run twice, sent again when a failover (:meth:`riding`) cut the
        exchange short."""
        loaded = False
        while True:
            waiter = _Waiter(queue)
            self.batch.add(waiter)
            replies = await waiter.future
            if isinstance(replies, BaseException):
                if idempotent and self.riding():
                    await self.ready()
                    continue
                raise self.unreachable() from replies
            error = next((r for r in replies if isinstance(r, Exception)), None)
            if error is None:
                return replies
            if isinstance(error, NoScriptError) and not loaded:
                loaded = True  # Redis restarted since the scripts were loaded: the batch loaded
                continue
            if idempotent and isinstance(error, ReadOnlyError | RedisConnectionError):
                self.failed(error)  # a primary turned replica: the next ping finds the new one
                await self.ready()
                continue
            self.failed(error)
            raise self.unreachable() from error

    def failed(self, exc: BaseException) -> None:
        """A Redis exchange failed: Redis counts as down until a ping answers."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.error is None:
            self._down_since = time.monotonic()
            self._up.clear()
            self.replicas = 0  # until a ping counts the (maybe new) primary's
            if self.ride_s:
                logger.error(
                    "cluster: Redis at %s failed (%s); new requests wait up to %.1f s for its "
                    "sentinels' failover",
                    self.url,
                    error,
                    self.ride_s,
                )
            else:
                logger.error(
                    "cluster: Redis at %s failed (%s); refusing new requests", self.url, error
                )
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
            info = await self.redis.info("server", "replication")
            if info.get("role") != "master":  # a sentinel's answer from before its failover
                raise ReadOnlyError(f"Redis at {info.get('tcp_port')} is a replica now")
            if self.strict:  # up only when a write reaches the replicas
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(f"{PREFIX}ping:{self.node_id}", info["run_id"], px=PING_KEY_MS)
                pipe.execute_command("WAIT", self.wait_replicas, WAIT_REPLICAS_MS)
                self.replicated((await pipe.execute())[1], self.wait_replicas)
        except (RedisError, OSError) as exc:
            self.failed(exc)
            if isinstance(exc, Unreplicated) and self.sentinel:
                await self._disconnect()  # the next connections ask the sentinels
            return
        run_id = info["run_id"]
        if self.error is not None and self.error != "not connected yet":
            changed = " (another server: a failover)" if run_id != self._run_id else ""
            logger.info("cluster: Redis at %s answers again%s", self.url, changed)
        if run_id != self._run_id:  # a Redis we have not loaded the scripts into
            await self.load_scripts()
            self._run_id = run_id
        self.replicas = int(info.get("connected_slaves", 0))
        if self.replicas < self.wait_replicas and not self.unreplicated and not self.strict:
            self.unreplicated = True
            logger.warning(
                "cluster: Redis at %s has %d replica(s) connected, fewer than the %d its "
                "writes should wait for; a failover now could lose this node's latest writes",
                self.url,
                self.replicas,
                self.wait_replicas,
            )
        self.error = None
        self._up.set()

    def waits(self) -> int:
        """The replicas the next exchange waits for (0: none); all of them under
        :attr:`strict`, however many are connected (a replica cut off stays listed until
        the primary's ``repl-timeout``)."""
        return self.wait_replicas if self.strict else min(self.wait_replicas, self.replicas)

    def replicated(self, acked: int, wanted: int) -> None:
        """An exchange's writes reached ``acked`` of the ``wanted`` replicas; under
        :attr:`strict`, :class:`Unreplicated` when too few (the exchange fails)."""
        if acked >= self.wait_replicas:
            if self.unreplicated:
                logger.info("cluster: Redis replicas acknowledge writes again")
            self.unreplicated = False
        elif self.strict:
            raise Unreplicated(acked, wanted)
        elif not self.unreplicated:
            self.unreplicated = True
            logger.warning(
                "cluster: %d of %d Redis replica(s) acknowledged a write within %d ms; a "
                "failover now could lose this node's latest writes",
                acked,
                wanted,
                WAIT_REPLICAS_MS,
            )

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            await self._ping()


async def _messages(pubsub: PubSub, received: Callable[[bytes], None]) -> None:
    """Hand each message to ``received`` until the subscription is lost. A read that comes back
    empty long before its time is up is a connection that is gone: redis-py's own blocking
    ``listen()`` spun on such a connection after a network cut healed, never letting the event
    loop run again (the node stopped answering anyone)."""
    while True:
        began = time.monotonic()
        message = await pubsub.get_message(timeout=LISTEN_POLL_S)
        if message is None:
            if time.monotonic() - began < LISTEN_POLL_S / 2:
                raise RedisConnectionError("the subscription's connection reads nothing")
        elif message.get("type") == "message":
            received(message["data"])


class HiredisPacking:
    """A connection that packs commands with hiredis: redis-py's asyncio connections pack them
    in Python (its blocking ones use hiredis), which is most of what a big pipeline costs."""

    def pack_command(self, *args: Any) -> list[bytes]:
        name = args[0]
        if isinstance(name, str) and " " in name:  # "SCRIPT LOAD" and the like
            args = (*name.split(), *args[1:])
        return [hiredis.pack_command(args)]


class Script:
    """A Lua script of the cluster mode, run by its hash (a bare ``EVALSHA``: redis-py's own
    scripts ask ``SCRIPT EXISTS`` first, a round trip per pipeline). The link loads every
    script when Redis first answers, again whenever Redis comes back, and when a reply says one
    is missing (a Redis that restarted in between)."""

    def __init__(self, link: ClusterLink, source: str) -> None:
        self.source = source
        self.sha: str = link.redis.register_script(source).sha
        link.scripts.append(self)

    def queue(self, pipe: Pipeline, keys: list[str], args: list[Any]) -> None:
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


def script(link: ClusterLink, source: str) -> Script:
    return Script(link, source)


class Exchange(Protocol):
    """A part of a batch: queues its commands, then is handed their replies."""

    def queue(self, pipe: Pipeline) -> object:
        """Add commands to ``pipe``."""

    def answered(self, replies: list[Any] | BaseException) -> None:
        """The replies of the commands it queued (errors in place), or what failed the whole
        pipeline."""


class _Waiter:
    """The exchange of a coroutine that awaits its replies (:meth:`ClusterLink.exchange`)."""

    __slots__ = ("future", "queue")

    def __init__(self, queue: Callable[[Pipeline], object]) -> None:
        self.queue = queue
        self.future: asyncio.Future[list[Any] | BaseException] = asyncio.Future()

    def answered(self, replies: list[Any] | BaseException) -> None:
        if not self.future.done():
            self.future.set_result(replies)


class Batch:
    """The node's exchanges with Redis, one pipeline in flight at a time: what was added while
    one was in flight goes out together as the next."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self._parts: list[Exchange] = []
        self._in_flight: list[Exchange] = []
        self._wake = asyncio.Event()
        #: Set once the link closed: what every later exchange is answered with.
        self.closed: RedisConnectionError | None = None

    def add(self, part: Exchange) -> None:
        if self.closed is not None:
            _answer(part, self.closed)
            return
        self._parts.append(part)
        self._wake.set()

    async def run(self) -> None:
        try:
            await self._run()
        finally:  # the link closed: nothing waits for ever
            self.closed = RedisConnectionError("this node's link to Redis is closed")
            parts, self._parts = [*self._in_flight, *self._parts], []
            for part in parts:
                _answer(part, self.closed)

    async def _run(self) -> None:
        link = self.link
        while True:
            await self._wake.wait()
            self._wake.clear()
            parts, self._parts = self._parts, []
            pipe = link.batched.pipeline(transaction=False)
            spans = []
            for part in parts:
                first = len(pipe)
                try:
                    part.queue(pipe)
                except Exception as exc:  # a bug: that part fails, the others go on
                    logger.exception("cluster: an exchange could not be queued")
                    del pipe.command_stack[first:]
                    _answer(part, exc)
                    continue
                spans.append((part, first, len(pipe)))
            replies: list[Any] = []
            self._in_flight = [part for part, _, _ in spans]
            if len(pipe):
                wanted = link.waits()
                if wanted:  # its writes on that many replicas before anyone acts on them
                    pipe.execute_command("WAIT", wanted, WAIT_REPLICAS_MS)
                try:
                    # One timer for the whole exchange (a read it cuts short disconnects).
                    async with timeout(TIMEOUT_S):
                        replies = await pipe.execute(raise_on_error=False)
                    if wanted:
                        acked = replies.pop()
                        link.replicated(acked if isinstance(acked, int) else 0, wanted)
                except Exception as exc:
                    if isinstance(exc, (RedisError, OSError, asyncio.TimeoutError)):
                        link.failed(exc)
                    else:  # a bug: the exchange fails, the batch goes on
                        logger.exception("cluster: an exchange failed")
                    self._in_flight = []
                    for part, _, _ in spans:
                        _answer(part, exc)
                    continue
                if any(isinstance(reply, NoScriptError) for reply in replies):
                    await link.load_scripts()
            self._in_flight = []
            for part, first, end in spans:
                _answer(part, replies[first:end])


def _answer(part: Exchange, replies: list[Any] | BaseException) -> None:
    try:
        part.answered(replies)
    except Exception:
        logger.exception("cluster: the replies of an exchange could not be handled")
