"""``POST /v1/embeddings``: OpenAI's request body and its answer.

Pure: bytes in, a validated :class:`EmbeddingsRequest` (or a :class:`SeedanceError`) out, and
vectors in, the answer's bytes out. ``input`` is a string, a list of strings, a list of token
ids or a list of such lists (at most :data:`MAX_INPUTS`, as OpenAI allows); ``encoding_format``
``float`` (lists of numbers) or ``base64`` (each vector's little-endian float32 bytes, which the
``openai`` package asks for by default and decodes itself); ``dimensions`` only as the model's
own size (a model trained to be cut, Matryoshka style, would be needed for fewer); ``user`` is
accepted and ignored.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.messages import EmbedFields
from seedance.protocol.openai import decode_body

#: Inputs in one request, at most (OpenAI's limit).
MAX_INPUTS: Final = 2048

Input = str | list[int]


class _EmbeddingsBody(EmbedFields, kw_only=True):
    user: str | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[Input, ...]  # text, or token ids
    encoding_format: Literal["float", "base64"]
    dimensions: int | None


_decoder = msgspec.json.Decoder(_EmbeddingsBody)


def decode_embeddings(body: bytes) -> EmbeddingsRequest:
    """A ``POST /v1/embeddings`` body."""
    return embeddings_request(decode_body(_decoder, body))


def embeddings_request(fields: EmbedFields) -> EmbeddingsRequest:
    """An embedding request's fields checked, the same for ``/v1/embeddings`` and the
    ``embed`` frame."""
    dimensions = fields.dimensions
    if dimensions is not None and dimensions < 1:
        raise InvalidRequest(f"dimensions: {dimensions} is not a positive size")
    return EmbeddingsRequest(
        fields.model, _inputs(fields.input), fields.encoding_format, dimensions
    )


def _inputs(raw: str | list[str | int | list[int]]) -> tuple[Input, ...]:
    """``input`` as the inputs it holds: one kind per list."""
    inputs: tuple[Input, ...]
    if isinstance(raw, str):
        inputs = (raw,)
    elif raw and all(isinstance(item, int) for item in raw):
        inputs = ([item for item in raw if isinstance(item, int)],)  # one input, as token ids
    elif all(isinstance(item, (str, list)) for item in raw):
        inputs = tuple(item for item in raw if not isinstance(item, int))
    else:
        raise InvalidRequest(
            "input: a string, a list of strings, a list of token ids or a list of such lists, "
            "not a mix of strings or lists and token ids"
        )
    if not inputs:
        raise InvalidRequest("input: give at least one input")
    for index, item in enumerate(inputs):
        if not item:
            raise InvalidRequest(f"input[{index}] is empty")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"input: {len(inputs)} inputs, at most {MAX_INPUTS} per request")
    return inputs


def vector(values: list[float], encoding: str) -> list[float] | str:
    """One vector as the answer carries it (``base64``: its little-endian float32 bytes)."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def embeddings_body(
    vectors: list[list[float]], model: str, prompt_tokens: int, encoding: str
) -> bytes:
    """The answer: each vector in its input's order, and the tokens read."""
    return msgspec.json.encode(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": vector(v, encoding)}
                for i, v in enumerate(vectors)
            ],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
