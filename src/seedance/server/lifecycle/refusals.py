"""What every API reports of a call it does not admit: one reporter for all of them.

A call (a WebSocket connection, a ``generate`` frame, an HTTP request, a Realtime
``response.create`` ...) is an :class:`Arrival` from the moment it is read: its request span
opens then, parented by the client's ``traceparent``. It ends one of three ways. Admitted, its
span passes to its :class:`~seedance.server.lifecycle.generation.Generation`, which reports the
rest. Refused (:meth:`Refusals.refuse`): a ``refused`` audit record, the same log line, the
``seedance_refused_total`` counter (and ``seedance_requests_total`` under the error code when a
request of a known model was refused), and the span closed with the error, whichever API it
came through. Answered without a generation (``GET /v1/responses/{id}``, say:
:meth:`Refusals.answered`): a ``request`` record with what was done, and the same line.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from msgspec import UNSET

from seedance.observability.audit import kinds as audit
from seedance.observability.tracing import Attributes, ConnectionTrace, RequestTrace, Tracing
from seedance.protocol.messages import ms
from seedance.tenants.auth import Principal, peer_of
from seedance.tenants.cedar import Denied

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from seedance.observability.metrics import Metrics
    from seedance.protocol.errors import SeedanceError
    from seedance.server.lifecycle.audit import AuditGate
    from seedance.server.lifecycle.models import ServedModel

logger = logging.getLogger(__name__)

Api = Literal["websocket", "http"]


class _Parent(enum.Enum):
    FROM_HEADERS = "the traceparent header of the call's scope"


#: :meth:`Refusals.arrive`'s default parent span (a socket that parsed its handshake's header
#: once passes what it found, None included).
FROM_HEADERS: Final = _Parent.FROM_HEADERS


@dataclass(slots=True)
class Arrival:
    """A call as it was read, before it is admitted or refused: what its report names."""

    api: Api
    path: str
    peer: str
    operation: str
    received: float  # time.monotonic()
    trace: RequestTrace
    request_id: str | None = None
    principal: Principal | None = None
    model: ServedModel | None = None
    connection_id: str | None = None
    session_id: str | None = None
    #: The request's sampling settings, for its span (set once its body is read).
    attributes: dict[str, Any] = field(default_factory=dict)
    #: The access policies that allowed it (``--policy``; None: the tenants table's rules).
    policies: tuple[str, ...] | None = None

    @property
    def tenant(self) -> str | None:
        return self.principal.name if self.principal is not None else None


class Refusals:
    """The one reporter of calls that were not admitted (see the module)."""

    def __init__(self, metrics: Metrics, audit_gate: AuditGate, tracing: Tracing) -> None:
        self.metrics = metrics
        self.audit = audit_gate
        self.tracing = tracing

    def arrive(
        self,
        api: Api,
        scope: Mapping[str, Any],
        operation: str,
        *,
        request_id: str | None = None,
        parent: Context | _Parent | None = FROM_HEADERS,
        received: float | None = None,
        link: ConnectionTrace | None = None,
        path: str | None = None,
    ) -> Arrival:
        """A call read now (or at ``received``): its span opens, as a child of ``parent``
        (default: the ``traceparent`` header of ``scope``; None: a root)."""
        received = time.monotonic() if received is None else received
        if parent is FROM_HEADERS:
            parent = Tracing.from_headers(scope.get("headers", ()))
        path = path if path is not None else scope.get("path", "")

        def attributes() -> Attributes:  # called only when spans are recorded
            opened = {"gen_ai.operation.name": operation, "url.path": path}
            if "method" in scope:
                opened["http.request.method"] = scope["method"]
            if request_id is not None:
                opened["seedance.request_id"] = request_id
            return opened

        trace = self.tracing.request(operation, parent, received, attributes, link)
        return Arrival(api, path, peer_of(scope), operation, received, trace, request_id)

    def refuse(self, arrival: Arrival, error: SeedanceError) -> Future[int] | None:
        """``arrival`` was refused with ``error``: counted, traced, audited and logged, the
        same for every API; the record's future (see :meth:`AuditGate.submit`)."""
        model = arrival.model
        self.metrics.refused(error.code, arrival.api)
        if model is not None and arrival.request_id is not None:
            engine = model.engine.info.engine
            self.metrics.requests.labels(
                model.name, engine, arrival.tenant or "-", error.code
            ).inc()
        self._end_span(arrival, error.code, error)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "refused %s %s peer=%s tenant=%s request=%s model=%s code=%s: %s",
                arrival.api,
                arrival.path,
                arrival.peer,
                arrival.tenant or "-",
                arrival.request_id or "-",
                model.name if model is not None else "-",
                error.code,
                error.message,
            )
        return self.audit.submit(lambda: refusal_record(arrival, error))

    def answered(self, arrival: Arrival, outcome: str, prompt_tokens: int = 0) -> None:
        """``arrival`` was answered without a generation (a response read, deleted or
        cancelled; a stream resumed; inputs embedded, ``prompt_tokens`` of them; or the client
        left before its request was read: ``aborted``): its record, span and log line, and
        for a model's work its counters."""
        self._end_span(arrival, outcome, None)
        model = arrival.model
        if prompt_tokens and model is not None:
            labels = (model.name, model.engine.info.engine, arrival.tenant or "-")
            self.metrics.requests.labels(*labels, outcome).inc()
            self.metrics.prompt_tokens.labels(*labels).inc(prompt_tokens)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "request %s http=%s tenant=%s model=%s outcome=%s prompt_tokens=%d "
                "completion_tokens=0 ttft_ms=- total_ms=%.1f",
                arrival.request_id or "-",
                arrival.operation,
                arrival.tenant or "-",
                model.name if model is not None else "-",
                outcome,
                prompt_tokens,
                (time.monotonic() - arrival.received) * 1000,
            )
        self.audit.submit(lambda: _answered_record(arrival, outcome, prompt_tokens))

    def _end_span(self, arrival: Arrival, outcome: str, error: SeedanceError | None) -> None:
        trace = arrival.trace
        if trace.span is None:
            return
        attributes: dict[str, str | int | float] = dict(arrival.attributes)
        if arrival.request_id is not None:
            attributes["gen_ai.response.id"] = arrival.request_id
        model = arrival.model
        if model is not None:
            attributes["gen_ai.request.model"] = model.name
            attributes["seedance.engine"] = model.engine.info.engine
            trace.span.update_name(f"{arrival.operation} {model.name}")
        trace.end(
            received=arrival.received,
            admitted=None,
            first_token=None,
            last_token=None,
            outcome=outcome,
            error=None if error is None else (error.code, error.message),
            attributes=attributes,
        )


