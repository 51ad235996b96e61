"""Admission: the recipe every API follows before a generation starts, written once.

1. :func:`choose_model`: the model a call names (a canary's share by a sticky key), which its
   tenant must be allowed to use;
2. :meth:`ServedModel.check <seedance.server.lifecycle.models.ServedModel.check>`: the request
   held to the model's limits, the signed ones included (the API's own name for
   ``max_tokens`` in the message); :func:`prepare` is these two steps;
3. the prompt: a session's history trimmed to fit (:func:`session_prompt`), or a whole
   conversation counted (:func:`explicit_prompt`);
4. :func:`admit`: the checks every request meets, in one order (the server draining, the
   cluster's store, the audit log, the priority, the session busy, the context window, the
   tenant's quotas), then :func:`start`, which a takeover shares: the generation is registered
   and its task started.

Whatever refuses a call raises the :class:`~seedance.protocol.errors.SeedanceError` that says
why, and the API hands it to the one reporter
(:meth:`~seedance.server.lifecycle.refusals.Refusals.refuse`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import structs

from seedance.protocol.codec import FrameLimits, validate_generate
from seedance.protocol.errors import InvalidRequest, SessionBusy
from seedance.protocol.messages import Generate, RequestId
from seedance.protocol.qos import parse_qos
from seedance.server.lifecycle.generation import Generation, WithoutReaders
from seedance.server.lifecycle.request import (
    Prompt,
    Requester,
    check_fits,
    explicit_prompt,
    new_request_id,
    session_prompt,
    token_prompt,
)
from seedance.server.modules import modules_for
from seedance.tenants.auth import Principal

if TYPE_CHECKING:
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.refusals import Arrival
    from seedance.server.lifecycle.services import Services

__all__ = [
    "Prompt",
    "Requester",
    "admit",
    "admit_raw",
    "check_serving",
    "choose_model",
    "explicit_prompt",
    "new_request_id",
    "prepare",
    "session_prompt",
    "start",
    "token_prompt",
]


def choose_model(
    services: Services,
    principal: Principal,
    name: str | None,
    sticky: str | None = None,
    *,
    task: str | None = "generate",
    action: str | None = None,
) -> ServedModel:
    """The model ``name`` names (None: the default), the version of it ``sticky`` falls on (a
    canary's share), which ``principal`` must be allowed to ``action`` (the policies' name;
    default: ``task``, else ``use``), and which does ``task`` (``generate``; ``embed``; None:
    either)."""
    models = services.models
    model = models.resolve(name, sticky)
    action = action or task or "use"
    services.access.check_model(principal, model.name, model.version, models, action)
    if task is not None and model.engine.task != task:
        raise InvalidRequest(
            f"model {model.name} is an embedding model: it writes no text (POST /v1/embeddings)"
            if model.engine.task == "embed"
            else f"model {model.name} does not {task}"
        )
    return model


def prepare(
    services: Services,
    arrival: Arrival,
    name: str | None,
    sticky: str | None,
    message: Generate,
    *,
    unset: frozenset[str] = frozenset(),
    field: str = "max_tokens",
    schema_field: str = "schema",
) -> tuple[ServedModel, Generate]:
    """Steps 1 and 2 of the recipe (see the module): the model for ``arrival``'s caller, and
    ``message`` held to its limits (the fields the client left out, ``unset``, ``max_tokens``
    among them, moved inside them first; ``field`` and ``schema_field``: the API's names for
    ``max_tokens`` and ``schema``)."""
    assert arrival.principal is not None
    model = arrival.model = choose_model(services, arrival.principal, name, sticky)
    message = model.within_defaults(message, unset)
    return model, model.check(message, field=field, schema_field=schema_field)


def check_serving(services: Services) -> None:
    """The first checks of every request, generation or not: the server draining, the
    cluster's store, the audit log (the :class:`SeedanceError` that refuses it)."""
    services.shutdown.check()
    if services.cluster is not None:
        services.cluster.check()  # refused while the cluster's Redis does not answer
    services.audit.check()


