"""The audit log as a Merkle tree, as RFC 9162 (Certificate Transparency 2.0) defines one.

Each record is a leaf: ``SHA-256(0x00 || entry)``, the entry being the record's whole JSON
with sorted keys and no spaces (the line the writer wrote, without its newline); an inner
node is ``SHA-256(0x01 || left || right)``, the left subtree holding the largest power of two
of leaves smaller than the node's. A tree of ``n`` records has one root, and two proofs anyone
can check with the root alone:

- an **inclusion proof** (RFC 9162 2.1.3): the hashes that, with a record's leaf, give the
  root of a tree of ``n``: the record is the ``m``-th of that tree;
- a **consistency proof** (2.1.4): the hashes that give both the root of a tree of ``m`` and
  that of ``n``: the larger tree only added records to the smaller one.

The writer keeps the tree's :class:`Frontier` (the roots of its complete subtrees, at most 64),
so a checkpoint's root costs nothing more than a leaf hash per record. A rotated-to file
starts with the frontier its records continue, so a file and the ones after it are enough to
build proofs of their records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(line: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + line).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than ``n`` (``n`` > 1): the left subtree's size."""
    return 1 << ((n - 1).bit_length() - 1)


class MissingRecords(Exception):
    """A proof needs records before the first one given (in an earlier file)."""


@dataclass
class Frontier:
    """The roots of a tree's complete subtrees, largest first: enough to append leaves and to
    compute the root. ``size`` leaves; the subtrees' sizes are the bits of ``size``."""

    size: int = 0
    hashes: list[bytes] = field(default_factory=list)

    def append(self, leaf: bytes) -> None:
        self.hashes.append(leaf)
        self.size += 1
        merges = (self.size & -self.size).bit_length() - 1  # the trailing zeros of size
        for _ in range(merges):
            right = self.hashes.pop()
            self.hashes.append(node_hash(self.hashes.pop(), right))

    def root(self) -> bytes:
        if not self.hashes:
            return EMPTY_ROOT
        root = self.hashes[-1]
        for left in reversed(self.hashes[:-1]):
            root = node_hash(left, root)
        return root

    def copy(self) -> Frontier:
        return Frontier(self.size, list(self.hashes))

    def blocks(self) -> dict[tuple[int, int], bytes]:
        """Each complete subtree as ``(first leaf, end)``: its root."""
        found, start = {}, 0
        for bit, root in zip(
            (b for b in reversed(range(self.size.bit_length())) if self.size >> b & 1),
            self.hashes,
            strict=True,
        ):
            found[(start, start + (1 << bit))] = root
            start += 1 << bit
        return found


class Tree:
    """A tree of records to prove things about: the leaves from ``base.size`` on, after the
    complete subtrees of a :class:`Frontier` (empty: the whole log from its first record)."""

    def __init__(self, leaves: Sequence[bytes], base: Frontier | None = None) -> None:
        self.base = base or Frontier()
        self.leaves = leaves
        self._blocks = self.base.blocks()

    @property
    def size(self) -> int:
        return self.base.size + len(self.leaves)

    def root(self, n: int | None = None) -> bytes:
        """The root of the tree of the first ``n`` records (all of them by default)."""
        n = self.size if n is None else n
        if not 0 <= n <= self.size:
            raise ValueError(f"a tree of {n} records; the log has {self.size}")
        return EMPTY_ROOT if n == 0 else self._hash(0, n)

    def inclusion(self, m: int, n: int) -> list[bytes]:
        """RFC 9162's PATH(m, D[n]): record ``m`` is in the tree of ``n``."""
        if not 0 <= m < n <= self.size:
            raise ValueError(f"record {m} of a tree of {n}: the log has {self.size}")
        return self._path(m, 0, n)

    def consistency(self, m: int, n: int) -> list[bytes]:
        """RFC 9162's PROOF(m, D[n]): the tree of ``n`` extends that of ``m``."""
        if not 0 < m <= n <= self.size:
            raise ValueError(f"trees of {m} and {n} records: the log has {self.size}")
        return self._subproof(m, 0, n, True)

    def _hash(self, lo: int, hi: int) -> bytes:
        known = self._blocks.get((lo, hi))
        if known is not None:
            return known
        if hi - lo == 1:
            if lo < self.base.size:  # inside a subtree of the frontier
                raise MissingRecords(f"record {lo} is in an earlier file")
            return self.leaves[lo - self.base.size]
        k = _split(hi - lo)
        return node_hash(self._hash(lo, lo + k), self._hash(lo + k, hi))

    def _path(self, m: int, lo: int, hi: int) -> list[bytes]:
        if hi - lo == 1:
            return []
        k = _split(hi - lo)
        if m < k:
            return [*self._path(m, lo, lo + k), self._hash(lo + k, hi)]
        return [*self._path(m - k, lo + k, hi), self._hash(lo, lo + k)]

    def _subproof(self, m: int, lo: int, hi: int, whole: bool) -> list[bytes]:
        if m == hi - lo:
            return [] if whole else [self._hash(lo, hi)]
        k = _split(hi - lo)
        if m <= k:
            return [*self._subproof(m, lo, lo + k, whole), self._hash(lo + k, hi)]
        return [*self._subproof(m - k, lo + k, hi, False), self._hash(lo, lo + k)]


def verify_inclusion(leaf: bytes, m: int, n: int, path: Sequence[bytes], root: bytes) -> bool:
    """RFC 9162 2.1.3.2: whether ``path`` proves leaf ``m`` in the tree of ``n`` with
    ``root``."""
    if not 0 <= m < n:
        return False
    fn, sn, r = m, n - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(m: int, n: int, path: Sequence[bytes], first: bytes, second: bytes) -> bool:
    """RFC 9162 2.1.4.2: whether ``path`` proves that the tree of ``n`` with root ``second``
    extends the tree of ``m`` with root ``first``."""
    if not 0 < m <= n:
        return False
    if m == n:
        return not path and first == second
    proof = list(path)
    if m & (m - 1) == 0:  # a power of two: the first tree is a subtree, its root the start
        proof.insert(0, first)
    if not proof:
        return False
    fn, sn = m - 1, n - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = proof[0]
    for c in proof[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while fn and not fn & 1:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == first and sr == second
