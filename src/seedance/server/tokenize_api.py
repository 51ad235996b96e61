"""``POST /tokenize`` and ``POST /detokenize``, as vLLM and llama.cpp's ``llama-server`` serve
them (bodies and answers: :mod:`seedance.protocol.tokenize`), with the served model's own
tokenizer and chat template: a count from ``/tokenize`` of ``messages`` is the ``prompt_tokens``
a chat request with those messages reports.

Each is an HTTP call like any other (:class:`~seedance.server.http_call.HttpCall`): the caller
authenticated, the model resolved and allowed for the tenant, a refusal reported by the one
reporter, an answer audited. An engine without a tokenizer of its own (the synthetic engine,
gateway mode) is refused with a message that says so.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.tokenize import (
    check_tokens,
    decode_detokenize,
    decode_tokenize,
    detokenized,
    tokenized,
)
from seedance.server.http_call import JSON_HEADERS, HttpCall, Receive, Scope, Send
from seedance.server.lifecycle.admit import choose_model

if TYPE_CHECKING:
    from seedance.engines.base import Tokenizer
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.services import Services

Action = Literal["tokenize", "detokenize"]

_encode = msgspec.json.Encoder().encode


class TokenizeEndpoint:
    """``/tokenize`` or ``/detokenize`` (``action``), as a plain ASGI app."""

    def __init__(self, services: Services, action: Action) -> None:
        self.services = services
        self.action = action

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = HttpCall(self.services, scope, send, self.action, "tok-" + secrets.token_hex(12))
        await call.answer(receive, lambda body: self.run(call, body))

    async def run(self, call: HttpCall, body: bytes) -> None:
        try:
            answer = self._answer(call, body)
        except Exception as exc:
            await call.fail(exc)
            return
        call.outcome = self.action + "d"
        await call.response.respond(200, JSON_HEADERS, _encode(answer))

    def _answer(self, call: HttpCall, body: bytes) -> dict[str, Any]:
        if self.action == "detokenize":
            request = decode_detokenize(body)
            model, tokenizer = self._tokenizer(call, request.model)
            check_tokens(request.tokens, tokenizer.vocab_size, model.name)
            return detokenized(tokenizer.decode(request.tokens))
        asked = decode_tokenize(body)
        model, tokenizer = self._tokenizer(call, asked.model)
        if asked.text is not None:
            tokens = tokenizer.tokenize(asked.text, add_special=asked.special)
        else:
            tokens = tokenizer.chat(
                asked.messages, add_generation_prompt=asked.add_generation_prompt
            )
        strs = [tokenizer.decode((t,)) for t in tokens] if asked.token_strs or asked.pieces else []
        return tokenized(asked, tokens, model.context_length, strs)

    def _tokenizer(self, call: HttpCall, name: str | None) -> tuple[ServedModel, Tokenizer]:
        services = self.services
        model = call.arrival.model = choose_model(services, call.principal, name, task=None)
        tokenizer = model.engine.tokenizer()
        if tokenizer is None:
            raise InvalidRequest(
                f"model {model.name} is served by the {model.engine.info.engine} engine, "
                f"which has no tokenizer of its own to {self.action} with"
            )
        return model, tokenizer
