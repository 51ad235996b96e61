"""An embedding request, whichever API asked for it (``POST /v1/embeddings``, the ``embed``
frame of ``/v2/infer``): written once.

1. the model: the embedding model the call names (None: the first one served), which its
   tenant must be allowed to use; a text model is refused by name;
2. every input whole, before any is embedded: tokens of a string, ids checked (too long,
   empty, an unknown id: an :class:`InvalidRequest` naming the input); ``dimensions`` only as
   the model's own;
3. the checks a generation meets where they apply, in the same order: the server draining,
   the cluster's store, the audit log (:func:`~seedance.server.lifecycle.admit.check_serving`,
   the same function), the tenant's quotas (a request and its input tokens count against its
   rates);
4. the model's own admission queue, then the engine's batches.

Whatever refuses the call raises the :class:`~seedance.protocol.errors.SeedanceError` that
says why, for the API to hand to the one reporter of refusals; an answer is the API's to report
(:meth:`~seedance.server.lifecycle.refusals.Refusals.answered`, with the tokens read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from seedance.protocol.errors import InvalidRequest
from seedance.server.lifecycle.admit import check_serving, choose_model

if TYPE_CHECKING:
    import numpy as np

    from seedance.engines.embeddings import EmbeddingEngine
    from seedance.protocol.embeddings import EmbeddingsRequest, Input
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.refusals import Arrival
    from seedance.server.lifecycle.services import Services
    from seedance.tenants.auth import Principal

NO_MODEL = "no embedding model is served here (seedance serve --embedding-model)"


@dataclass(frozen=True, slots=True)
class Embedded:
    model: ServedModel
    vectors: np.ndarray  # float32, a row per input
    tokens: int  # every input's, special tokens included


def embedding_model(services: Services, principal: Principal, name: str | None) -> ServedModel:
    """Step 1 (see the module)."""
    models = services.models
    if name is None:
        name = next((n for n, m in models.items() if m.engine.task == "embed"), None)
        if name is None:
            raise InvalidRequest(NO_MODEL)
    model = choose_model(services, principal, name, task=None, action="embed")
    if model.engine.task != "embed":
        served = [n for n, m in models.items() if m.engine.task == "embed"]
        raise InvalidRequest(
            f"model {model.name} generates text and has no embeddings; "
            + (f"embedding models here: {', '.join(served)}" if served else NO_MODEL)
        )
    return model


def token_rows(
    engine: EmbeddingEngine, inputs: tuple[Input, ...], dimensions: int | None
) -> list[list[int]]:
    """Step 2 (see the module): each input's tokens, every one checked."""
    if dimensions is not None and dimensions != engine.dimensions:
        raise InvalidRequest(
            f"dimensions: model {engine.info.name} makes vectors of {engine.dimensions} "
            "dimensions only (it was not trained to be cut shorter)"
        )
    rows = [engine.encode(item) if isinstance(item, str) else item for item in inputs]
    for index, row in enumerate(rows):
        engine.check_input(index, row)
    return rows


async def embed(services: Services, arrival: Arrival, request: EmbeddingsRequest) -> Embedded:
    """A vector for each of ``request``'s inputs (see the module); ``arrival`` names the
    caller and gets the model."""
    principal = arrival.principal
    assert principal is not None
    model = arrival.model = embedding_model(services, principal, request.model)
    engine = cast("EmbeddingEngine", model.engine)
    rows = token_rows(engine, request.inputs, request.dimensions)
    tokens = sum(len(row) for row in rows)
    check_serving(services)
    tenant = principal.tenant
    services.usage.start_request(tenant.name, tenant.quotas, tokens, 0)
    try:
        await model.admission.acquire(0, tenant=tenant.name, weight=tenant.tier)
        try:
            vectors = await engine.embed(rows)
        finally:
            model.admission.release()
    finally:
        services.usage.end_request(tenant.name, 0)
    return Embedded(model, vectors, tokens)
