"""Administrative HTTP endpoints, for credentials with the ``admin`` role.

- ``GET /admin/tenants``: every tenant, its policy and quotas, its keys (ids and roles, never
  hashes) and its live usage;
- ``POST /admin/keys/{key_id}/revoke``: refuse a key from now on (also in the config file) and
  close the connections that hold it;
- ``DELETE /admin/sessions/{tenant}/{session_id}``: end a session: its running reply is
  cancelled, its connections closed, its context dropped;
- ``POST /admin/models/reload`` and ``POST /admin/modules/reload``: serve the model registry's
  and the module registry's promoted versions now (each change verified first, audited);
- ``GET /admin/runtime``: what each process holds now (event loop tasks, connections,
  requests, sessions and their history), and their sum: what a leak shows in first. Counting
  tasks walks all of them (about 4 ms at 20,000), so it is here, asked for, not in every
  ``/metrics`` scrape.

They speak for the whole server, whichever process answers: a usage, a runtime, a modules
reload and a session's end are every process's (each worker of ``--workers N``, each node of a
cluster), asked with :mod:`seedance.cluster.asks`; the sessions a tenant holds are counted
where its quota counts them. A server without tenants has no administrators: these endpoints
answer 403 there. Errors are rendered by the app's handlers (seedance.server.errors).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from seedance.config import ConfigError
from seedance.observability.audit import kinds as audit
from seedance.protocol.errors import Conflict, InternalError, NotFound
from seedance.protocol.messages import SessionId, TenantId
from seedance.server.connection import Connection
from seedance.server.http_call import authenticate_call
from seedance.server.state import ServerState
from seedance.tenants.auth import Principal, peer_of
from seedance.tenants.keys import KeyAlreadyRevoked, KeyNotFound

if TYPE_CHECKING:
    from seedance.models.serving import Reload

logger = logging.getLogger(__name__)


def admin_routes(state: ServerState) -> list[Route]:
    _answer_for_the_cluster(state)

    async def reload_models(request: Request) -> Response:
        """Serve the registry's promoted version now (see seedance.models.serving)."""
        _admin(state, request, "reload_models")
        manager = state.model_manager
        if manager is None:
            raise NotFound("this server serves no model registry (--model-registry)")
        return _json({"reloads": [_reload_json(r) for r in await manager.reload()]})

    async def reload_modules(request: Request) -> Response:
        """Serve the module registry's promoted versions now, in every process
        (seedance.server.modules); what each did, once."""
        _admin(state, request, "reload_modules")
        answers = await _everywhere(state, "reload_modules")
        if all(answer["reloads"] is None for answer in answers):
            raise NotFound("this server runs no module registry (--module-registry)")
        reloads = (event for answer in answers for event in answer["reloads"] or [])
        return _json({"reloads": list({msgspec.json.encode(e): e for e in reloads}.values())})

    async def tenants(request: Request) -> Response:
        _admin(state, request, "read_tenants")
        listed = list(state.access.authenticator.access.tenants.values())
        names = [TenantId(tenant.name) for tenant in listed]
        usage = _added_up(answer["usage"] for answer in await _everywhere(state, "usage"))
        sessions = await state.sessions.usage(names)
        body = []
        for tenant, name in zip(listed, names, strict=True):
            counted = dict.fromkeys(_COUNTED, 0) | usage.get(name, {})
            counted["sessions"], counted["session_bytes"] = sessions[name]
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
                    "usage": counted,
                }
            )
        return _json({"tenants": body})

    async def revoke(request: Request) -> Response:
        principal = _admin(state, request, "revoke_key")
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
        principal = _admin(state, request, "end_session")
        state.audit.check()
        tenant = request.path_params["tenant"]
        session_id = request.path_params["session_id"]
        answers = await _everywhere(state, "end_session", [tenant, session_id])
        if not any(answer["ended"] for answer in answers):
            raise NotFound(f"no session {session_id} of tenant {tenant}")
        closed = sum(answer["connections"] for answer in answers)
        await state.audit.write(
            lambda: _admin_record(principal, "end_session", tenant, session=session_id),
            "the session's end",
        )
        logger.info(
            "session %s of tenant %s ended by %s (%d connection(s) closed)",
            session_id,
            tenant,
            principal.credential,
            closed,
        )
        return _json({"ended": session_id, "tenant": tenant, "connections": closed})

    async def runtime(request: Request) -> Response:
        _admin(state, request, "read_runtime")
        processes = await _everywhere(state, "runtime")
        processes.sort(key=lambda p: (p["node"] or "", p["worker"] or 0, p["pid"]))
        total = _added_up([{k: v for k, v in p.items() if k not in _WHO} for p in processes])
        return _json({**total, "processes": processes})

    return [
        Route("/admin/tenants", tenants),
        Route("/admin/runtime", runtime),
        Route("/admin/models/reload", reload_models, methods=["POST"]),
        Route("/admin/modules/reload", reload_modules, methods=["POST"]),
        Route("/admin/keys/{key_id}/revoke", revoke, methods=["POST"]),
        Route("/admin/sessions/{tenant}/{session_id}", end_session, methods=["DELETE"]),
    ]


