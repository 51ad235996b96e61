"""What one server holds: its models, sessions and connections, and how it drains."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seedance.config import ConfigError, ServerConfig
from seedance.engines.base import Engine
from seedance.observability.audit import audit_log
from seedance.observability.audit import kinds as audit
from seedance.observability.gpu import open_gpu_memory
from seedance.observability.metrics import Metrics
from seedance.observability.tracing import Tracing
from seedance.protocol.codec import FrameLimits
from seedance.protocol.errors import ModelNotFound, Overloaded, Unauthorized
from seedance.server.admission import Admission
from seedance.server.gauges import state_metrics
from seedance.server.outbound import FrameMerger
from seedance.sessions.store import MemorySessionStore, SessionStore
from seedance.streams.store import MemoryStreamStore, StreamStore
from seedance.tenants.access import Access
from seedance.tenants.usage import Usage

if TYPE_CHECKING:
    from seedance.server.connection import Connection
    from seedance.server.generation import Generation
    from seedance.server.openai_api import HttpCall

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """A model name bound to its engine, admission queue and frame limits."""

    name: str
    engine: Engine
    admission: Admission
    limits: FrameLimits


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
            self.models[info.name] = ServedModel(
                name=info.name,
                engine=engine,
                admission=Admission(
                    max_running=config.max_running or engine.max_concurrency,
                    max_waiting=config.max_waiting,
                ),
                limits=FrameLimits(
                    max_frame_bytes=config.max_frame_bytes,
                    max_tokens=info.max_output_tokens,
                ),
            )
        self.default_model = engines[0].info.name
        self.sessions: SessionStore = sessions or MemorySessionStore(
            ttl_s=config.session_ttl_s,
            max_sessions=config.max_sessions,
            max_bytes=config.max_session_bytes,
        )
        self.streams: StreamStore = MemoryStreamStore(
            window_s=config.resume_window_s, max_bytes_per_tenant=config.resume_max_bytes
        )
        #: Running WebSocket generations by (tenant, session id): one per session at most.
        self.generations: dict[tuple[str, str], Generation] = {}
        self.connections: set[Connection] = set()
        self.http_calls: set[HttpCall] = set()  # OpenAI API requests being answered
        # Merges the token frames of fast streams (None: one frame per token).
        self.merger = (
            FrameMerger(config.merge_window_ms / 1000.0) if config.merge_window_ms > 0 else None
        )
        self.draining = False
        self.hurry = False  # shutting down without waiting for running generations
        self._started = False
        self.metrics = Metrics()
        self.access = Access(config)
        self.usage = Usage()
        self.audit = audit_log(config)
        self.access.on_revoked = self._close_revoked
        self.tracing = tracing or Tracing.from_config(config)
        gpu = open_gpu_memory()
        self.metrics.add_collector(lambda: state_metrics(self, gpu))

    def resolve_model(self, name: str | None) -> ServedModel:
        model = self.models.get(name or self.default_model)
        if model is None:
            served = ", ".join(sorted(self.models))
            raise ModelNotFound(f"model {name!r} is not served here; served models: {served}")
        return model

    def generation_started(self, generation: Generation) -> None:
        session = generation.requester.session
        self.generations[(session.tenant, session.session_id)] = generation
        generation.start()

    def generation_ended(self, generation: Generation, terminal: str) -> None:
        """A generation is over: its log gets its last frame (none after a silent abort)
        and is kept for resumes or dropped."""
        session = generation.requester.session
        key = (session.tenant, session.session_id)
        if self.generations.get(key) is generation:
            del self.generations[key]
        generation.log.close(terminal, time.monotonic())
        self.streams.ended(session.tenant, session.session_id, generation.log)

    @property
    def running_generations(self) -> int:
        return sum(m.admission.running + m.admission.waiting for m in self.models.values())

    def healthy(self) -> tuple[bool, str]:
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
        for model in self.models.values():
            await model.engine.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports what is buffered
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)  # every record accepted, then the seal

    # ------------------------------------------------------------------ audit

    @property
    def audit_required(self) -> bool:
        return self.audit is not None and self.config.audit_required

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
        """Close the connections of credentials that no longer pass (4401)."""
        self.audit_submit(lambda: audit.KeysRevoked(keys=sorted(key_ids)))
        for connection in list(self.connections):
            if connection.principal.credential in key_ids:
                credential = connection.principal.credential
                logger.info("conn %s closed: credential %s revoked", connection.id, credential)
                connection.fail(Unauthorized(f"credential {credential} has been revoked"))

    async def drain(self, timeout_s: float) -> None:
        """Refuse new generations, let running ones finish for ``timeout_s`` (or until
        :attr:`hurry` is set), then end every stream with its final frame and close every
        connection: a WebSocket's generation ends with ``done`` (``cancelled``) and the close
        1001; an OpenAI API request with an ``overloaded`` error (an error event and
        ``[DONE]`` when its stream had begun)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.running_generations and not self.hurry:
            logger.info(
                "draining: waiting up to %.0f s for %d generation(s)",
                timeout_s,
                self.running_generations,
            )
        while self.running_generations and loop.time() < deadline and not self.hurry:  # noqa: ASYNC110 - polls
            await asyncio.sleep(0.05)
        if self.running_generations:
            why = "a second signal" if self.hurry else "drain timeout"
            logger.warning("%s: cancelling %d generation(s)", why, self.running_generations)
        refusal = Overloaded("the server is shutting down; retry on another server")
        for call in list(self.http_calls):
            call.interrupt(refusal)
        connections = list(self.connections)
        await asyncio.gather(*(c.shutdown() for c in connections), return_exceptions=True)
        give_up = loop.time() + 5.0
        while (self.connections or self.http_calls) and loop.time() < give_up:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
