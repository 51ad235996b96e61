"""``POST /v1/embeddings`` (body and answer: :mod:`seedance.protocol.embeddings`), on a served
embedding model (:class:`~seedance.engines.embeddings.EmbeddingEngine`; its tokens come from
``/tokenize`` with the model's name).

An HTTP call like any other (:class:`~seedance.server.http_call.HttpCall`): the caller
authenticated before the body is read, then the request as every API runs one
(:mod:`seedance.server.lifecycle.embed`). A refusal is reported by the one reporter; an answer
is audited with its input tokens and counted in ``seedance_requests_total`` and
``seedance_prompt_tokens_total``.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from seedance.protocol.embeddings import decode_embeddings, embeddings_body
from seedance.server.http_call import JSON_HEADERS, HttpCall, Receive, Scope, Send
from seedance.server.lifecycle.embed import embed

if TYPE_CHECKING:
    from seedance.server.lifecycle.services import Services


class EmbeddingsEndpoint:
    """``POST /v1/embeddings``, as a plain ASGI app."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = HttpCall(self.services, scope, send, "embeddings", "emb-" + secrets.token_hex(12))
        await call.answer(receive, lambda body: self.run(call, body))

    async def run(self, call: HttpCall, body: bytes) -> None:
        try:
            request = decode_embeddings(body)
            done = await embed(self.services, call.arrival, request)
        except Exception as exc:
            await call.fail(exc)
            return
        call.outcome, call.prompt_tokens = "embedded", done.tokens
        answer = embeddings_body(
            done.vectors, done.model.name, done.tokens, request.encoding_format
        )
        await call.response.respond(200, JSON_HEADERS, answer)
