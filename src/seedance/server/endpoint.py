"""The ``/v2/infer`` WebSocket endpoint as a plain ASGI callable (no per-frame wrappers)."""

from __future__ import annotations

import functools
import logging
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
from seedance.server.state import ServerState
from seedance.server.transport import AsgiWebSocket
from seedance.tenants.auth import peer_of, refusal_record
from seedance.tenants.policy import check_labels, check_model

logger = logging.getLogger(__name__)


class InferEndpoint:
    """ASGI app for ``/v2/infer``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        ws = AsgiWebSocket(scope, receive, send)
        event = await ws.receive()
        if event["type"] != "websocket.connect":
            return
        state = self.state
        subprotocol = SUBPROTOCOL if SUBPROTOCOL in scope.get("subprotocols", ()) else None
        peer = peer_of(scope)
        if state.draining:
            await ws.accept(subprotocol)
            await ws.close(CLOSE_GOING_AWAY, "server shutting down")
            return
        principal = None
        counted = False  # the connection counts against its tenant's quota
        try:
            params = parse_qs(
                scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
            )
            # The door first: nothing else is looked at for a caller that is not let in.
            state.access.check_origin(scope.get("headers", ()))
            principal = state.access.authenticate(scope)
            if len(state.connections) >= state.config.max_connections:
                raise Overloaded(
                    f"the server holds {state.config.max_connections} connections; retry later"
                )
            check_labels(principal, state.config.labels)
            model = state.resolve_model(_param(params, "model"))
            check_model(principal, model.name, state.models)
            qos = qos_from_headers(scope.get("headers", ()))
            client_key = _e2e_param(state, params)
            raw_id = _param(params, "session_id")
            session_id = SessionId(validate_session_id(raw_id)) if raw_id is not None else None
            quotas = principal.tenant.quotas
            state.usage.open_connection(principal.name, quotas)
            counted = True
            session, created = await state.sessions.attach(
                TenantId(principal.name), session_id, max_for_tenant=quotas.sessions
            )
            model = state.resolve_model(model.name, session.session_id)  # a canary's share
        except SeedanceError as exc:
            if counted and principal is not None:
                state.usage.close_connection(principal.name)
            logger.info("connect refused peer=%s: %s %s", peer, exc.code, exc.message)
            state.metrics.refused(exc.code)
            state.audit_submit(
                functools.partial(refusal_record, "websocket", scope, principal, exc)
            )
            await ws.accept(subprotocol)
            await ws.send(encode_error(exc))
            await ws.close(exc.connect_close_code, exc.code)
            return
        try:
            connection_id = new_connection_id()
            channel = offer = None
            if client_key is not None:
                assert state.confidential is not None
                channel, offer = state.confidential.accept(
                    client_key, session.session_id, principal.name, connection_id
                )
            await ws.accept(subprotocol)
            config = state.config
            streams = state.streams
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
                state,
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
            state.connections.add(connection)
            try:
                await connection.run()
            finally:
                state.connections.discard(connection)
        except OSError:
            pass  # the client left during the handshake
        finally:
            assert principal is not None
            state.usage.close_connection(principal.name)
            await state.sessions.detach(session)


def _e2e_param(state: ServerState, params: dict[str, list[str]]) -> X25519PublicKey | None:
    """The client's key for end-to-end encryption (parsed), or None when it asks for none;
    refused where the server does not offer it, or requires it and the client did not ask."""
    client_key = _param(params, "e2e")
    confidential = state.confidential
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
