"""The request core without sockets, in the style of httpx's ``MockTransport``: the server's
own parts, built by its own composition root, with a fake clock for the stores and quotas, an
audit gate that keeps its records in a list, and the synthetic engine. Admission and
:class:`~seedance.server.lifecycle.generation.Generation` are driven by calling them, and
what they did is read back from the parts."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from seedance.engines.base import Engine
from seedance.engines.synthetic import SyntheticEngine
from seedance.observability.audit import kinds as audit
from seedance.server.lifecycle.audit import AuditGate, RecordOf
from seedance.server.lifecycle.services import Services
from seedance.server.state import ServerState
from seedance.tenants.auth import Principal
from seedance.tenants.config import Quotas, Tenant
from tests.support.servers import server_config


class FakeClock:
    """``time.monotonic`` as a test sets it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordedAudit(AuditGate):
    """An audit log that writes every record to :attr:`records`; ``down`` makes it one that
    cannot be written (with ``--audit-required``, requests are refused)."""

    def __init__(self) -> None:
        super().__init__(None, required=True)
        self.records: list[audit.AuditRecord] = []
        self.down: str | None = None

    def check(self) -> None:
        if self.down is not None:
            from seedance.protocol.errors import Overloaded

            raise Overloaded(f"the audit log cannot be written ({self.down}); requests are refused")

    def submit(self, record: RecordOf) -> Future[None] | None:
        self.records.append(record())
        return None

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [audit.as_dict(r) for r in self.records if audit.as_dict(r)["kind"] == kind]


def fake_services(
    engines: Sequence[Engine] | None = None, clock: FakeClock | None = None, **fields: Any
) -> tuple[Services, RecordedAudit, FakeClock]:
    """The parts of a server (not started: nothing listens), its audit records, its clock."""
    clock = clock or FakeClock()
    recorded = RecordedAudit()
    fields.setdefault("engine", "synthetic")
    fields.setdefault("merge_window_ms", 0)  # one frame per token: no timer
    config = server_config(**fields)
    state = ServerState(config, engines or [SyntheticEngine()], clock=clock, audit=recorded)
    return state.services, recorded, clock


def principal(name: str = "acme", **quotas: Any) -> Principal:
    """A caller of tenant ``name`` with these quotas (``max_priority`` among the fields)."""
    max_priority = quotas.pop("max_priority", 0)
    tenant = Tenant(name=name, max_priority=max_priority, quotas=Quotas(**quotas))
    return Principal(tenant, f"{name}-key", "user")
