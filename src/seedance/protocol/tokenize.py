"""``POST /tokenize`` and ``POST /detokenize``: the bodies vLLM and llama.cpp's ``llama-server``
take, and the answers both kinds of client read.

Pure: bytes in, a validated request (or a :class:`SeedanceError`) out; the server answers with
:func:`tokenized` and :func:`detokenized`.

- ``/tokenize`` reads special-token text (``<|im_start|>``) as those tokens, as both servers
  do, and takes one of ``prompt`` (vLLM: ``add_special_tokens``, BOS, default true),
  ``messages`` (vLLM: rendered with the model's chat template, ``add_generation_prompt``
  default true, and tokenized exactly as a chat request's prompt is) or ``content``
  (``llama-server``: ``add_special``, default false; ``with_pieces``). The answer holds
  ``count``, ``max_model_len`` and ``tokens`` (vLLM's), ``token_strs`` with
  ``return_token_strs``, and with ``with_pieces`` each token as ``{"id", "piece"}``
  (``llama-server``'s).
- ``/detokenize`` takes ``tokens``; the answer holds the text as ``prompt`` (vLLM) and
  ``content`` (``llama-server``).

Unknown fields are refused by name rather than ignored: a ``chat_template`` or ``tools`` the
server does not apply would give a count that is wrong without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import ChatMessage
from seedance.protocol.openai import Message, chat_message, decode_body


class _TokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    content: str | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    add_special: bool | None = None
    with_pieces: bool = False


class _DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Tokenize:
    """What to tokenize: ``text`` as it is (special-token text read as those tokens;
    ``special``: BOS too, where the model wants it), or ``messages`` in the chat template."""

    model: str | None
    text: str | None
    messages: tuple[ChatMessage, ...]
    special: bool
    add_generation_prompt: bool
    token_strs: bool
    pieces: bool


@dataclass(frozen=True, slots=True)
class Detokenize:
    model: str | None
    tokens: tuple[int, ...]


_tokenize_decoder = msgspec.json.Decoder(_TokenizeBody)
_detokenize_decoder = msgspec.json.Decoder(_DetokenizeBody)


def decode_tokenize(body: bytes) -> Tokenize:
    parsed: _TokenizeBody = decode_body(_tokenize_decoder, body)
    given = [
        name for name in ("prompt", "messages", "content") if getattr(parsed, name) is not None
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "give one of prompt, messages (vLLM's) or content (llama-server's), "
            + (f"not {' and '.join(given)}" if given else "none was given")
        )
    if parsed.add_special is not None and parsed.content is None:
        raise InvalidRequest("add_special goes with content; with prompt, add_special_tokens")
    if parsed.add_special_tokens is not None and parsed.content is not None:
        raise InvalidRequest("add_special_tokens goes with prompt; with content, add_special")
    messages: tuple[ChatMessage, ...] = ()
    if parsed.messages is not None:
        messages = tuple(chat_message(i, m) for i, m in enumerate(parsed.messages))
        if not messages:
            raise InvalidRequest("messages must hold at least one message")
    if parsed.content is not None:
        special = bool(parsed.add_special)
    else:
        special = parsed.add_special_tokens is not False
    return Tokenize(
        model=parsed.model,
        text=parsed.prompt if parsed.prompt is not None else parsed.content,
        messages=messages,
        special=special,
        add_generation_prompt=parsed.add_generation_prompt,
        token_strs=parsed.return_token_strs,
        pieces=parsed.with_pieces,
    )


def decode_detokenize(body: bytes) -> Detokenize:
    parsed: _DetokenizeBody = decode_body(_detokenize_decoder, body)
    return Detokenize(model=parsed.model, tokens=tuple(parsed.tokens))


def check_tokens(
    tokens: Sequence[int],
    vocab_size: int,
    model: str,
    field: str = "tokens",
    param: str | None = None,
) -> None:
    """Every id within the model's vocabulary, or an :class:`InvalidRequest` naming the first
    that is not (as ``field[index]``; ``param``: the request field the error names)."""
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"{field}[{index}]: {token} is not a token of model {model} "
                f"(its vocabulary holds ids 0 to {vocab_size - 1})",
                param=param,
            )


def tokenized(
    request: Tokenize, tokens: list[int], max_model_len: int, strs: Sequence[str]
) -> dict[str, Any]:
    """The answer to ``request``: ``strs`` are each token's text (asked for with
    ``return_token_strs`` or ``with_pieces``)."""
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": max_model_len}
    if request.pieces:
        answer["tokens"] = [{"id": t, "piece": s} for t, s in zip(tokens, strs, strict=True)]
    else:
        answer["tokens"] = tokens
    if request.token_strs:
        answer["token_strs"] = list(strs)
    return answer


def detokenized(text: str) -> dict[str, str]:
    return {"prompt": text, "content": text}
