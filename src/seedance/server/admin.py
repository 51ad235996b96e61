"""Administrative HTTP endpoints, for credentials with the ``admin`` role.

- ``GET /admin/tenants``: every tenant, its policy and quotas, its keys (ids and roles, never
  hashes) and its live usage;
- ``POST /admin/keys/{key_id}/revoke``: refuse a key from now on (also in the config file) and
  close the connections that hold it;
- ``DELETE /admin/sessions/{tenant}/{session_id}``: end a session: its running reply is
  cancelled, its connections closed, its context dropped;
- ``POST /admin/models/reload`` and ``POST /admin/modules/reload``: serve the model registry's
  and the module registry's promoted versions now (each change verified first, audited);
- ``GET /admin/runtime``: what the process holds now (event loop tasks, connections, requests,
  sessions and their history): what a leak shows in first. Counting tasks walks all of them
  (about 4 ms at 20,000), so it is here, asked for, not in every ``/metrics`` scrape.

A server without tenants has no administrators: these endpoints answer 403 there. Errors are
rendered by the app's handlers (seedance.server.errors).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from seedance.config import ConfigError
from seedance.observability.audit import kinds as audit
from seedance.protocol.errors import Conflict, Forbidden, InternalError, NotFound
from seedance.protocol.messages import SessionId, TenantId
from seedance.server.connection import Connection
from seedance.server.http_call import authenticate_call
from seedance.server.state import ServerState
from seedance.tenants.auth import Principal
from seedance.tenants.keys import KeyAlreadyRevoked, KeyNotFound

if TYPE_CHECKING:
    from seedance.models.serving import Reload

logger = logging.getLogger(__name__)


def admin_routes(state: ServerState) -> list[Route]:
    async def reload_models(request: Request) -> Response:
        """Serve the registry's promoted version now (see seedance.models.serving)."""
        _admin(state, request)
        manager = state.model_manager
        if manager is None:
            raise NotFound("this server serves no model registry (--model-registry)")
        return _json({"reloads": [_reload_json(r) for r in await manager.reload()]})

    async def reload_modules(request: Request) -> Response:
        """Serve the module registry's promoted versions now (seedance.server.modules)."""
        _admin(state, request)
        modules = state.modules
        if modules is None:
            raise NotFound("this server runs no module registry (--module-registry)")
        events = await asyncio.to_thread(modules.reload)
        body = [msgspec.to_builtins(event) for event in events]
        return _json(
            {"reloads": [{k: v for k, v in e.items() if k not in ("kind", "time")} for e in body]}
        )

    async def tenants(request: Request) -> Response:
        _admin(state, request)
        access = state.access.authenticator.access
        body = []
        for tenant in access.tenants.values():
            name = TenantId(tenant.name)
            usage = state.services.usage.snapshot(tenant.name)
            usage["sessions"] = state.sessions.count(name)
            usage["session_bytes"] = state.sessions.bytes_of(name)
            usage["waiting"] = sum(
                m.admission.waiting_of(tenant.name) for m in state.models.values()
            )
            body.append(
                {
                    "name": tenant.name,
                    "tier": tenant.tier,
                    "models": tenant.models,
                    "max_priority": tenant.max_priority,
                    "labels": tenant.labels,
                    "quotas": msgspec.to_builtins(tenant.quotas),
                    "keys": [
                        {"id": k.id, "role": k.role, "revoked": k.revoked} for k in tenant.keys
                    ],
                    "usage": usage,
                }
            )
        return _json({"tenants": body})

    async def revoke(request: Request) -> Response:
        principal = _admin(state, request)
        key_id = request.path_params["key_id"]
        state.audit.check()
        try:
            tenant = state.access.revoke(key_id)
        except (KeyError, KeyNotFound):  # not in memory, or no longer in the file
            raise NotFound(f"no key {key_id}") from None
        except KeyAlreadyRevoked as exc:
            raise Conflict(exc.message) from None
        except (ConfigError, OSError) as exc:  # the tenants file cannot be read or written
            logger.error("key %s not revoked: %s", key_id, exc)
            raise InternalError(
                f"key {key_id} was not revoked: the tenants file could not be updated (the "
                "server's log says why)"
            ) from None
        logger.info("key %s of tenant %s revoked by %s", key_id, tenant, principal.credential)
        await state.audit.write(
            lambda: _admin_record(principal, "revoke_key", tenant, key=key_id), "the revocation"
        )
        return _json({"revoked": key_id, "tenant": tenant})

    async def end_session(request: Request) -> Response:
        principal = _admin(state, request)
        state.audit.check()
        tenant = TenantId(request.path_params["tenant"])
        session_id = SessionId(request.path_params["session_id"])
        session = state.sessions.get(tenant, session_id)
        if session is None:
            raise NotFound(f"no session {session_id} of tenant {tenant}")
        ended = [c for c in state.peers.of_kind("infer") if isinstance(c, Connection)]
        ended = [c for c in ended if c.session is session]
        for connection in ended:
            await connection.end_session_by_admin()
        await state.sessions.delete(session)
        await state.audit.write(
            lambda: _admin_record(principal, "end_session", tenant, session=session_id),
            "the session's end",
        )
        logger.info(
            "session %s of tenant %s ended by %s (%d connection(s) closed)",
            session_id,
            tenant,
            principal.credential,
            len(ended),
        )
        return _json({"ended": session_id, "tenant": tenant, "connections": len(ended)})

    async def runtime(request: Request) -> Response:
        _admin(state, request)
        return _json(
            {
                "event_loop_tasks": len(asyncio.all_tasks()),
                "connections": state.peers.count("infer"),
                "http_requests": state.peers.count("http"),
                "generations": state.models.running,
                "sessions": len(state.sessions),
                "session_history_bytes": state.sessions.bytes,
            }
        )

    return [
        Route("/admin/tenants", tenants),
        Route("/admin/runtime", runtime),
        Route("/admin/models/reload", reload_models, methods=["POST"]),
        Route("/admin/modules/reload", reload_modules, methods=["POST"]),
        Route("/admin/keys/{key_id}/revoke", revoke, methods=["POST"]),
        Route("/admin/sessions/{tenant}/{session_id}", end_session, methods=["DELETE"]),
    ]


def _admin_record(
    principal: Principal,
    action: Literal["revoke_key", "end_session"],
    tenant: str,
    *,
    key: str | UnsetType = UNSET,
    session: str | UnsetType = UNSET,
) -> audit.Admin:
    return audit.Admin(
        action=action,
        actor_tenant=principal.name,
        actor_credential=principal.credential,
        tenant=tenant,
        key=key,
        session=session,
    )


def _admin(state: ServerState, request: Request) -> Principal:
    principal = authenticate_call(state.services, request.scope, "admin")
    if state.access.open:
        raise Forbidden("this server has no tenants, so no administrators: configure an admin key")
    if principal.role != "admin":
        raise Forbidden(f"credential {principal.credential} is not an admin's")
    return principal


def _reload_json(done: Reload) -> dict[str, Any]:
    return {
        "model": done.model,
        "role": done.role,
        "outcome": done.outcome,
        "version": done.version or None,
        "share": done.share,
        "reason": done.reason,
        "message": done.message,
    }


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")
