"""Comparing embedding vectors with the reference's."""

from __future__ import annotations

from typing import Any

import numpy as np


def cosine(a: Any, b: Any) -> Any:
    """The cosine similarity of ``a`` and ``b`` (vectors, or rows of vectors)."""
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
