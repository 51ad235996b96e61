"""What one server holds: its models, sessions and connections, and how it drains."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from seedance.config import ConfigError, ServerConfig
from seedance.engines.base import Engine
from seedance.observability.audit import audit_log
from seedance.observability.audit import kinds as audit
from seedance.observability.gpu import open_gpu_memory
from seedance.observability.metrics import Metrics
from seedance.observability.tracing import Tracing
from seedance.protocol.codec import FrameLimits
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    ModelNotFound,
    Overloaded,
    SeedanceError,
    Unauthorized,
)
from seedance.server.admission import Admission
from seedance.server.confidential import Confidential, load_identity
from seedance.server.gauges import state_metrics
from seedance.server.outbound import FrameMerger
from seedance.sessions.store import MemorySessionStore, SessionStore
from seedance.streams.store import MemoryStreamStore, StreamStore
from seedance.tenants.access import Access
from seedance.tenants.auth import Principal, certificate_of
from seedance.tenants.usage import Usage

if TYPE_CHECKING:
    from seedance.cluster.node import ClusterNode
    from seedance.models.serving import ModelManager
    from seedance.protocol.messages import DoneFrame, ErrorFrame
    from seedance.server.connection import Connection
    from seedance.server.openai_api import HttpCall
    from seedance.server.requests import Generation
    from seedance.sessions.session import Session

logger = logging.getLogger(__name__)

#: On shutdown, idle connections are closed over this long (at most the drain timeout).
DRAIN_STAGGER_S = 2.0
DRAIN_TICK_S = 0.02


def share_of(key: str) -> float:
    """Where ``key`` falls in [0, 1): the same for a key on every node and every run."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(eq=False, slots=True)
class ApiSocket:
    """A long-lived WebSocket of the OpenAI APIs (Realtime, the Responses API's WebSocket
    mode): who opened it, and how to shut it out when its credential stops passing (the
    endpoint's error event, close 4401)."""

    name: str  # for the log
    principal: Principal
    scope: Mapping[str, Any]
    shut_out: Callable[[SeedanceError], None]


@dataclass(frozen=True)
class ServedModel:
    """A model name bound to its engine, admission queue and frame limits (and, from a
    registry, its version and the hash of its signed manifest)."""

    name: str
    engine: Engine
    admission: Admission
    limits: FrameLimits
    version: str = ""
    manifest_sha256: str = ""

    @classmethod
    def of(
        cls, config: ServerConfig, engine: Engine, version: str = "", manifest: str = ""
    ) -> ServedModel:
        info = engine.info
        return cls(
            name=info.name,
            engine=engine,
            admission=Admission(
                max_running=config.max_running or engine.max_concurrency,
                max_waiting=config.max_waiting,
            ),
            limits=FrameLimits(
                max_frame_bytes=config.max_frame_bytes, max_tokens=info.max_output_tokens
            ),
            version=version,
            manifest_sha256=manifest,
        )


