"""Log probabilities of sampled tokens, from one row of the model's logits (in-process engines).

OpenAI's ``logprobs``: each reply token's log probability under the model and its
``top_logprobs`` likeliest alternatives, each with the token's text and UTF-8 bytes. They come
from the logits as the model computed them: before temperature, top-p or a schema's mask (what
vLLM calls ``raw_logprobs``), so the same reply has the same figures however it was sampled.

A row costs about 0.1 ms on a 49,152-token vocabulary (a float32 ``exp`` summed in float64, and
a partial sort for the alternatives): :class:`Logprobs` is made once per engine, and
:meth:`Logprobs.summary` runs before the row is masked, :meth:`Logprobs.entry` after sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from seedance.protocol.messages import TokenLogprob, TopLogprob

#: What :meth:`Logprobs.summary` keeps of a row: its log-sum-exp, the alternatives' ids and
#: their logits.
Summary = tuple[float, list[int], list[float]]


class Logprobs:
    """Entries for one model's vocabulary (``piece``: a token's bytes; ``text``: a special
    token's text, for tokens whose piece is empty)."""

    def __init__(self, piece: Callable[[int], bytes], text: Callable[[int], str]) -> None:
        self._piece = piece
        self._text = text

    def summary(self, logits: npt.NDArray[np.float32] | Any, top: int) -> Summary:
        """Of one row of raw logits (a NumPy array, or anything ``np.asarray`` takes):
        everything :meth:`entry` needs, taken before the row is changed."""
        row = np.asarray(logits, dtype=np.float32)
        peak = float(row.max())
        total = float(np.exp(row - peak).sum(dtype=np.float64))
        lse = peak + float(np.log(total))
        if top <= 0:
            return lse, [], []
        best = np.argpartition(row, -top)[-top:]
        best = best[np.argsort(-row[best], kind="stable")]
        return lse, best.tolist(), row[best].tolist()

    def entry(self, summary: Summary, token: int, logit: float) -> TokenLogprob:
        """The entry of sampled ``token`` (its raw ``logit``) at the row ``summary`` was of."""
        lse, ids, values = summary
        tops = [self._top(i, v - lse) for i, v in zip(ids, values, strict=True)]
        piece = self._bytes(token)
        return TokenLogprob(piece.decode("utf-8", "replace"), logit - lse, list(piece), tops)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        piece = self._bytes(token)
        return TopLogprob(piece.decode("utf-8", "replace"), logprob, list(piece))

    def _bytes(self, token: int) -> bytes:
        """A token's bytes; a special token's (end of turn, say) are its text's."""
        return self._piece(token) or self._text(token).encode()
