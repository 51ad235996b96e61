"""``POST /v1/embeddings`` (body and answer: :mod:`seedance.protocol.embeddings`), on a served
embedding model (:class:`~seedance.engines.embeddings.EmbeddingEngine`).

An HTTP call like any other (:class:`~seedance.server.http_call.HttpCall`): the caller
authenticated before the body is read, the model resolved and allowed for the tenant, every
input checked whole before any is embedded (too long, empty, an unknown token id: a 400 naming
the input), then the checks a generation meets in the same order where they apply (the server
draining, the audit log, the tenant's quotas: a request and its input tokens count against the
tenant's rates), the model's own admission queue, and the engine's batches. A refusal is
reported by the one reporter; an answer is audited with its input tokens and counted in
``seedance_requests_total`` and ``seedance_prompt_tokens_total``.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from seedance.protocol.embeddings import decode_embeddings, embeddings_body
from seedance.protocol.errors import InvalidRequest
from seedance.server.http_call import JSON_HEADERS, HttpCall, Receive, Scope, Send
from seedance.server.lifecycle.admit import choose_model

if TYPE_CHECKING:
    from seedance.engines.embeddings import EmbeddingEngine
    from seedance.protocol.embeddings import EmbeddingsRequest
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.services import Services


class EmbeddingsEndpoint:
    """``POST /v1/embeddings``, as a plain ASGI app."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = HttpCall(self.services, scope, send, "embeddings", "emb-" + secrets.token_hex(12))
        await call.answer(receive, lambda body: self.run(call, body))

    async def run(self, call: HttpCall, body: bytes) -> None:
        services = self.services
        tenant = call.principal.tenant
        try:
            request = decode_embeddings(body)
            model = call.arrival.model = self._model(call, request.model)
            engine: EmbeddingEngine = model.engine  # type: ignore[assignment]
            rows = _rows(engine, request)
            tokens = sum(len(row) for row in rows)
            services.shutdown.check()
            services.audit.check()
            services.usage.start_request(tenant.name, tenant.quotas, tokens, 0)
        except Exception as exc:
            await call.fail(exc)
            return
        try:
            await model.admission.acquire(0, tenant=tenant.name, weight=tenant.tier)
            try:
                vectors = await engine.embed(rows)
            finally:
                model.admission.release()
        except Exception as exc:
            await call.fail(exc)
            return
        finally:
            services.usage.end_request(tenant.name, 0)
        call.outcome, call.prompt_tokens = "embedded", tokens
        answer = embeddings_body(vectors, model.name, tokens, request.encoding_format)
        await call.response.respond(200, JSON_HEADERS, answer)

    def _model(self, call: HttpCall, name: str | None) -> ServedModel:
        """The embedding model ``name`` names (None: the first one served)."""
        models = self.services.models
        if name is None:
            name = next((n for n, m in models.items() if m.engine.task == "embed"), None)
            if name is None:
                raise InvalidRequest(
                    "no embedding model is served here (seedance serve --embedding-model)"
                )
        model = choose_model(models, call.principal, name, task=None)
        if model.engine.task != "embed":
            served = [n for n, m in models.items() if m.engine.task == "embed"]
            raise InvalidRequest(
                f"model {model.name} generates text and has no embeddings; "
                + (f"embedding models here: {', '.join(served)}" if served else
                   "no embedding model is served here (seedance serve --embedding-model)")
            )  # fmt: skip
        return model


def _rows(engine: EmbeddingEngine, request: EmbeddingsRequest) -> list[list[int]]:
    """Each input's tokens, every one checked before any is embedded."""
    if request.dimensions is not None and request.dimensions != engine.dimensions:
        raise InvalidRequest(
            f"dimensions: model {engine.info.name} makes vectors of {engine.dimensions} "
            "dimensions only (it was not trained to be cut shorter)"
        )
    rows = [engine.encode(item) if isinstance(item, str) else item for item in request.inputs]
    for index, row in enumerate(rows):
        engine.check_input(index, row)
    return rows