def refusal_record(arrival: Arrival, error: SeedanceError) -> audit.Refused:
    """The record of a call refused before it started (one shape for every API)."""
    principal, model = arrival.principal, arrival.model
    return audit.Refused(
        api=arrival.api,
        peer=arrival.peer,
        path=arrival.path,
        tenant=principal.name if principal is not None else None,
        credential=principal.credential if principal is not None else None,
        outcome=error.code,
        message=error.message,
        request_id=arrival.request_id or UNSET,
        model=model.name if model is not None else UNSET,
        connection=arrival.connection_id or UNSET,
        session=arrival.session_id or UNSET,
        trace_id=arrival.trace.trace_id,
        policies=list(error.policies) if isinstance(error, Denied) else UNSET,
    )


def _answered_record(arrival: Arrival, outcome: str, prompt_tokens: int) -> audit.AuditRecord:
    principal, model = arrival.principal, arrival.model
    if principal is None:  # the client left before it was let in
        return audit.Refused(
            api=arrival.api,
            peer=arrival.peer,
            path=arrival.path,
            tenant=None,
            credential=None,
            outcome=outcome,
            message="the client left before its request was read",
            trace_id=arrival.trace.trace_id,
        )
    record = audit.Request(
        api=arrival.api,
        tenant=principal.name,
        credential=principal.credential,
        request_id=arrival.request_id or "",
        trace_id=arrival.trace.trace_id,
        model=model.name if model is not None else None,
        outcome=outcome,
        total_ms=ms(time.monotonic() - arrival.received),
        policies=UNSET if arrival.policies is None else list(arrival.policies),
    )
    if prompt_tokens and model is not None:  # a model's work (embeddings)
        record.engine = model.engine.info.engine
        record.model_version = model.version or None
        record.prompt_tokens = prompt_tokens
    return record
