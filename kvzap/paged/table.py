"""The host-side block table of the compact cache: which blocks each head owns, where each position is stored.

Everything here is numpy and Python lists on the host, as in serving engines that compute slot mappings on the
CPU and ship them with each step: a decoding step's bookkeeping is a few Python operations, and the device
only ever receives index arrays computed here. Nothing in this module reads a device tensor.

Vocabulary: a *head* is one (batch row, KV head) pair, index ``i = b * kv_heads + h``; a *block* is
``block_size`` consecutive *slots* of the pool; a slot's *flat* index is ``block * block_size + offset``.

Invariants (checked by ``tests/paged/test_table.py`` and the property test of ``tests/test_compact.py``):

- each head owns an ordered list of blocks (``blocks[i]``) and fills their slots in order: its slots
  ``0 .. end[i] - 1`` (local numbering across its blocks) have been written, the rest are fresh;
- a block belongs to at most one head; the blocks in use are exactly ``0 .. n_used - 1`` (blocks are taken in
  order and only a repack, which rebuilds the table, gives them back), so attention reads a prefix of the pool;
- ``slot[i, p]`` is the flat slot holding head ``i``'s pair at absolute position ``p``, or -1 when that pair
  is not stored (evicted, cropped, or not yet seen); ``n[i]`` counts the stored pairs of head ``i``;
- ``holes[i]`` lists slots of head ``i`` written earlier whose pair was evicted: the next appends of the head
  fill them before fresh slots.

The table may lag behind the device by the evictions the layer has applied on the device but not yet reported
(see :class:`kvzap.compact.CompactLayer`): such a pair still has its slot here, and its slot is not a hole yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["BlockTable", "PackPlan"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PackPlan:
    """Where each live pair goes when a pool is rebuilt with every head's pairs in consecutive blocks.

    Attributes
    ----------
    src : ``(N,)`` int64, index of each pair in the source (flat slots of the old pool, or flat rows of a dense
        ``(heads * q, d)`` tensor), head by head, in position order within a head.
    dst : ``(N,)`` int64, flat slot of each pair in the new pool.
    positions : ``(N,)`` int32, absolute position of each pair.
    counts : ``(heads,)`` pairs per head of the new layout.
    n_blocks : ``(heads,)`` blocks per head of the new layout.
    """

    src: np.ndarray
    dst: np.ndarray
    positions: np.ndarray
    counts: np.ndarray
    n_blocks: np.ndarray

    @property
    def owner(self) -> np.ndarray:
        """``(sum(n_blocks),)`` owning head of each block of the new layout."""
        return np.repeat(np.arange(len(self.n_blocks)), self.n_blocks)


@dataclass
class BlockTable:
    """Block lists, slot map, holes and counts of ``num_heads`` heads (see the module docstring)."""

    num_heads: int = 0
    block_size: int = 64
    blocks: list[list[int]] = field(default_factory=list)
    slot: np.ndarray = field(default_factory=lambda: np.full((0, 0), -1, dtype=np.int32))
    n: list[int] = field(default_factory=list)
    end: list[int] = field(default_factory=list)
    holes: list[list[int]] = field(default_factory=list)
    n_used: int = 0

    @classmethod
    def empty(cls, num_heads: int, block_size: int) -> BlockTable:
        return cls(
            num_heads=num_heads,
            block_size=block_size,
            blocks=[[] for _ in range(num_heads)],
            slot=np.full((num_heads, 64), -1, dtype=np.int32),
            n=[0] * num_heads,
            end=[0] * num_heads,
            holes=[[] for _ in range(num_heads)],
        )

    def copy(self) -> BlockTable:
        """An independent copy (for snapshots): later changes to either do not reach the other."""
        return BlockTable(
            num_heads=self.num_heads,
            block_size=self.block_size,
            blocks=[list(b) for b in self.blocks],
            slot=self.slot.copy(),
            n=list(self.n),
            end=list(self.end),
            holes=[list(h) for h in self.holes],
            n_used=self.n_used,
        )

    @property
    def nbytes(self) -> int:
        """Host bytes of the table: the slot map plus 8 bytes per list entry (an estimate of Python's ints)."""
        entries = sum(map(len, self.blocks)) + sum(map(len, self.holes)) + 2 * self.num_heads
        return self.slot.nbytes + 8 * entries

    def ensure_width(self, width: int) -> None:
        """Grow the slot map to cover positions ``0 .. width - 1`` (geometrically: amortised O(1) per token)."""
        if self.slot.shape[1] < width:
            new_width = max(width, self.slot.shape[1] * 9 // 8 + 64)
            pad = np.full((self.num_heads, new_width - self.slot.shape[1]), -1, dtype=np.int32)
            self.slot = np.concatenate([self.slot, pad], axis=1)

    def take_blocks(self, heads: list[int]) -> list[int]:
        """Give the next unused block to each head of ``heads`` (repeats allowed); returns the block ids."""
        ids = list(range(self.n_used, self.n_used + len(heads)))
        self.n_used += len(heads)
        for i, block in zip(heads, ids, strict=True):
            self.blocks[i].append(block)
        return ids

    # --- appends ----------------------------------------------------------------------------------------------
    def blocks_needed(self, q_len: int, use_holes: bool = True) -> list[int]:
        """Heads (repeated) that need a new block before ``q_len`` new pairs per head can be placed."""
        bs = self.block_size
        needing = []
        for i in range(self.num_heads):
            fresh = q_len - (min(q_len, len(self.holes[i])) if use_holes else 0)
            needing += [i] * max(_ceil_div(self.end[i] + fresh, bs) - len(self.blocks[i]), 0)
        return needing

    def place(self, seen: int, q_len: int, use_holes: bool = True) -> tuple[np.ndarray, bool]:
        """Choose the slots of ``q_len`` new pairs per head at positions ``seen ..`` and record them.

        Each head fills its holes first (unless ``use_holes`` is False), then fresh slots. The blocks must
        already be there (:meth:`blocks_needed`, :meth:`take_blocks`).

        Returns
        -------
        slots : ``(heads, q_len)`` int64 flat slots.
        reused : True when at least one slot is a hole (a slot written before).
        """
        bs = self.block_size
        slots = np.empty((self.num_heads, q_len), dtype=np.int64)
        reused = False
        for i in range(self.num_heads):
            k = min(q_len, len(self.holes[i])) if use_holes else 0
            if k:
                slots[i, :k] = self.holes[i][-k:]
                del self.holes[i][-k:]
                reused = True
            end, fresh = self.end[i], q_len - k
            if fresh == 1:  # the decoding step: plain arithmetic
                slots[i, k] = self.blocks[i][end // bs] * bs + end % bs
            elif fresh:
                local = np.arange(end, end + fresh)
                slots[i, k:] = np.asarray(self.blocks[i], dtype=np.int64)[local // bs] * bs + local % bs
            self.end[i] = end + fresh
            self.n[i] += q_len
        self.ensure_width(seen + q_len)
        self.slot[:, seen : seen + q_len] = slots
        return slots, reused

    # --- evictions --------------------------------------------------------------------------------------------
    def forget(self, heads: np.ndarray, positions: np.ndarray, as_holes: bool = True) -> None:
        """Record that head ``heads[k]``'s pair at ``positions[k]`` is gone; its slot becomes a hole.

        Each (head, position) must currently be stored.
        """
        slots = self.slot[heads, positions]
        self.slot[heads, positions] = -1
        for i, s in zip(heads.tolist(), slots.tolist(), strict=True):
            self.n[i] -= 1
            if as_holes:
                self.holes[i].append(s)

    def holes_pile_up(self) -> bool:
        """True when the holes exceed a block and 1/32 of the stored pairs: time to pack the pool."""
        return sum(map(len, self.holes)) > max(self.block_size, sum(self.n) // 32)

    # --- repacking ----------------------------------------------------------------------------------------------
    def pack_plan(self, seen: int, rows: list[int] | None = None) -> PackPlan:
        """Plan a repack of the stored pairs of positions ``0 .. seen - 1``; ``rows[i]`` is the old head that new
        head ``i`` copies (batch reorders; None keeps the heads). Sources are flat slots of the current pool."""
        slot = self.slot[:, :seen]
        if rows is not None:
            slot = slot[np.asarray(rows, dtype=np.int64)]
        head, pos = np.nonzero(slot >= 0)  # row-major: head by head, positions in order
        return self._plan(slot.shape[0], head, pos, slot[head, pos].astype(np.int64))

    def dense_plan(self, keep: np.ndarray, offset: int = 0) -> PackPlan:
        """Plan the first write of a dense ``(heads, q)`` set of pairs at positions ``offset ..``, keeping those
        where ``keep`` is True. Sources are flat rows ``i * q + j`` of the dense tensor."""
        heads, q_len = keep.shape
        head, j = np.nonzero(keep)
        return self._plan(heads, head, j + offset, head.astype(np.int64) * q_len + j)

    def _plan(self, heads: int, head: np.ndarray, pos: np.ndarray, src: np.ndarray) -> PackPlan:
        bs = self.block_size
        counts = np.bincount(head, minlength=heads).astype(np.int64)
        n_blocks = -(-counts // bs)
        first = np.cumsum(counts) - counts
        local = np.arange(len(head), dtype=np.int64) - first[head]
        block_start = np.cumsum(n_blocks) - n_blocks
        dst = (block_start[head] + local // bs) * bs + local % bs
        return PackPlan(src=src, dst=dst, positions=pos.astype(np.int32), counts=counts, n_blocks=n_blocks)

    def adopt(self, plan: PackPlan, seen: int) -> None:
        """Become the table of a pool just rebuilt from ``plan`` (no holes, consecutive blocks per head)."""
        heads = len(plan.counts)
        starts = np.concatenate([[0], np.cumsum(plan.n_blocks)]).tolist()
        self.num_heads = heads
        self.blocks = [list(range(starts[i], starts[i + 1])) for i in range(heads)]
        self.n_used = starts[-1]
        self.n = plan.counts.tolist()
        self.end = list(self.n)
        self.holes = [[] for _ in range(heads)]
        self.slot = np.full((heads, max(seen, 1) + 64), -1, dtype=np.int32)
        head = np.repeat(np.arange(heads), plan.counts)
        self.slot[head, plan.positions] = plan.dst

    # --- reads ------------------------------------------------------------------------------------------------
    def capacities(self) -> np.ndarray:
        """``(heads,)`` slots held by each head: its blocks times the block size."""
        return np.array([len(b) * self.block_size for b in self.blocks], dtype=np.int64)

    def head_slots(self, i: int) -> np.ndarray:
        """All flat slots of head ``i``'s blocks, in order."""
        blocks = np.asarray(self.blocks[i], dtype=np.int64)
        return (blocks[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