# ---------------------------------------------------------------------- every process's answer

#: A tenant's usage counted in each process (added up across them).
_COUNTED: Final = (
    "connections",
    "generations",
    "requests_last_minute",
    "tokens_last_minute",
    "waiting",
)


#: What names a process in ``/admin/runtime``.
_WHO: Final = ("node", "worker", "pid")


async def _everywhere(state: ServerState, kind: str, body: Any = None) -> list[Any]:
    """Every process's answer to ``kind``: each node of the cluster and each worker of
    ``--workers N`` (:mod:`seedance.cluster.asks`), or this process's alone."""
    cluster = state.cluster
    if cluster is None:
        return [await _ANSWERS[kind](state, body)]
    return await cluster.asks.ask(kind, body)


def _answer_for_the_cluster(state: ServerState) -> None:
    """Answer the other nodes' (and workers') administrative questions."""
    if state.cluster is not None:
        for kind, answer in _ANSWERS.items():
            state.cluster.asks.answerers[kind] = functools.partial(answer, state)


async def _usage_here(state: ServerState, _: None) -> dict[str, Any]:
    usage = {}
    for name in state.access.authenticator.access.tenants:
        counted: dict[str, int] = state.services.usage.snapshot(name)
        counted["waiting"] = sum(m.admission.waiting_of(name) for m in state.models.values())
        if any(counted.values()):
            usage[name] = counted
    return {"usage": usage}


async def _runtime_here(state: ServerState, _: None) -> dict[str, Any]:
    """What this process holds now: what a leak shows in first."""
    return {
        "node": state.cluster.node_id if state.cluster is not None else None,
        "worker": None if state.config.worker is None else state.config.worker.index,
        "pid": os.getpid(),
        "event_loop_tasks": len(asyncio.all_tasks()),
        "connections": state.peers.count("infer"),
        "http_requests": state.peers.count("http"),
        "generations": state.models.running,
        "sessions": len(state.sessions),
        "session_history_bytes": state.sessions.bytes,
    }


async def _end_session_here(state: ServerState, body: list[str]) -> dict[str, Any]:
    """Close this process's connections of a session (their running reply cancelled), then
    delete it (from the cluster's store too, which any process may do first)."""
    tenant, session_id = TenantId(body[0]), SessionId(body[1])
    session = state.sessions.get(tenant, session_id)
    connections = [c for c in state.peers.of_kind("infer") if isinstance(c, Connection)]
    connections = [c for c in connections if session is not None and c.session is session]
    for connection in connections:
        await connection.end_session_by_admin()
    ended = await state.sessions.end(tenant, session_id)
    return {"ended": ended, "connections": len(connections)}


async def _reload_modules_here(state: ServerState, _: None) -> dict[str, Any]:
    modules = state.modules
    if modules is None:
        return {"reloads": None}
    events = [msgspec.to_builtins(event) for event in await asyncio.to_thread(modules.reload)]
    return {"reloads": [{k: v for k, v in e.items() if k not in ("kind", "time")} for e in events]}


_ANSWERS: Final[dict[str, Callable[[ServerState, Any], Awaitable[Any]]]] = {
    "usage": _usage_here,
    "reload_modules": _reload_modules_here,
    "runtime": _runtime_here,
    "end_session": _end_session_here,
}


def _added_up(counts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Numbers by name (nested by tenant too), added up across processes."""
    total: dict[str, Any] = {}
    for count in counts:
        for name, value in count.items():
            if isinstance(value, dict):
                total[name] = _added_up([total.get(name, {}), value])
            else:
                total[name] = total.get(name, 0) + value
    return total


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


def _admin(state: ServerState, request: Request, verb: str) -> Principal:
    """The caller of an administrative endpoint, who must be allowed to do ``verb`` (an admin
    key, or what the policies say: seedance.tenants.cedar.ADMIN_ACTIONS)."""
    principal = authenticate_call(state.services, request.scope, "admin")
    state.access.check_admin(principal, verb, peer_of(request.scope))
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
