"""The KV cache of the sequences decoded together, left-padded to one length.

Rows join after their prompts were prefilled (together, left-padded, in one forward pass) and
leave when their replies end. Every row's cells are right-aligned in one transformers
``DynamicCache``; ``mask`` marks the real cells (1) and the padding (0), and ``positions`` holds
each row's next position, so padding changes neither attention nor rotary positions. When rows
leave, columns that are padding in every remaining row are cut off.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from seedance.config import ConfigError


def check_cache(cache: Any) -> None:
    """Rows can only be joined in full-attention caches (no sliding windows, no states)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(cache, DynamicCache) or not layers:
        raise ConfigError(
            f"the transformers engine batches full-attention models; this one keeps a "
            f"{type(cache).__name__}"
        )
    kinds = {type(layer).__name__ for layer in layers}
    if kinds != {DynamicLayer.__name__}:
        raise ConfigError(
            "the transformers engine batches full-attention models; this one has cache "
            f"layers of kind {', '.join(sorted(kinds))}"
        )


def _pad_left(tensor: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class PaddedBatch:
    """Rows of a batch: their cache, attention mask and next positions, and their owners."""

    def __init__(self) -> None:
        self.cache: Any = None  # a DynamicCache whose layers are all DynamicLayer
        self.mask: torch.Tensor | None = None  # [rows, columns], 1 for a real cell
        self.positions: torch.Tensor | None = None  # [rows]
        self.owners: list[Any] = []

    def __len__(self) -> int:
        return len(self.owners)

    @property
    def columns(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def join(
        self, cache: Any, mask: torch.Tensor, positions: torch.Tensor, owners: list[Any]
    ) -> None:
        """Add prefilled rows (their own cache and mask, left-padded among themselves)."""
        if self.cache is None or self.mask is None or self.positions is None:
            self.cache, self.mask, self.positions, self.owners = cache, mask, positions, owners
            return
        width = max(self.columns, int(mask.shape[1]))
        ours, theirs = width - self.columns, width - int(mask.shape[1])
        for layer, other in zip(self.cache.layers, cache.layers, strict=True):
            layer.keys = torch.cat(
                [_pad_left(layer.keys, ours, -2), _pad_left(other.keys, theirs, -2)]
            )
            layer.values = torch.cat(
                [_pad_left(layer.values, ours, -2), _pad_left(other.values, theirs, -2)]
            )
        self.mask = torch.cat([_pad_left(self.mask, ours, 1), _pad_left(mask, theirs, 1)])
        self.positions = torch.cat([self.positions, positions])
        self.owners = [*self.owners, *owners]

    def advance(self, mask: torch.Tensor) -> None:
        """A decode step appended one real cell to every row."""
        assert self.positions is not None
        self.mask = mask
        self.positions = self.positions + 1

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order); cut columns that became padding everywhere."""
        if len(rows) == len(self.owners):
            return
        if not rows or self.cache is None or self.mask is None or self.positions is None:
            self.clear()
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        real = mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:, :]
            layer.values = layer.values.index_select(0, index)[:, :, start:, :]
        self.mask = mask[:, start:]
        self.positions = self.positions.index_select(0, index)
        self.owners = [self.owners[i] for i in rows]

    def clear(self) -> None:
        self.cache = self.mask = self.positions = None
        self.owners = []
