"""The composition root: one server's parts, built and wired here and nowhere else.

Each part does its own work (see :mod:`seedance.server.lifecycle` and its modules); this
module only builds them in the order they need each other, hands the APIs the
:class:`~seedance.server.lifecycle.services.Services` they use, connects the parts that call
each other back (revocations, takeovers, the frame merger's pace), and starts and stops them in
order.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from seedance.config import ServerConfig
from seedance.engines.base import Engine
from seedance.observability.audit import audit_log
from seedance.observability.gpu import open_gpu_memory
from seedance.observability.metrics import Metrics
from seedance.observability.tracing import Tracing
from seedance.server.confidential import Confidential, load_identity
from seedance.server.gauges import state_metrics
from seedance.server.lifecycle.audit import AuditGate
from seedance.server.lifecycle.drain import Shutdown
from seedance.server.lifecycle.generations import Generations
from seedance.server.lifecycle.models import ModelTable
from seedance.server.lifecycle.peers import Peers
from seedance.server.lifecycle.refusals import Refusals
from seedance.server.lifecycle.revocations import Revocations
from seedance.server.lifecycle.services import Services
from seedance.server.lifecycle.takeover import take_over
from seedance.server.outbound import FrameMerger
from seedance.sessions.store import MemorySessionStore, SessionStore
from seedance.streams.store import MemoryStreamStore, StreamStore
from seedance.tenants.access import Access
from seedance.tenants.usage import Usage

if TYPE_CHECKING:
    from seedance.cluster.node import ClusterNode
    from seedance.models.serving import ModelManager
    from seedance.server.modules import ModuleTable


class ServerState:
    """One server: its parts (:attr:`services`), started and stopped with it."""

    def __init__(
        self,
        config: ServerConfig,
        engines: Sequence[Engine],
        sessions: SessionStore | None = None,
        tracing: Tracing | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        audit: AuditGate | None = None,
    ) -> None:
        """``clock`` is the stores' and the quotas' (tests pass a fake one), ``audit`` an
        audit gate of the caller's (default: the log the config names)."""
        self.config = config
        self.models = ModelTable(config, engines)
        identity = load_identity(config)  # --e2e-key: end-to-end, and the key at rest
        self.cluster: ClusterNode | None = None
        if config.cluster.redis_url is not None:
            from seedance.cluster.node import ClusterNode

            self.cluster = ClusterNode(config, identity)
        cluster = self.cluster
        self.sessions: SessionStore = sessions or (
            cluster.sessions
            if cluster is not None
            else MemorySessionStore(
                ttl_s=config.session_ttl_s,
                max_sessions=config.max_sessions,
                max_bytes=config.max_session_bytes,
                clock=clock,
            )
        )
        self.streams: StreamStore = (
            cluster.streams
            if cluster is not None
            else MemoryStreamStore(
                window_s=config.resume.window_s,
                max_bytes_per_tenant=config.resume.max_bytes,
                clock=clock,
            )
        )
        self.merger = (
            FrameMerger(config.merge_window_ms / 1000.0) if config.merge_window_ms > 0 else None
        )
        self.metrics = Metrics()
        self.tracing = tracing or Tracing.from_config(config.tracing)
        self.audit = audit or AuditGate(
            audit_log(config.audit, shared=config.worker is not None),
            required=config.audit.required,
        )
        self.generations = Generations(self.streams)
        self.peers = Peers()
        self.access = Access(config)
        self.shutdown = Shutdown(
            self.models,
            self.generations,
            self.peers,
            # Readers move to other nodes on a stop; workers alone on a private Redis have none.
            clustered=cluster is not None
            and not (config.worker is not None and config.worker.private_redis),
        )
        self.confidential: Confidential | None = None
        if identity is not None:
            self.confidential = Confidential(
                config, identity, self.models.versions, self.audit.submit, self.metrics
            )
        self.modules: ModuleTable | None = None
        if config.modules.path is not None:
            from seedance.server.modules import load_modules

            self.modules = load_modules(config, self.metrics)
            self.modules.audit = self.audit.submit
        self.services = Services(
            config=config,
            models=self.models,
            sessions=self.sessions,
            streams=self.streams,
            generations=self.generations,
            peers=self.peers,
            access=self.access,
            usage=Usage(clock, shared=cluster is not None),
            audit=self.audit,
            refusals=Refusals(self.metrics, self.audit, self.tracing),
            tracing=self.tracing,
            metrics=self.metrics,
            shutdown=self.shutdown,
            merger=self.merger,
            cluster=cluster,
            confidential=self.confidential,
            modules=self.modules,
        )
        self._wire(cluster)
        #: The registry a model is served from (``--model-registry``), and its reloads.
        self.model_manager: ModelManager | None = None
        #: How a browser reaches /v2/infer over WebTransport: {"offered", "path", "port",
        #: "certificate_sha256"}
        #: (None: not served; set when the HTTP/3 listener starts).
        self.webtransport: dict[str, Any] | None = None
        self._started = False

    def _wire(self, cluster: ClusterNode | None) -> None:
        """The parts that call each other back."""
        revocations = Revocations(
            self.access, self.peers, self.audit, cluster.revocations if cluster else None
        )
        self.access.on_revoked = revocations.revoked
        self.access.on_subjects_dropped = revocations.subjects_dropped
        if cluster is not None:
            cluster.revocations.apply = revocations.revoked_elsewhere
            cluster.cancels.apply = self.generations.cancel_here
            self.generations.elsewhere = cluster.cancels.send
            cluster.streams.take_over = functools.partial(take_over, self.services)
            cluster.streams.replicator.merger = self.merger  # logs go at the frames' pace
        gpu = open_gpu_memory()
        self.metrics.add_collector(lambda: state_metrics(self.services, gpu))

    @property
    def draining(self) -> bool:
        return self.shutdown.draining

    def healthy(self) -> tuple[bool, str]:
        """Whether this server can serve: its cluster store, its audit log, its engines."""
        checks = [self.cluster.health()] if self.cluster is not None else []
        checks.append(self.audit.health())
        for model in self.models.values():
            health = model.engine.health()
            checks.append((health.ok, f"{model.name}: {health.detail or 'unhealthy'}"))
        return next(((ok, why) for ok, why in checks if not ok), (True, ""))

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.audit.start()
        if self.cluster is not None:
            await self.cluster.start()
        for model in self.models.values():
            await model.engine.start()
        await self.sessions.start()
        await self.access.start()
        if self.merger is not None:
            self.merger.start()
        if self.modules is not None:
            self.modules.start()

    async def drain(self, timeout_s: float) -> None:
        """See :meth:`~seedance.server.lifecycle.drain.Shutdown.drain`."""
        await self.shutdown.drain(timeout_s)

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
        if self.modules is not None:
            await self.modules.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports what is buffered
        await self.audit.close()
