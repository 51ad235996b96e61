"""Taking over a generation whose node died (cluster mode).

The node that runs a generation writes, with its ``start`` frame, a header that says all a
takeover needs (:meth:`~seedance.server.lifecycle.generation.Generation.header`): the request,
its prompt as the engine saw it, who asked, and its trace. When that node's lock expired before
the generation's end (:mod:`seedance.cluster.streams` notices it while following the log for a
reader), a surviving node claims the lock (a new fencing token: the old node can no longer
write, should it wake up), and runs the same request with the prompt followed by the reply so
far, through admission's tail (:func:`~seedance.server.lifecycle.admit.start`); the engine
continues after it and the log goes on at the next ``seq``. The continuation is a new sample
from the same prefix (docs/protocol.md says so): the tokens before the takeover are exactly
those the first node logged. Its span is a child of the first node's, so the trace goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from seedance.protocol.errors import SeedanceError
from seedance.protocol.messages import ChatMessage, Generate, RequestId, TenantId
from seedance.protocol.qos import parse_qos
from seedance.server.lifecycle.admit import Prompt, Requester, start
from seedance.server.lifecycle.generation import Generation
from seedance.server.modules import modules_for
from seedance.sessions.session import Session, Turn
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal
from seedance.tenants.config import Quotas

if TYPE_CHECKING:
    from seedance.cluster.streams import ReplicatedLog
    from seedance.server.lifecycle.services import Services

logger = logging.getLogger(__name__)


async def take_over(services: Services, log: ReplicatedLog, header: dict[str, Any]) -> bool:
    """Run the generation of ``log`` here from where it stopped; false when another node
    holds it (or took it first), or this node cannot run it."""
    cluster = services.cluster
    assert cluster is not None
    request_id = RequestId(log.request_id)
    try:
        model = services.models.resolve(header["model"])
        message = msgspec.convert(header["request"], Generate)
        # The lock only: the request's quotas were counted where it started.
        claim = await cluster.claims.claim(
            request_id, header["tenant"], header["log_key"], Quotas(), 0
        )
    except SeedanceError as exc:
        logger.debug("request %s not taken over here: %s", request_id, exc.message)
        return False
    tenant = services.access.authenticator.access.tenants.get(header["tenant"])
    principal = (
        OPEN_PRINCIPAL
        if tenant is None
        else Principal(tenant, header["credential"], header["role"])
    )
    session = None
    try:
        if header["session"] is not None:
            session, _ = await services.sessions.attach(TenantId(principal.name), header["session"])
        engine = model.engine
        new_turns = (
            [Turn(m, engine.count_message_tokens(m), model.name) for m in message.turns()]
            if session is not None
            else []
        )
        prompt = Prompt(
            _messages(services, header, session, new_turns),
            header["prompt_tokens"],
            new_turns,
            raw=header["raw"],
            unset=frozenset(header["unset"]),
        )
        requester = Requester(principal, model, header["api"], session=session)
        carrier = {k: header[k] for k in ("traceparent", "tracestate") if header.get(k)}
        arrival = services.refusals.arrive(
            header["api"],
            {"headers": [(k.encode(), v.encode()) for k, v in carrier.items()]},
            header["operation"],
            request_id=request_id,
            path="takeover",
        )
        arrival.principal, arrival.model = principal, model
        generation = Generation(
            services,
            arrival,
            requester,
            log,
            message,
            prompt,
            qos=parse_qos(header["qos"]) if header.get("qos") else None,
            modules=modules_for(services.modules, principal, message),
        )
        generation.claim = claim
        generation.completion_tokens = log.next_seq  # the reply so far
        services.usage.start_request(principal.name, Quotas(), prompt.tokens, message.max_tokens)
    except BaseException:
        await cluster.claims.release(claim, 0, 0)
        if session is not None:
            await services.sessions.detach(session)
        raise
    start(services, generation)
    logger.info(
        "request %s taken over at seq %d (node %s), its node is gone",
        request_id,
        log.next_seq,
        cluster.node_id,
    )
    if session is not None:
        cluster.link.spawn(_let_go(services, generation, session), "takeover-session")
    return True


def _messages(
    services: Services, header: dict[str, Any], session: Session | None, new_turns: list[Turn]
) -> tuple[ChatMessage, ...]:
    """The prompt's messages: the header's; or where it names them, the header's, then the
    session's saved turns it held, then the request's own (``new_turns``)
    (:meth:`~seedance.server.lifecycle.generation.Generation.header`)."""
    messages = [ChatMessage(role, content) for role, content in header["messages"]]
    history = header.get("history")
    if history is None or session is None:
        return tuple(messages)
    spans, version = history
    assert services.cluster is not None
    turns = session.turns
    if services.cluster.sessions.version(session) != version:
        # Saved since the header was written: the exchange's turns and reply are the last.
        turns = turns[: max(0, len(turns) - len(new_turns) - 1)]
    held = [turn.message for start, stop in spans for turn in turns[start : stop or None]]
    return (*messages, *held, *(turn.message for turn in new_turns))


async def _let_go(services: Services, generation: Generation, session: Session) -> None:
    """The session was attached for the takeover: detach it once the generation ended."""
    if generation.task is not None:
        await asyncio.gather(generation.task, return_exceptions=True)
    await services.sessions.detach(session)
