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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import msgspec
import numpy as np

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
    encoding_format: Literal["float", "base64", "tensor"]  # tensor: the embed frame's only
    dimensions: int | None


_decoder = msgspec.json.Decoder(_EmbeddingsBody)


def decode_embeddings(body: bytes) -> EmbeddingsRequest:
    """A ``POST /v1/embeddings`` body."""
    return embeddings_request(decode_body(_decoder, body))


def embeddings_request(
    fields: EmbedFields, token_rows: Sequence[list[int]] | None = None
) -> EmbeddingsRequest:
    """An embedding request's fields checked, the same for ``/v1/embeddings`` and the
    ``embed`` frame; ``token_rows``: the inputs as token ids, from a tensor (the frame's
    ``input_tensor``) instead of ``input``."""
    dimensions = fields.dimensions
    if dimensions is not None and dimensions < 1:
        raise InvalidRequest(f"dimensions: {dimensions} is not a positive size")
    if token_rows is not None:
        if fields.input is not None:
            raise InvalidRequest("give input or input_tensor, not both")
        inputs = _inputs(list(token_rows), "input_tensor")
    elif fields.input is None:
        raise InvalidRequest("input: required")
    else:
        inputs = _inputs(fields.input)
    return EmbeddingsRequest(fields.model, inputs, fields.encoding_format, dimensions)


def _inputs(raw: str | list[str | int | list[int]], field: str = "input") -> tuple[Input, ...]:
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
        raise InvalidRequest(f"{field}: give at least one input")
    for index, item in enumerate(inputs):
        if not item:
            raise InvalidRequest(f"{field}[{index}] is empty")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"{field}: {len(inputs)} inputs, at most {MAX_INPUTS} per request")
    return inputs


def vector(values: np.ndarray, encoding: str) -> list[float] | str:
    """One vector (a float32 row) as the answer carries it (``base64``: its little-endian
    float32 bytes)."""
    if encoding == "base64":
        return base64.b64encode(values.astype("<f4", copy=False).tobytes()).decode()
    return values.tolist()  # type: ignore[no-any-return]


def embeddings_body(vectors: np.ndarray, model: str, prompt_tokens: int, encoding: str) -> bytes:
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
