"""Replies bound to a JSON Schema, for the engines that sample in this process (llguidance).

A request with a schema gets an ``LLMatcher``: the schema compiled to a grammar over the
model's own vocabulary. Each decode step, the matchers of the constrained requests compute
their token masks together (:class:`Masks`, llguidance's thread pool), the engine sets every
token a mask forbids to -inf in that request's logits before it samples, and the sampled token
advances the matcher (:meth:`~seedance.engines.batching.DecodeLoop._take`). A reply ends when
its document is whole. llguidance was chosen over llama.cpp's own grammar sampler by
measurement (docs/engines.md): on SmolLM2 with a 12-field schema, about 0.2 ms of mask per
token at 1 and at 8 streams, against about 10 ms for the grammar sampler.

The grammar is compiled from the schema's canonical text; what llguidance cannot enforce
(``not``, ``if``/``then``, ``uniqueItems``, ...) is refused before any token, by name
(:func:`check_schema`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import llguidance
import llguidance.numpy
import numpy as np
import numpy.typing as npt

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.schemas import OutputSchema

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: Compact JSON (no spaces between tokens): what a small model keeps to best, and fewest
#: tokens. A schema's own ``x-guidance`` options override it.
_COMPILE_OPTIONS: Final[JsonCompileOptions] = {"whitespace_flexible": False}


def grammar(schema: OutputSchema) -> str:
    """llguidance's grammar for what a reply is bound to."""
    return _grammar(schema.text, schema.kind)


@functools.lru_cache(maxsize=256)
def _grammar(text: str, kind: str) -> str:
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_COMPILE_OPTIONS)


@functools.lru_cache(maxsize=256)
def _unsupported(text: str, kind: str) -> str | None:
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar(text, kind))
    return messages[0] if failed and messages else ("not supported" if failed else None)


def check_schema(schema: OutputSchema, field: str) -> None:
    """Refuse a schema that llguidance cannot enforce, naming what it lacks
    (``Unimplemented keys: ["not"]``)."""
    why = _unsupported(schema.text, schema.kind)
    if why is not None:
        what = "these tools' parameters" if schema.kind == "lark" else "this schema"
        raise InvalidRequest(f"{field}: {what} cannot be enforced: {why}", param=field)


class Grammars:
    """Matchers for one model: its vocabulary as llguidance reads it, built once, on first use
    (about 0.25 s for SmolLM2's 49,152 tokens; thread-safe)."""

    def __init__(self, build: Callable[[], llguidance.LLTokenizer]) -> None:
        self._build = build
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._tokenizer is not None

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build()
            return self._tokenizer

    def matcher(self, schema: OutputSchema) -> llguidance.LLMatcher:
        """A fresh matcher for one reply (about 1 ms for a 12-field schema)."""
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar(schema), log_level=0)
        if matcher.is_error():  # check_schema let it through: llguidance's limits, say
            raise InvalidRequest(f"schema: this schema cannot be enforced: {matcher.get_error()}")
        return matcher


class Masks:
    """The token masks of one decode step, computed together in llguidance's threads."""

    def __init__(self) -> None:
        self._executor = llguidance.LLExecutor()
        self._bits = np.zeros((0, 0), dtype=np.int32)

    def fill(self, matchers: list[llguidance.LLMatcher], vocab_size: int) -> npt.NDArray[np.int32]:
        """One row of bits per matcher (bit ``t``: token ``t`` allowed)."""
        shape = (len(matchers), (vocab_size + 31) // 32)
        if self._bits.shape[0] < shape[0] or self._bits.shape[1] != shape[1]:
            self._bits = np.zeros((max(shape[0], 8), shape[1]), dtype=np.int32)
        bits = self._bits
        if len(matchers) == 1:  # no thread pool for one
            row = bits[0]
            matchers[0].unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        else:
            pairs = [(matcher, i) for i, matcher in enumerate(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bits)
        return bits[: shape[0]]


def forbidden(row: npt.NDArray[np.int32], n: int) -> npt.NDArray[np.bool_]:
    """The first ``n`` tokens' flags: true where ``row`` (a mask from :meth:`Masks.fill`)
    forbids the token."""
    allowed: npt.NDArray[np.uint8] = np.unpackbits(row.view(np.uint8), bitorder="little", count=n)
    return np.equal(allowed, 0)


def mask_logits(logits: npt.NDArray[np.float32], row: npt.NDArray[np.int32]) -> None:
    """Set the logits of the tokens ``row`` forbids to -inf, in place (tokens past the mask's
    vocabulary are forbidden too)."""
    n = min(len(logits), row.size * 32)
    np.putmask(logits[:n], forbidden(row, n), np.float32(-np.inf))
    logits[n:] = -np.inf
