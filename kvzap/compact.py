"""Compact storage: evicted KV pairs are physically freed, in per-head pages (blocks) of a shared pool.

:class:`CompactLayer` implements the :class:`~kvzap.cache.PrunableLayer` interface for full-attention layers.
KV heads keep very different numbers of pairs (measured on SmolLM2-135M at 4k tokens and ~68% eviction: 3% to
100% per head; padding every head of a layer to its busiest one would store 0.49 of the full cache for 0.32
kept), so the layout must not pad heads to a common length. It is paged, like a serving engine's KV cache:

- a pool of ``num_blocks`` blocks of ``block_size`` slots: ``keys (num_blocks, block_size, d)``, ``values``,
  ``positions (num_blocks, block_size)`` (absolute position of the pair in each slot) and ``valid``;
- every (batch row ``b``, KV head ``h``), index ``i = b * kv_heads + h``, owns an ordered list of blocks (its
  row of the block table) and ``n_i`` live pairs that fill the first ``n_i`` slots of those blocks; a block
  belongs to one head at a time (``owner``), free blocks wait in a free list;
- a slot map ``(heads, seen)`` gives the slot of every stored (head, position), so evicting a given position
  is O(1), never a search.

Operations, all vectorised over heads (no Python loop over heads in decoding):

- **Append** writes the new pairs at local slots ``n_i ..`` of every head; a head whose last block is full
  takes a block from the free list (the pool grows by 1/8 when it runs out: amortised O(1) per token).
- **Evict** of a few positions (decoding: the token leaving the sliding window) moves each head's last live
  pair into the freed slot (swap-remove), so live slots stay a prefix and a block emptied by it returns to the
  free list for any head to reuse. Larger evictions (the prefill's) repack the pool, trimmed to the live
  pairs plus about 3%.
- **Attention** reads the blocks as a batch: one batched matmul of each block's keys with the queries of its
  owner head, a softmax split over blocks and merged per head with a max and a sum reduction (the split-K
  scheme of flash decoding), one batched matmul with the values. Causal masks of multi-token steps come from
  the stored positions, so they are exact whatever was evicted.
- **Snapshots** share the key/value pool with the live cache; the small tensors (positions, tables) are
  copied. A later write into a slot that a snapshot still sees copies the pool first (copy on write).

Sliding-window layers (Mistral, Gemma3 local layers) keep the masked storage: their window already bounds
their size. :func:`compact_layer_like` picks the storage per layer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from kvzap._compat import DynamicLayer, crop_count
from kvzap.cache import PrunableLayer, prunable_layer_like

__all__ = ["CompactLayer", "compact_layer_like", "DEFAULT_BLOCK_SIZE"]

#: Slots per block. Small enough that the partly filled last block of each head wastes little (on average half
#: a block per head: 1.5 MB for SmolLM2-135M in fp32), large enough that the batched matmuls over blocks stay
#: efficient (measured on 2 CPU threads, 8.7k kept pairs: 64 slots was 2-3x faster than 16 or 32).
DEFAULT_BLOCK_SIZE = 64

# Logits held at once by a multi-token attention call (elements): query positions are processed in groups so
# that (slots x query rows) stays below this (16M floats, 64 MB in fp32).
_ATTEND_SCRATCH = 1 << 24

# Evictions of at most this many positions per call use swap-remove; more repack the pool.
_SWAP_REMOVE_MAX = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class CompactLayer(PrunableLayer, DynamicLayer):
    """A full-attention cache layer holding only the kept pairs of every (batch row, KV head), in blocks.

    ``update`` returns the new pairs: on the first forward they are the whole cache and transformers' own sdpa
    reads them (dense prefill); afterwards :meth:`attend` reads this layer's blocks.
    ``get_seq_length()`` is the number of tokens seen, so position ids and mask sizes are those of an unpruned
    cache.

    Parameters
    ----------
    block_size : int, default :data:`DEFAULT_BLOCK_SIZE`
        Slots per block.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, **kwargs):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
        super().__init__(**kwargs)
        self.block_size = block_size
        self._init_compact()

    def _init_compact(self) -> None:
        self._init_prunable()
        self._bsz = 0
        self._heads = 0
        self._nh = 0  # batch rows x KV heads
        self._kb = self._vb = None  # (num_blocks, block_size, d) pools
        self._pb = None  # (num_blocks, block_size) long: absolute positions (0 in free slots)
        self._valid = None  # (num_blocks, block_size) bool: slot holds a live pair
        self._owner = None  # (num_blocks,) long: owning head, or _nh for a free block
        self._routing_cache = None  # see _routing
        self._table = None  # (nh, max_blocks) long: block ids of each head in order (0 past its blocks)
        self._slot = None  # (nh, positions capacity) int32: flat slot of (head, position), -1 if not stored
        self._n: list[int] = []  # live pairs per head (host-side: slots are computed on the host)
        self._blocks: list[list[int]] = []  # host copy of the block table rows
        self._free: list[int] = []  # free block ids
        self._first_forward = True  # the new pairs of the first update are the whole cache
        # id(key pool) -> (weak reference to it, slots a snapshot still sees); not part of snapshots.
        self._protected: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    # --- pool helpers -------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return 0 if self._kb is None else self._kb.shape[0]

    def _new_pool(self, num_blocks: int) -> None:
        """Fresh, empty pool tensors of ``num_blocks`` blocks (zero-filled: masked slots must stay finite)."""
        bs, dev = self.block_size, self.device
        self._kb = self.keys.new_zeros(num_blocks, bs, self.keys.shape[-1])
        self._vb = self.values.new_zeros(num_blocks, bs, self.values.shape[-1])
        self._pb = torch.zeros(num_blocks, bs, dtype=torch.long, device=dev)
        self._valid = torch.zeros(num_blocks, bs, dtype=torch.bool, device=dev)
        self._owner = torch.full((num_blocks,), self._nh, dtype=torch.long, device=dev)
        self._routing_cache = None

    def _grow_pool(self, needed: int) -> None:
        """Add free blocks so that at least ``needed`` are free (geometric growth: amortised O(1) per pair)."""
        missing = needed - len(self._free)
        if missing <= 0:
            return
        old = self.num_blocks
        extra = max(missing, old // 8 + 2)
        bs = self.block_size
        self._kb = torch.cat([self._kb, self._kb.new_zeros(extra, bs, self._kb.shape[-1])])
        self._vb = torch.cat([self._vb, self._vb.new_zeros(extra, bs, self._vb.shape[-1])])
        self._pb = torch.cat([self._pb, self._pb.new_zeros(extra, bs)])
        self._valid = torch.cat([self._valid, self._valid.new_zeros(extra, bs)])
        self._owner = torch.cat([self._owner, self._owner.new_full((extra,), self._nh)])
        self._routing_cache = None
        self._free[:0] = range(old, old + extra)  # blocks are taken from the end: recently freed ones first

    def _ensure_table_width(self, width: int) -> None:
        if self._table.shape[1] < width:
            pad = self._table.new_zeros(self._nh, max(width, self._table.shape[1] * 9 // 8 + 4) - self._table.shape[1])
            self._table = torch.cat([self._table, pad], dim=1)

    def _ensure_slot_width(self, width: int) -> None:
        if self._slot.shape[1] < width:
            new_width = max(width, self._slot.shape[1] * 9 // 8 + 64)
            pad = self._slot.new_full((self._nh, new_width - self._slot.shape[1]), -1)
            self._slot = torch.cat([self._slot, pad], dim=1)

    def _writable(self, slots: torch.Tensor) -> None:
        """Copy the key/value pools before writing at flat ``slots`` if a snapshot still sees one of them."""
        entry = self._protected.get(id(self._kb))
        if entry is None or entry[0]() is not self._kb:
            return
        if bool(entry[1].view(-1)[slots].any()):
            self._kb, self._vb = self._kb.clone(), self._vb.clone()

    def _routing(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block, the head whose queries it meets ``(nb,)`` (free blocks: any head, their slots are masked),
        and the ``(heads, blocks)`` ownership matrix, as bool and float32. Cached until the owners change (a
        block taken or freed)."""
        if self._routing_cache is None:
            heads = torch.arange(self._nh, device=self.device)
            owns = self._owner[None, :] == heads[:, None]
            self._routing_cache = (self._owner.clamp_max(self._nh - 1), owns, owns.float())
        return self._routing_cache

    def _head_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(nh, max_blocks * block_size)`` flat slots of each head's blocks, and whether each is one of them."""
        bs = self.block_size
        width = max((len(b) for b in self._blocks), default=0)
        n_blocks = torch.tensor([len(b) for b in self._blocks], dtype=torch.long, device=self.device)
        table = self._table[:, :width]
        slots = (table[:, :, None] * bs + torch.arange(bs, device=self.device)).reshape(self._nh, width * bs)
        owned = (torch.arange(width, device=self.device)[None, :] < n_blocks[:, None]).repeat_interleave(bs, dim=1)
        return slots, owned

    def _drop_and_repack(self, slots: torch.Tensor) -> None:
        """Forget the pairs in flat ``slots`` and repack (the repack rebuilds the slot map from the live pairs)."""
        self._valid.view(-1)[slots] = False
        self._repack()

    def _repack(self, rows: list[int] | None = None, slack: bool = True) -> None:
        """Rebuild the pool with each head's live pairs packed into its own consecutive blocks.

        Parameters
        ----------
        rows : for each head of the new layout, the head it copies (batch operations); None keeps the heads.
        slack : keep about 3% free blocks for the pairs to come.
        """
        bs, dev = self.block_size, self.device
        slots, owned = self._head_slots()
        live = owned & self._valid.view(-1)[slots]  # (nh, width)
        if rows is not None:
            index = torch.tensor(rows, dtype=torch.long, device=dev)
            slots, live = slots.index_select(0, index), live.index_select(0, index)
        new_nh = slots.shape[0]
        counts = live.sum(1)
        n = counts.tolist()
        src = slots[live]  # flat slots of the live pairs, head by head
        head = torch.repeat_interleave(torch.arange(new_nh, device=dev), counts)
        first = torch.cumsum(counts, 0) - counts
        local = torch.arange(src.numel(), device=dev) - first[head]
        n_blocks = [_ceil_div(c, bs) for c in n]
        block_start = torch.tensor([0] + n_blocks[:-1], dtype=torch.long, device=dev).cumsum(0)
        dst = (block_start[head] + local // bs) * bs + local % bs
        used = sum(n_blocks)
        spare = (used // 32 + 1) if slack else 0

        keys, values, positions = self._kb.view(-1, self._kb.shape[-1]), self._vb.view(-1, self._vb.shape[-1]), self._pb
        src_pos = positions.view(-1)[src]
        self._nh = new_nh
        self._new_pool(used + spare)
        self._kb.view(-1, self._kb.shape[-1])[dst] = keys[src]
        self._vb.view(-1, self._vb.shape[-1])[dst] = values[src]
        self._pb.view(-1)[dst] = src_pos
        self._valid.view(-1)[dst] = True
        self._owner[:used] = torch.repeat_interleave(
            torch.arange(new_nh, device=dev), torch.tensor(n_blocks, dtype=torch.long, device=dev)
        )
        starts = [0]
        for c in n_blocks:
            starts.append(starts[-1] + c)
        self._blocks = [list(range(starts[i], starts[i + 1])) for i in range(new_nh)]
        self._free = list(range(used, used + spare))
        width = max(n_blocks, default=0) + 4
        self._table = torch.zeros(new_nh, width, dtype=torch.long, device=dev)
        for i, blocks in enumerate(self._blocks):
            if blocks:
                self._table[i, : len(blocks)] = torch.arange(blocks[0], blocks[-1] + 1, device=dev)
        self._slot = torch.full((new_nh, max(self.seen, 1) + 64), -1, dtype=torch.int32, device=dev)
        self._slot[head, src_pos] = dst.to(torch.int32)
        self._n = n

    # --- transformers cache layer ------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, n_heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.is_initialized = True
        # transformers reads dtype/device off these; the pairs themselves live in the block pool.
        self.keys = key_states.new_empty(bsz, n_heads, 0, head_dim)
        self.values = value_states.new_empty(bsz, n_heads, 0, value_states.shape[-1])
        self._bsz, self._heads, self._nh = bsz, n_heads, bsz * n_heads
        self._new_pool(0)
        self._table = torch.zeros(self._nh, 4, dtype=torch.long, device=self.device)
        self._slot = torch.full((self._nh, 64), -1, dtype=torch.int32, device=self.device)
        self._n = [0] * self._nh
        self._blocks = [[] for _ in range(self._nh)]
        self._free = []
        self.n_evicted = torch.zeros(bsz, n_heads, dtype=torch.long, device=self.device)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        q_len = key_states.shape[2]
        bs, dev = self.block_size, self.device
        # New blocks for the heads whose last block fills up (host-side bookkeeping, few device writes).
        wanted = [_ceil_div(n + q_len, bs) - len(blocks) for n, blocks in zip(self._n, self._blocks, strict=True)]
        total = sum(w for w in wanted if w > 0)
        if total:
            self._grow_pool(total)
            self._ensure_table_width(max(len(b) + w for b, w in zip(self._blocks, wanted, strict=True)))
            heads, cols, ids = [], [], []
            for i, w in enumerate(wanted):
                for _ in range(w):
                    block = self._free.pop()
                    heads.append(i), cols.append(len(self._blocks[i])), ids.append(block)
                    self._blocks[i].append(block)
            ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
            self._table[torch.tensor(heads, device=dev), torch.tensor(cols, device=dev)] = ids_t
            self._owner[ids_t] = torch.tensor(heads, dtype=torch.long, device=dev)
            self._routing_cache = None
        self._ensure_slot_width(self.seen + q_len)
        if q_len == 1:  # decoding: each head's next slot, from the host-side block lists (one small tensor)
            slots = torch.tensor(
                [blocks[n // bs] * bs + n % bs for n, blocks in zip(self._n, self._blocks, strict=True)], device=dev
            )
        else:
            local = torch.tensor(self._n, device=dev)[:, None] + torch.arange(q_len, device=dev)  # (nh, q)
            slots = (self._table.gather(1, local // bs) * bs + local % bs).view(-1)
        self._writable(slots)
        d_k, d_v = self._kb.shape[-1], self._vb.shape[-1]
        self._kb.view(-1, d_k).index_copy_(0, slots, key_states.reshape(-1, d_k))
        self._vb.view(-1, d_v).index_copy_(0, slots, value_states.reshape(-1, d_v))
        if q_len == 1:
            self._pb.view(-1).index_fill_(0, slots, self.seen)
        else:
            positions = torch.arange(self.seen, self.seen + q_len, device=dev)
            self._pb.view(-1).index_copy_(0, slots, positions.repeat(self._nh))
        self._valid.view(-1).index_fill_(0, slots, True)
        self._slot[:, self.seen : self.seen + q_len] = slots.view(self._nh, q_len)
        self._n = [n + q_len for n in self._n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new pairs ``(B, H, q, d)`` and return them.

        On the sequence's first forward they are the whole cache, and transformers' sdpa reads them (dense
        prefill); afterwards :meth:`attend` reads the blocks and ignores them, so no forward ever copies the
        cache into a dense tensor.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[:2] != (self._bsz, self._heads):
            raise ValueError(
                f"This cache layer holds {self._bsz} sequences x {self._heads} KV heads, got new pairs of shape "
                f"{tuple(key_states.shape)}: use a fresh cache for a new batch."
            )
        self._first_forward = self.seen == 0
        self._append(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.last_keys, self.last_values = key_states, value_states
        return key_states, value_states

    @property
    def reads_own_storage(self) -> bool:
        return not self._first_forward

    def get_seq_length(self) -> int:
        """Tokens seen (true positions), not pairs stored: transformers derives position ids from it."""
        return self.seen

    def crop(self, arg: int) -> None:
        """Forget the last tokens (``arg`` follows the installed transformers' convention, see ``crop_count``)."""
        n_crop = crop_count(self.seen, arg)
        if n_crop == 0:
            return
        new_seen = self.seen - n_crop
        slots = self._slot[:, new_seen : self.seen].long()
        stored = slots >= 0
        removed_live = stored.sum(-1).view(self._bsz, self._heads)
        self.seen = new_seen
        self._drop_and_repack(slots[stored])
        # Cropped positions that had been evicted no longer count as evicted.
        self.n_evicted = self.n_evicted - (n_crop - removed_live)

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self._init_compact()

    def _select_rows(self, rows: list[int]) -> None:
        """Rebuild the storage with batch rows ``rows`` (repeats allowed): every new row gets its own blocks."""
        if not self.is_initialized:
            return
        self._repack(rows=[b * self._heads + h for b in rows for h in range(self._heads)])
        index = torch.tensor(rows, dtype=torch.long, device=self.n_evicted.device)
        self._bsz = len(rows)
        self.n_evicted = self.n_evicted.index_select(0, index)
        self.keys = self.keys.new_empty(self._bsz, *self.keys.shape[1:])
        self.values = self.values.new_empty(self._bsz, *self.values.shape[1:])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([b for b in range(self._bsz) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.arange(self._bsz)[torch.as_tensor(indices).cpu()]
        self._select_rows(rows.reshape(-1).tolist())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx.cpu().reshape(-1).tolist())

    # --- the PrunableLayer interface ----------------------------------------------------------------------------
    def evict(self, start: int, mask: torch.Tensor) -> None:
        """Free the pairs at absolute positions ``start + j`` where ``mask[b, h, j]`` is True.

        Parameters
        ----------
        start : absolute position of ``mask[..., 0]``.
        mask : bool Tensor ``(B, H, n)``. Already evicted positions are ignored (counted once).
        """
        if mask.dim() != 3 or mask.shape[:2] != (self._bsz, self._heads):
            raise ValueError(
                f"evict expects a mask of shape (batch={self._bsz}, kv_heads={self._heads}, n), "
                f"got {tuple(mask.shape)}."
            )
        n_pos = mask.shape[-1]
        if n_pos == 0:
            return
        if start < 0 or start + n_pos > self.seen:
            raise ValueError(
                f"evict covers positions {start}..{start + n_pos - 1}, but this layer has seen positions "
                f"0..{self.seen - 1} only."
            )
        slots = self._slot[:, start : start + n_pos]  # (nh, n) int32
        hit = mask.to(device=self.device, dtype=torch.bool).reshape(self._nh, n_pos) & (slots >= 0)
        self.n_evicted = self.n_evicted + hit.sum(-1).view(self._bsz, self._heads)  # out of place: snapshots share it
        if n_pos > _SWAP_REMOVE_MAX:
            self._drop_and_repack(slots[hit].long())
            return
        hits = hit.tolist()
        for j in range(n_pos):
            heads = [i for i in range(self._nh) if hits[i][j]]
            if heads:
                self._swap_remove(start + j, heads)

    def _swap_remove(self, position: int, heads: list[int]) -> None:
        """Evict ``position`` from ``heads`` (each stores it): each moves its last live pair into the freed slot.

        Live slots stay a prefix of each head's blocks; a block emptied this way returns to the free list. The
        slots involved are computed on the host (it knows every head's count and blocks): a dozen tensor
        operations for all heads together.
        """
        bs, dev = self.block_size, self.device
        heads_t = torch.tensor(heads, device=dev)
        dst = self._slot[heads_t, position].long()
        src_list = []
        for i in heads:
            last = self._n[i] - 1
            src_list.append(self._blocks[i][last // bs] * bs + last % bs)
            self._n[i] = last
        src = torch.tensor(src_list, device=dev)
        self._writable(dst)
        d_k, d_v = self._kb.shape[-1], self._vb.shape[-1]
        keys, values, positions = self._kb.view(-1, d_k), self._vb.view(-1, d_v), self._pb.view(-1)
        keys.index_copy_(0, dst, keys.index_select(0, src))
        values.index_copy_(0, dst, values.index_select(0, src))
        moved = positions.index_select(0, src)
        positions.index_copy_(0, dst, moved)
        # The last slot is free now (its pair moved to dst, or it was the evicted pair itself).
        self._valid.view(-1).index_fill_(0, src, False)
        # The moved pair now lives at dst; then the evicted position is gone (also when it was the last pair).
        self._slot[heads_t, moved] = dst.to(torch.int32)
        self._slot[heads_t, position] = -1
        freed = []
        for i in heads:
            keep_blocks = _ceil_div(self._n[i], bs)
            if keep_blocks < len(self._blocks[i]):
                freed.extend(self._blocks[i][keep_blocks:])
                del self._blocks[i][keep_blocks:]
        if freed:
            self._free.extend(freed)
            self._owner[torch.tensor(freed, dtype=torch.long, device=dev)] = self._nh
            self._routing_cache = None

    def kept_counts(self) -> torch.Tensor:
        """``(B, H)`` pairs physically stored (here: exactly the kept pairs)."""
        return torch.tensor(self._n, dtype=torch.long, device=self.device).view(self._bsz, self._heads)

    def keep_mask(self) -> torch.Tensor:
        """``(B, H, seen)`` True at the positions whose pair is stored."""
        return (self._slot[:, : self.seen] >= 0).view(self._bsz, self._heads, self.seen)

    def stored_pairs(self, batch: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``(n, d)``, values ``(n, d)`` and positions ``(n,)`` stored for one (batch row, KV head), in slot
        order (not position order)."""
        i = batch * self._heads + head
        n = self._n[i]
        blocks = torch.tensor(self._blocks[i], dtype=torch.long, device=self.device)
        flat = (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).view(-1)[:n]
        return (
            self._kb.view(-1, self._kb.shape[-1])[flat],
            self._vb.view(-1, self._vb.shape[-1])[flat],
            self._pb.view(-1)[flat],
        )

    def capacities(self) -> torch.Tensor:
        """``(B, H)`` slots held by each (batch row, KV head): its blocks times the block size."""
        held = [len(b) * self.block_size for b in self._blocks]
        return torch.tensor(held, dtype=torch.long).view(self._bsz, self._heads)

    def physical_bytes(self) -> int:
        """Bytes allocated by this layer: the block pool (free blocks included) and its bookkeeping tensors."""
        if not self.is_initialized:
            return 0
        tensors = (self._kb, self._vb, self._pb, self._valid, self._owner, self._table, self._slot)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _pair_bytes(self) -> int:
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    def kept_bytes(self) -> int:
        """Bytes of the kept keys and values (no free slots, no bookkeeping)."""
        return sum(self._n) * self._pair_bytes() if self.is_initialized else 0

    def full_bytes(self) -> int:
        """Bytes of the keys and values of every position seen, as an unpruned cache would hold them."""
        return self._bsz * self._heads * self.seen * self._pair_bytes() if self.is_initialized else 0

    def attend(self, module: nn.Module, query, key, value, attention_mask, scaling, dropout=0.0):
        """Attention of ``query`` ``(B, Hq, q, d)`` over the stored pairs; ``key``/``value`` are ignored.

        ``attention_mask`` (bool or additive, ``(B or 1, 1, q, kv)`` with ``kv >= seen``, bottom-right aligned)
        is read at the stored positions; when None, query ``j`` (position ``seen - q + j``) sees the pairs at
        positions ``<= seen - q + j``. Returns ``(B, q, Hq, d)`` and None (no attention weights).
        """
        if dropout:
            raise ValueError("kvzap's compact cache does not apply attention dropout; call model.eval() first.")
        bsz, n_q_heads, q_len, head_dim = query.shape
        scale = scaling if scaling is not None else head_dim**-0.5
        am = None
        if attention_mask is not None:
            if attention_mask.shape[-1] < self.seen:
                raise ValueError(
                    f"The attention mask covers {attention_mask.shape[-1]} keys, fewer than the {self.seen} "
                    "positions seen by this layer."
                )
            if attention_mask.dtype != torch.bool:
                attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
            am = attention_mask[:, 0, -q_len:, -self.seen :]  # (B or 1, q, seen)
        # A multi-token step (question, prefill chunk) meets every stored slot: bound the (slots x rows) scratch
        # by attending a few query positions at a time.
        slots_x_group = self.num_blocks * self.block_size * (n_q_heads // self._heads)
        step = max(1, _ATTEND_SCRATCH // max(1, slots_x_group))
        outs = []
        for t0 in range(0, q_len, step):
            t1 = min(q_len, t0 + step)
            q_pos = None
            if q_len > 1:
                q_pos = torch.arange(self.seen - q_len + t0, self.seen - q_len + t1, device=self.device)
            outs.append(self._attend_rows(query[:, :, t0:t1], q_pos, None if am is None else am[:, t0:t1], scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, Hq, q, d)
        return out.transpose(1, 2).contiguous(), None

    def _attend_rows(self, query, q_pos, am, scale):
        """:meth:`attend` for query positions ``q_pos`` (None: one token, the last) and their mask rows ``am``
        ``(B or 1, q, seen)`` or None; returns ``(B, Hq, q, d)``."""
        bsz, n_q_heads, q_len, head_dim = query.shape
        groups = n_q_heads // self._heads
        rows = groups * q_len
        nh, bs = self._nh, self.block_size
        # Fold the query heads of a group into the query axis: (B, Hq, q, d) -> (B*Hkv, G*q, d).
        q = query.reshape(nh, rows, head_dim) * scale
        owner, owns, routing = self._routing()
        q_blocks = q.index_select(0, owner)  # (nb, G*q, d): each block's owner's queries
        logits = torch.bmm(q_blocks, self._kb.transpose(1, 2)).float()  # (nb, G*q, bs)

        allowed = self._valid[:, None, :]  # (nb, 1, bs)
        if am is not None:
            block_row = (owner // self._heads).clamp_max(am.shape[0] - 1)  # (nb,) batch row of each block
            seen_at = am[:, :, self._pb.view(-1)].view(am.shape[0], q_len, -1, bs)  # (B', q, nb, bs)
            seen_at = seen_at[block_row, :, torch.arange(block_row.numel(), device=self.device)]  # (nb, q, bs)
            allowed = allowed & seen_at
        elif q_pos is not None:
            allowed = allowed & (self._pb[:, None, :] <= q_pos[None, :, None])  # (nb, q, bs) causal
        if allowed.shape[1] > 1:  # per query position: repeat over the group, like the folded queries
            allowed = allowed.repeat(1, groups, 1)
        logits = logits.masked_fill_(~allowed, float("-inf"))

        # Softmax split over blocks, merged per head (flash-decoding style): exact, no loop over heads. The merges
        # are reductions over a head's blocks, written with the (heads, blocks) routing matrix.
        block_max = logits.amax(-1)  # (nb, G*q)
        head_max = torch.where(owns[:, :, None], block_max[None], float("-inf")).amax(1)  # (nh, G*q)
        head_max = torch.nan_to_num(head_max, neginf=0.0)  # (a row that sees nothing would give NaN)
        weights = torch.exp(logits - head_max.index_select(0, owner)[:, :, None])  # (nb, G*q, bs)
        block_sum = weights.sum(-1)  # (nb, G*q)
        block_out = torch.bmm(weights.to(self._vb.dtype), self._vb).float()  # (nb, G*q, d)
        head_sum = routing @ block_sum  # (nh, G*q)
        head_out = (routing @ block_out.view(block_out.shape[0], -1)).view(nh, rows, -1)
        out = (head_out / head_sum[:, :, None]).to(query.dtype)  # (B*Hkv, G*q, d)
        return out.view(bsz, n_q_heads, q_len, -1)

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint sharing the key/value pools; later writes into slots it sees copy the pools first."""
        self._protected = {key: entry for key, entry in self._protected.items() if entry[0]() is not None}
        if self._kb is not None:
            entry = self._protected.get(id(self._kb))
            seen = self._valid.clone() if entry is None or entry[0]() is not self._kb else entry[1] | self._valid
            self._protected[id(self._kb)] = (weakref.ref(self._kb), seen)
        return self._state_copy(self.__dict__)

    @staticmethod
    def _state_copy(source: dict[str, Any]) -> dict[str, Any]:
        state = {name: value for name, value in source.items() if name != "_protected"}
        for name in ("_pb", "_valid", "_owner", "_table", "_slot"):
            if state.get(name) is not None:
                state[name] = state[name].clone()
        state["_routing_cache"] = None
        state["_n"] = list(state["_n"])
        state["_blocks"] = [list(b) for b in state["_blocks"]]
        state["_free"] = list(state["_free"])
        state["press_state"] = dict(state["press_state"])
        return state

    def restore(self, state: dict[str, Any]) -> None:
        # The checkpoint's tensors and lists stay untouched, for the next restore.
        self.__dict__.update(self._state_copy(state))


def compact_layer_like(layer: Any) -> PrunableLayer:
    """Like :func:`~kvzap.cache.prunable_layer_like`, with compact storage for full-attention layers.

    Sliding-window layers get the masked storage (their window bounds their size anyway).

    Raises
    ------
    TypeError
        For cache layers kvzap cannot prune (static, quantized, offloaded ...).
    """
    if type(layer) is DynamicLayer:
        return CompactLayer()
    return prunable_layer_like(layer)
