"""Taking over a generation whose node died.

The node that runs a generation writes, with its ``start`` frame, a header that says all a
takeover needs: the request, its prompt as the engine saw it, the tenant and the session. When
that node's lock expired before the generation's end (:mod:`seedance.cluster.streams` notices
it while following the log for a reader), a surviving node claims the lock (a new fencing
token: the old node can no longer write, should it wake up), and runs the same request with
the prompt followed by the reply so far; the engine continues after it and the log goes on at
the next ``seq``. The continuation is a new sample from the same prefix (docs/protocol.md says
so): the tokens before the takeover are exactly those the first node logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from seedance.protocol.errors import SeedanceError
from seedance.protocol.messages import ChatMessage, Generate, RequestId, TenantId
from seedance.protocol.qos import QoS, parse_qos
from seedance.sessions.session import Turn
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal
from seedance.tenants.config import Quotas

if TYPE_CHECKING:
    from seedance.cluster.streams import ReplicatedLog
    from seedance.server.requests import Generation
    from seedance.server.state import ServerState

logger = logging.getLogger(__name__)


def header_of(generation: Generation) -> bytes:
    """What a node taking ``generation`` over needs, as Redis keeps it."""
    requester = generation.requester
    principal = requester.principal
    prompt = generation.prompt
    log = generation.log
    session = requester.session
    qos = generation.qos  # its class and tag (the health it reported is counted where it began)
    return msgspec.json.encode(
        {
            "tenant": requester.tenant,
            "credential": principal.credential,
            "role": principal.role,
            "session": None if session is None else session.session_id,
            "log_key": requester.log_key(generation.request_id),
            "model": requester.model.name,
            "api": requester.api,
            "operation": generation.operation,
            "qos": None if qos is None else QoS(qos.service_class, qos.slatag).header(),
            "request": msgspec.to_builtins(generation.message),
            "messages": [[m.role, m.content] for m in prompt.messages],
            "prompt_tokens": prompt.tokens,
            "raw": prompt.raw,
            "unset": sorted(prompt.unset),
            "resumable": log.resumable,
            "stream": log.stream,
            "meta": log.meta,
        }
    )


async def take_over(state: ServerState, log: ReplicatedLog, header: dict[str, Any]) -> bool:
    """Run the generation of ``log`` here from where it stopped; false when another node
    holds it (or took it first), or this node cannot run it."""
    from seedance.server.requests import Generation, Prompt, Requester

    cluster = state.cluster
    assert cluster is not None
    request_id = RequestId(log.request_id)
    try:
        model = state.resolve_model(header["model"])
        message = msgspec.convert(header["request"], Generate)
        # The lock only: the request's quotas were counted where it started.
        claim = await cluster.claims.claim(
            request_id, header["tenant"], header["log_key"], Quotas(), 0
        )
    except SeedanceError as exc:
        logger.debug("request %s not taken over here: %s", request_id, exc.message)
        return False
    tenants = state.access.authenticator.access.tenants
    tenant = tenants.get(header["tenant"])
    principal = (
        OPEN_PRINCIPAL
        if tenant is None
        else Principal(tenant, header["credential"], header["role"])
    )
    session = None
    try:
        if header["session"] is not None:
            session, _ = await state.sessions.attach(TenantId(principal.name), header["session"])
        engine = model.engine
        prompt = Prompt(
            tuple(ChatMessage(role, content) for role, content in header["messages"]),
            header["prompt_tokens"],
            [Turn(m, engine.count_message_tokens(m), model.name) for m in message.turns()]
            if session is not None
            else (),
            raw=header["raw"],
            unset=frozenset(header["unset"]),
        )
        requester = Requester(principal, model, header["api"], session=session)
        generation = Generation(
            state,
            requester,
            log,
            message,
            request_id,
            prompt,
            time.monotonic(),
            operation=header["operation"],
            qos=parse_qos(header["qos"]) if header.get("qos") else None,
        )
        generation.claim = claim
        generation.completion_tokens = log.next_seq  # the reply so far
        state.usage.start_request(principal.name, Quotas(), prompt.tokens, message.max_tokens)
    except BaseException:
        await cluster.claims.release(claim, 0, 0)
        if session is not None:
            await state.sessions.detach(session)
        raise
    if session is not None:
        session.begin(request_id)
    state.generation_started(generation)
    logger.info(
        "request %s taken over at seq %d (node %s), its node is gone",
        request_id,
        log.next_seq,
        cluster.node_id,
    )
    if session is not None:
        cluster.link.spawn(_let_go(state, generation, session), "takeover-session")
    return True


async def _let_go(state: ServerState, generation: Generation, session: Any) -> None:
    """The session was attached for the takeover: detach it once the generation ended."""
    if generation.task is not None:
        await asyncio.gather(generation.task, return_exceptions=True)
    await state.sessions.detach(session)