def admit(
    services: Services,
    arrival: Arrival,
    requester: Requester,
    message: Generate,
    *,
    prompt: Prompt | None = None,
    without_readers: WithoutReaders | None = None,
) -> Generation:
    """Check a request and start its generation; raises the :class:`SeedanceError` that
    refuses it. The same checks, in the same order, for every API. Without ``prompt`` the
    request continues ``requester.session`` (its history trimmed to fit).
    ``without_readers``: what the generation does when its last reader leaves (by default
    ``grace`` for a resumable request, else ``abort``)."""
    check_serving(services)
    model = requester.model
    qos = parse_qos(message.qos) if message.qos is not None else requester.qos
    if qos is not None and message.priority == 0:
        # The class's priority, lowered to the tenant's highest (never refused for it).
        highest = requester.principal.tenant.max_priority
        message = structs.replace(message, priority=qos.priority_within(highest))
    arrival.policies = services.access.check_generation(
        requester.principal, model.name, model.version, services.models,
        priority=message.priority, qos=qos.service_class if qos is not None else "",
        tools=message.tools is not None, e2e=requester.e2e, peer=arrival.peer,
    )  # fmt: skip
    modules = modules_for(services.modules, requester.principal, message)
    session = requester.session
    if session is not None and session.active_request is not None:
        raise SessionBusy(
            f"request {session.active_request} is still running on this session; "
            "cancel it or wait for its done frame"
        )
    if prompt is None and message.prompt_ids is not None:
        prompt = token_prompt(model, message.prompt_ids)
    elif prompt is None:
        assert session is not None
        prompt = session_prompt(model, session, message)
    else:
        check_fits(model, prompt.tokens)
    usage = services.usage
    tenant = requester.tenant
    usage.start_request(
        tenant, requester.principal.tenant.quotas, prompt.tokens, message.max_tokens
    )
    try:
        request_id = RequestId(arrival.request_id or new_request_id())
        arrival.request_id = request_id
        # Nobody asks another node for a reply that is not resumable, continues no session and
        # ends with its reader (a stateless chat or completions call, a response not stored):
        # in a cluster it stays on its node, without a Redis exchange.
        shared = message.resumable or session is not None or without_readers not in (None, "abort")
        log = services.generations.open_log(requester, request_id, message, shared=shared)
        generation = Generation(
            services, arrival, requester, log, message, prompt, qos=qos,
            without_readers=without_readers, modules=modules,
        )  # fmt: skip
    except BaseException:
        usage.end_request(tenant, 0)
        raise
    return start(services, generation)


def admit_raw(
    services: Services,
    arrival: Arrival,
    principal: Principal,
    model: ServedModel,
    text: str,
    fields: dict[str, Any],
    *,
    stream: bool,
) -> Generation:
    """A generation of ``text`` continued as it is (the completions API's raw prompt), for the
    APIs that hand over one text and sampling ``fields`` (``max_tokens``, ``temperature``,
    ``top_p``, ``seed``, ...): the Open Inference Protocol, and modules through WASI-NN. Fields
    of the wrong type or out of range are refused naming them; left out, the server's defaults
    (and the model's, for the temperature and top_p) apply."""
    limits = FrameLimits(services.config.max_frame_bytes, model.limits.max_tokens)
    limits = limits.capped(principal.tenant.quotas.max_tokens)
    unset = frozenset(name for name in ("temperature", "top_p") if name not in fields)
    defaults = unset  # what prepare may move inside the model's limits
    if "max_tokens" not in fields:
        fields = {**fields, "max_tokens": limits.default_max_tokens()}
        defaults |= {"max_tokens"}
    try:
        message = msgspec.convert({**fields, "prompt": text, "stream": stream}, Generate)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc)) from None
    validate_generate(message, limits)
    served, message = prepare(
        services, arrival, model.name, arrival.request_id, message, unset=defaults
    )
    prompt = explicit_prompt(served, tuple(message.turns()), raw=True, unset=unset)
    requester = Requester(principal, served, "http")
    return admit(services, arrival, requester, message, prompt=prompt)


def start(services: Services, generation: Generation) -> Generation:
    """An admitted generation (or one taken over from a dead node) starts: its session is
    busy with it, and its task runs."""
    session = generation.requester.session
    if session is not None:
        session.begin(generation.request_id)
    services.generations.add(generation)
    return generation