class ServerState:
    def __init__(
        self,
        config: ServerConfig,
        engines: Sequence[Engine],
        sessions: SessionStore | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        if not engines:
            raise ConfigError("no engine to serve")
        self.config = config
        self.models: dict[str, ServedModel] = {}
        for engine in engines:
            info = engine.info
            if info.name in self.models:
                raise ConfigError(f"two engines serve the model name {info.name!r}")
            self.models[info.name] = ServedModel.of(config, engine)
        self.default_model = engines[0].info.name
        #: The cluster mode (``--redis``): None keeps everything in this process.
        identity = load_identity(config)  # --e2e-key: end-to-end, and the key at rest
        self.cluster: ClusterNode | None = None
        if config.redis_url is not None:
            from seedance.cluster.node import ClusterNode
            from seedance.cluster.takeover import take_over

            self.cluster = ClusterNode(config, identity)
            self.cluster.revocations.apply = self._revoked_elsewhere
            self.cluster.streams.take_over = functools.partial(take_over, self)
        self.sessions: SessionStore = sessions or (
            self.cluster.sessions
            if self.cluster is not None
            else MemorySessionStore(
                ttl_s=config.session_ttl_s,
                max_sessions=config.max_sessions,
                max_bytes=config.max_session_bytes,
            )
        )
        self.streams: StreamStore = (
            self.cluster.streams
            if self.cluster is not None
            else MemoryStreamStore(
                window_s=config.resume_window_s, max_bytes_per_tenant=config.resume_max_bytes
            )
        )
        #: Running generations by request id.
        self.generations: dict[str, Generation] = {}
        self.connections: set[Connection] = set()
        #: The OpenAI APIs' WebSockets, for revocations (they are not /v2/infer connections).
        self.api_sockets: set[ApiSocket] = set()
        self.http_calls: set[HttpCall] = set()  # OpenAI API requests being answered
        # Merges the token frames of fast streams (None: one frame per token).
        self.merger = (
            FrameMerger(config.merge_window_ms / 1000.0) if config.merge_window_ms > 0 else None
        )
        if self.cluster is not None:  # the stream logs go to Redis at the frames' pace
            self.cluster.streams.replicator.merger = self.merger
        #: The registry a model is served from (``--model-registry``), and its reloads.
        self.model_manager: ModelManager | None = None
        #: Canary versions by model name, with the share of sessions they take.
        self.canaries: dict[str, tuple[ServedModel, float]] = {}
        self.draining = False
        self.hurry = False  # shutting down without waiting for running generations
        self._started = False
        self.metrics = Metrics()
        self.access = Access(config)
        self.usage = Usage(shared=self.cluster is not None)
        self.audit = audit_log(config)
        #: End-to-end encryption of streams (``--e2e-key``; None: not offered).
        self.confidential: Confidential | None = None
        if identity is not None:
            self.confidential = Confidential(
                config, identity, self._served_versions, self.audit_submit, self.metrics
            )
        self.access.on_revoked = self._close_revoked
        self.access.on_subjects_dropped = self._close_dropped_subjects
        self.tracing = tracing or Tracing.from_config(config)
        gpu = open_gpu_memory()
        self.metrics.add_collector(lambda: state_metrics(self, gpu))

    def _served_versions(self) -> list[ServedModel]:
        """Every model version serving now: the stable ones and the canaries."""
        return [*self.models.values(), *(canary for canary, _ in self.canaries.values())]

    def resolve_model(self, name: str | None, sticky: str | None = None) -> ServedModel:
        """The served model ``name`` (None: the default); with a canary of it (a registry's),
        the canary for the share of ``sticky`` keys (a session id) it takes."""
        model = self.models.get(name or self.default_model)
        if model is None:
            served = ", ".join(sorted(self.models))
            raise ModelNotFound(f"model {name!r} is not served here; served models: {served}")
        canary = self.canaries.get(model.name)
        if canary is not None and sticky is not None and share_of(sticky) < canary[1]:
            return canary[0]
        return model

    def count_refusal(self, model: ServedModel, tenant: str, code: str) -> None:
        """A request refused before its generation started, in ``seedance_requests``."""
        self.metrics.requests.labels(model.name, model.engine.info.engine, tenant, code).inc()

    def generation_started(self, generation: Generation) -> None:
        self.generations[generation.request_id] = generation
        generation.start()

    def generation_ended(self, generation: Generation, end: DoneFrame | ErrorFrame | None) -> None:
        """A generation is over: its log gets its last frame (none after a silent abort)
        and is kept for resumes or dropped."""
        if self.generations.get(generation.request_id) is generation:
            del self.generations[generation.request_id]
        requester = generation.requester
        if end is None and getattr(generation.log, "lost", False):
            # Another node runs it now: its readers here reconnect and resume there.
            for connection in list(self.connections):
                follower = connection._follower
                if follower is not None and follower.log is generation.log:
                    connection.close(CLOSE_GOING_AWAY, "the stream moved to another node")
        generation.log.close(end, time.monotonic())
        key = requester.log_key(generation.request_id)
        self.streams.ended(requester.tenant, key, generation.log)

    def running_on(self, session: Session) -> Generation | None:
        """The generation running on ``session`` (started on any connection)."""
        request_id = session.active_request
        return self.generations.get(request_id) if request_id is not None else None

    @property
    def running_generations(self) -> int:
        return sum(m.admission.running + m.admission.waiting for m in self.models.values())

    def healthy(self) -> tuple[bool, str]:
        if self.cluster is not None:
            ok, detail = self.cluster.health()
            if not ok:
                return False, detail
        if self.audit is not None:
            ok, detail = self.audit.health()
            if not ok:
                return False, detail
        for model in self.models.values():
            health = model.engine.health()
            if not health.ok:
                return False, f"{model.name}: {health.detail or 'unhealthy'}"
        return True, ""

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.audit is not None:
            self.audit.start()
            if self.audit.error is not None and self.config.audit_required:
                logger.error("requests are refused until the audit log can be written")
        if self.cluster is not None:
            await self.cluster.start()
        for model in self.models.values():
            await model.engine.start()
        await self.sessions.start()
        await self.access.start()
        if self.merger is not None:
            self.merger.start()

    async def close(self) -> None:
        if not self._started:
            return
        self._started = False
        if self.merger is not None:
            self.merger.stop()
        await self.drain(0)
        await self.access.close()
        await self.sessions.close()
        if self.cluster is not None:
            await self.cluster.close()
        for model in self.models.values():
            await model.engine.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports what is buffered
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)  # every record accepted, then the seal

    # ------------------------------------------------------------------ audit

    @property
    def audit_required(self) -> bool:
        return self.audit is not None and self.config.audit_required

    def check_cluster(self) -> None:
        """Refuse a new request while the cluster's Redis does not answer (cluster mode)."""
        if self.cluster is not None:
            self.cluster.check()

    def check_audit(self) -> None:
        """Refuse a new request while the audit log cannot be written (when required)."""
        if self.audit is not None and self.audit.error is not None and self.audit_required:
            raise Overloaded(
                f"the audit log cannot be written ({self.audit.error}); requests are refused "
                "until it can"
            )

    def audit_submit(self, record: Callable[[], audit.AuditRecord]) -> Future[None] | None:
        """Queue the record ``record()`` builds (built only when there is a log); a future
        that completes once it is on disk (``--audit-fsync record``), else None."""
        if self.audit is None:
            return None
        return self.audit.submit(record())

    async def audit_wait(self, future: Future[None] | None, what: str) -> None:
        """Wait until a submitted record is on disk; ``overloaded`` when it could not be
        written and the log is required (``what`` names what was not audited)."""
        if future is None:
            return
        try:
            await asyncio.wrap_future(future)
        except OSError as exc:
            if self.audit_required:
                raise Overloaded(f"{what} could not be audited: {exc}") from exc

    async def audited(self, record: Callable[[], audit.AuditRecord], what: str) -> None:
        """Write a record and wait until it is on disk (see :meth:`audit_wait`)."""
        await self.audit_wait(self.audit_submit(record), what)

    def _close_revoked(self, key_ids: set[str]) -> None:
        """Credentials that no longer pass: audited, told to the cluster, and their
        connections closed (4401)."""
        self.audit_submit(lambda: audit.KeysRevoked(keys=sorted(key_ids)))
        if self.cluster is not None:
            self.cluster.revocations.announce(key_ids)
        self._close_connections_of(key_ids)

    def _revoked_elsewhere(self, key_ids: set[str]) -> None:
        """Another node revoked these keys: refuse them here too."""
        passing = self.access.revoke_elsewhere(key_ids)
        if passing:
            logger.info("keys %s revoked on another node", ", ".join(sorted(passing)))
            self._close_connections_of(passing)

    def _close_connections_of(self, key_ids: set[str]) -> None:
        """Keys that stopped passing: the sockets they opened are closed."""
        self._shut_out(
            lambda principal, _: (
                f"credential {principal.credential} has been revoked"
                if principal.credential in key_ids
                else None
            )
        )

    def _close_dropped_subjects(self, subjects: set[str]) -> None:
        """Client certificate subjects a reload took from their tenant: audited, and the
        connections they opened closed, as a revoked key's are."""
        self.audit_submit(lambda: audit.SubjectsDropped(subjects=sorted(subjects)))

        def reason(principal: Principal, scope: Mapping[str, Any]) -> str | None:
            if not principal.credential.startswith("cert:"):
                return None  # a credential counts before a certificate
            certificate = certificate_of(scope)
            if certificate is None or certificate.subject not in subjects:
                return None
            return (
                f"the client certificate {certificate.subject[:200]} no longer stands for "
                f"tenant {principal.name}"
            )

        self._shut_out(reason)

    def _shut_out(self, reason: Callable[[Principal, Mapping[str, Any]], str | None]) -> None:
        """Close every WebSocket whose caller stopped passing (``unauthorized``, 4401):
        ``reason`` says why, None for one that still passes."""
        for connection in list(self.connections):
            why = reason(connection.principal, connection.ws.scope)
            if why is not None:
                logger.info("conn %s closed: %s", connection.id, why)
                connection.fail(Unauthorized(why))
        for socket in list(self.api_sockets):
            why = reason(socket.principal, socket.scope)
            if why is not None:
                logger.info("%s closed: %s", socket.name, why)
                socket.shut_out(Unauthorized(why))

    async def _close_idle(self, spread_s: float) -> None:
        """Close (1001) the connections that read no stream, spread over ``spread_s``; in a
        cluster also those that read a resumable one: their clients resume it on another
        node, which follows it from Redis while this node finishes it."""
        cluster = self.cluster is not None
        idle = [c for c in self.connections if c.idle or (cluster and c.movable)]
        if not idle:
            return
        batches = min(len(idle), max(1, int(spread_s / DRAIN_TICK_S)))
        per_batch = -(-len(idle) // batches)  # ceil
        for start in range(0, len(idle), per_batch):
            for connection in idle[start : start + per_batch]:
                if connection.idle or (cluster and connection.movable):
                    connection.close(CLOSE_GOING_AWAY, "server shutting down")
            await asyncio.sleep(spread_s / batches)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new generations; close the connections that read no stream (1001), spread
        over a few seconds; let running generations (resumable ones without a reader too)
        finish for ``timeout_s`` (or until :attr:`hurry` is set), then end every stream with
        its final frame (in a cluster, a resumable one is handed over instead: its lock is
        released unfinished, and another node takes it over) and close every connection: a
        WebSocket's generation ends with ``done`` (``cancelled``) and the close 1001; an
        OpenAI API request with an ``overloaded`` error (an error event and ``[DONE]`` when
        its stream had begun)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.running_generations and not self.hurry:
            logger.info(
                "draining: waiting up to %.0f s for %d generation(s)",
                timeout_s,
                self.running_generations,
            )
        # Connections with nothing running go first, spread out, so that their clients do not
        # all come back at once to the servers that remain.
        idle = asyncio.create_task(self._close_idle(min(DRAIN_STAGGER_S, timeout_s)))
        while self.running_generations and loop.time() < deadline and not self.hurry:  # noqa: ASYNC110 - polls
            await asyncio.sleep(0.05)
        idle.cancel()
        await asyncio.gather(idle, return_exceptions=True)
        if self.running_generations:
            why = "a second signal" if self.hurry else "drain timeout"
            logger.warning("%s: cancelling %d generation(s)", why, self.running_generations)
        for generation in list(self.generations.values()):
            if self.cluster is not None and generation.log.resumable:
                generation.hand_off()  # another node takes it over where it stopped
            else:
                generation.cancel(silent=False)  # its readers get its done (HTTP: overloaded)
        connections = list(self.connections)
        await asyncio.gather(*(c.shutdown() for c in connections), return_exceptions=True)
        give_up = loop.time() + 5.0
        while (self.connections or self.http_calls) and loop.time() < give_up:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
