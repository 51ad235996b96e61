"""The ``/v2/infer`` WebSocket endpoint as a plain ASGI callable (no per-frame wrappers)."""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import parse_qs

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from seedance import SERVER_NAME
from seedance.observability.tracing import Tracing
from seedance.protocol.codec import encode_error, encode_frame, validate_session_id
from seedance.protocol.e2e import parse_client_key
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    Forbidden,
    InvalidRequest,
    Overloaded,
    SeedanceError,
)
from seedance.protocol.messages import (
    SUBPROTOCOL,
    ActiveStream,
    SessionFrame,
    SessionId,
    TenantId,
)
from seedance.protocol.qos import qos_from_headers
from seedance.server.connection import Connection, new_connection_id
from seedance.server.lifecycle.admit import choose_model
from seedance.server.lifecycle.connections import Counted, count_connection
from seedance.server.lifecycle.services import Services
from seedance.server.transport import AsgiWebSocket
from seedance.tenants.auth import peer_of
from seedance.tenants.policy import check_labels

logger = logging.getLogger(__name__)


class InferEndpoint:
    """ASGI app for ``/v2/infer``."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        ws = AsgiWebSocket(scope, receive, send)
        event = await ws.receive()
        if event["type"] != "websocket.connect":
            return
        received = time.monotonic()
        services = self.services
        subprotocol = SUBPROTOCOL if SUBPROTOCOL in scope.get("subprotocols", ()) else None
        peer = peer_of(scope)
        if services.shutdown.draining:
            await ws.accept(subprotocol)
            await ws.close(CLOSE_GOING_AWAY, "server shutting down")
            return
        config = services.config
        principal = model = None
        counted: Counted | None = None  # the connection's place in its tenant's count
        try:
            params = parse_qs(
                scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
            )
            # The door first: nothing else is looked at for a caller that is not let in.
            services.access.check_origin(scope.get("headers", ()))
            principal = services.access.authenticate(scope)
            if services.peers.count("infer") >= config.max_connections:
                raise Overloaded(
                    f"the server holds {config.max_connections} connections; retry later"
                )
            check_labels(principal, config.labels)
            model = choose_model(services, principal, _param(params, "model"))
            qos = qos_from_headers(scope.get("headers", ()))
            client_key = _e2e_param(services, params)
            raw_id = _param(params, "session_id")
            session_id = SessionId(validate_session_id(raw_id)) if raw_id is not None else None
            quotas = principal.tenant.quotas
            counted = await count_connection(services, principal.name, quotas)
            session, created = await services.sessions.attach(
                TenantId(principal.name), session_id, max_for_tenant=quotas.sessions
            )
            model = services.models.resolve(model.name, session.session_id)  # a canary's share
        except SeedanceError as exc:
            if counted is not None:
                counted.release()
            arrival = services.refusals.arrive("websocket", scope, "connect", received=received)
            arrival.principal, arrival.model = principal, model
            services.refusals.refuse(arrival, exc)
            await ws.accept(subprotocol)
            await ws.send(encode_error(exc))
            await ws.close(exc.connect_close_code, exc.code)
            return
        try:
            connection_id = new_connection_id()
            channel = offer = None
            if client_key is not None:
                assert services.confidential is not None
                channel, offer = services.confidential.accept(
                    client_key, session.session_id, principal.name, connection_id
                )
            await ws.accept(subprotocol)
            streams = services.streams
            log = await streams.active(principal.name, session.session_id)
            epoch = await streams.epoch_of(principal.name, session.session_id)
            active = (
                None
                if log is None
                else ActiveStream(
                    log.request_id, log.next_seq, "running" if log.running else "done"
                )
            )
            await ws.send(
                encode_frame(
                    SessionFrame(
                        session_id=session.session_id,
                        model=model.name,
                        created=created,
                        context_turns=len(session.turns),
                        expires_in=config.session_ttl_s,
                        heartbeat_interval=config.heartbeat_interval_s,
                        idle_timeout=config.idle_timeout_s,
                        server=SERVER_NAME,
                        epoch=epoch,
                        active=active,
                        e2e=offer,
                    )
                )
            )
            parent = Tracing.from_headers(scope.get("headers", ()))
            connection = Connection(
                services,
                ws,
                session,
                model,
                peer,
                parent,
                principal,
                qos,
                connection_id=connection_id,
                channel=channel,
            )
            services.peers.add(connection)
            try:
                await connection.run()
            finally:
                services.peers.discard(connection)
        except OSError:
            pass  # the client left during the handshake
        finally:
            assert counted is not None
            counted.release()
            await services.sessions.detach(session)


def _e2e_param(services: Services, params: dict[str, list[str]]) -> X25519PublicKey | None:
    """The client's key for end-to-end encryption (parsed), or None when it asks for none;
    refused where the server does not offer it, or requires it and the client did not ask."""
    client_key = _param(params, "e2e")
    confidential = services.confidential
    if client_key is None:
        if confidential is not None and confidential.required:
            raise Forbidden(
                "this server requires end-to-end encryption: connect with e2e=<your X25519 "
                "public key> (docs/protocol.md, section 9)"
            )
        return None
    if confidential is None:
        raise InvalidRequest(
            "this server does not offer end-to-end encryption (its --e2e-key is not set)"
        )
    return parse_client_key(client_key)


def _param(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[0] if values else None
