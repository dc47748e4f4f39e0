"""Compact storage: evicted KV pairs are physically freed, in per-head pages (blocks) of a shared pool.

:class:`CompactLayer` implements the :class:`~kvzap.cache.PrunableLayer` interface for full-attention layers.
KV heads keep very different numbers of pairs (measured on SmolLM2-135M at 4k tokens and ~68% eviction: 3% to
100% per head; padding every head of a layer to its busiest one would store 0.49 of the full cache for 0.32
kept), so the layout must not pad heads to a common length. It is paged, like a serving engine's KV cache:

- a pool of ``num_blocks`` blocks of ``block_size`` slots: ``keys (num_blocks, block_size, d)``, ``values``,
  ``positions (num_blocks, block_size)`` (absolute position of the pair in each slot) and ``bias`` (0 in a live
  slot, -inf in a free one: added to the logits, it is the attention mask of the stored pairs);
- every (batch row ``b``, KV head ``h``), index ``i = b * kv_heads + h``, owns an ordered list of blocks (its
  row of the block table) and fills their slots in order; a block belongs to one head at a time (``owner``);
  the blocks in use are the first ones of the pool (blocks are taken in order and only a repack frees them),
  so attention reads a prefix of the pool and never meets the unused tail;
- a slot map ``(heads, seen)`` gives the slot of every stored (head, position), so evicting a given position
  is O(1), never a search.

The block tables, the slot map and the per-head counts live on the host (as in serving engines, which compute
slot mappings on the CPU and ship them with each step): a decoding step's bookkeeping is a few Python
operations, and the device sees one small index tensor per write.

Operations (the device work of each is a few tensor operations for all heads together, never one per head):

- **Append** writes each head's new pairs into its holes first (see below), then into its next fresh slots;
  a head whose last block is full takes the next unused block (the pool grows by 1/32 when it runs out:
  amortised O(1) per token).
- **Evict** of a few positions (decoding: the token leaving the sliding window) marks the slot free
  (bias -inf) and hands it to its head's list of holes: the head's next append writes there. No pair moves;
  in decoding (one pair in, at most one out per head and step) a head never holds more than a hole or two.
  Larger evictions (the prefill's), or holes piling up (more than a block, and more than 1/32 of the live
  pairs), repack the pool, trimmed to the live pairs plus about 1.5%.
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

import numpy as np
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

# Evictions of at most this many positions per call leave holes (reused by the next appends); more repack the pool.
_HOLES_MAX = 4


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
        self._pb = None  # (num_blocks, block_size) int32: absolute position of each slot's pair
        # (num_blocks, block_size), keys' dtype: 0 in a live slot, -inf in a free one (added to the logits)
        self._bias = None
        self._owner = None  # (num_blocks,) long: owning head (meaningful for the used blocks only)
        self._routing_cache = None  # see _routing
        # Host-side bookkeeping (a decoding step's slots are computed here, not on the device):
        self._slot = np.full((0, 0), -1, dtype=np.int32)  # (nh, positions capacity): flat slot, -1 if not stored
        self._n: list[int] = []  # live pairs per head
        self._end: list[int] = []  # slots used per head (live pairs and holes): its next fresh local slot
        self._holes: list[list[int]] = []  # per head, flat slots freed by evictions, reused first
        self._blocks: list[list[int]] = []  # the block table: each head's block ids in order
        self._n_used = 0  # blocks in use: always the first ones of the pool (blocks are freed only by a repack)
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
        self._pb = torch.zeros(num_blocks, bs, dtype=torch.int32, device=dev)
        self._bias = self.keys.new_full((num_blocks, bs), float("-inf"))
        self._owner = torch.full((num_blocks,), self._nh, dtype=torch.long, device=dev)
        self._routing_cache = None

    def _grow_pool(self, needed: int) -> None:
        """Add free blocks so that at least ``needed`` are free (geometric growth: amortised O(1) per pair)."""
        missing = needed - (self.num_blocks - self._n_used)
        if missing <= 0:
            return
        old = self.num_blocks
        extra = max(missing, old // 32 + self._nh)
        if old == 0:  # a first forward: nothing to copy
            self._new_pool(extra)
            return
        bs = self.block_size
        self._kb = torch.cat([self._kb, self._kb.new_zeros(extra, bs, self._kb.shape[-1])])
        self._vb = torch.cat([self._vb, self._vb.new_zeros(extra, bs, self._vb.shape[-1])])
        self._pb = torch.cat([self._pb, self._pb.new_zeros(extra, bs)])
        self._bias = torch.cat([self._bias, self._bias.new_full((extra, bs), float("-inf"))])
        self._owner = torch.cat([self._owner, self._owner.new_full((extra,), self._nh)])
        self._routing_cache = None

    def _ensure_slot_width(self, width: int) -> None:
        if self._slot.shape[1] < width:
            new_width = max(width, self._slot.shape[1] * 9 // 8 + 64)
            pad = np.full((self._nh, new_width - self._slot.shape[1]), -1, dtype=np.int32)
            self._slot = np.concatenate([self._slot, pad], axis=1)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _take_blocks(self, heads: list[int]) -> None:
        """Append the next unused block to each head of ``heads`` (repeats allowed): used blocks stay a prefix."""
        self._grow_pool(len(heads))
        ids = list(range(self._n_used, self._n_used + len(heads)))
        self._n_used += len(heads)
        for i, block in zip(heads, ids, strict=True):
            self._blocks[i].append(block)
        self._owner[torch.tensor(ids, dtype=torch.long, device=self.device)] = torch.tensor(
            heads, dtype=torch.long, device=self.device
        )
        self._routing_cache = None

    def _assign_consecutive_blocks(self, n_blocks: list[int]) -> None:
        """Give head ``i`` the next ``n_blocks[i]`` blocks from the start of the pool, heads in order (a repack's
        layout, and a prefill's)."""
        starts = [0]
        for c in n_blocks:
            starts.append(starts[-1] + c)
        self._blocks = [list(range(starts[i], starts[i + 1])) for i in range(len(n_blocks))]
        self._n_used = starts[-1]
        counts = torch.tensor(n_blocks, dtype=torch.long, device=self.device)
        self._owner[: self._n_used] = torch.repeat_interleave(torch.arange(len(n_blocks), device=self.device), counts)
        self._routing_cache = None

    def _writable(self, slots: torch.Tensor) -> None:
        """Copy the key/value pools before writing at flat ``slots`` if a snapshot still sees one of them."""
        entry = self._protected.get(id(self._kb))
        if entry is None or entry[0]() is not self._kb:
            return
        if bool(entry[1].view(-1)[slots].any()):
            self._kb, self._vb = self._kb.clone(), self._vb.clone()

    def _routing(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the used blocks: the head owning each ``(nu,)``; the ``(heads, nu, 1)`` ownership matrix as an
        additive mask (0 or -inf); and the ``(heads, nu)`` ownership matrix in float32. Cached until a block is
        taken (or the pool repacked)."""
        if self._routing_cache is None:
            owner = self._owner[: self._n_used]
            owns = owner[None, :] == torch.arange(self._nh, device=self.device)[:, None]
            bias = torch.zeros(owns.shape, device=self.device).masked_fill_(~owns, float("-inf"))[:, :, None]
            self._routing_cache = (owner, bias, owns.float())
        return self._routing_cache

    def _head_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(nh, max_blocks * block_size)`` flat slots of each head's blocks, and whether each is one of them."""
        bs = self.block_size
        width = max((len(b) for b in self._blocks), default=0)
        table = np.zeros((self._nh, width), dtype=np.int64)
        for i, blocks in enumerate(self._blocks):
            table[i, : len(blocks)] = blocks
        slots = (table[:, :, None] * bs + np.arange(bs)).reshape(self._nh, width * bs)
        n_blocks = np.array([len(b) for b in self._blocks], dtype=np.int64)
        owned = np.repeat(np.arange(width)[None, :] < n_blocks[:, None], bs, axis=1)
        return self._to_device(slots), self._to_device(owned)

    def _drop_and_repack(self, slots: torch.Tensor) -> None:
        """Forget the pairs in flat ``slots`` and repack (the repack rebuilds the slot map from the live pairs)."""
        self._bias.view(-1)[slots] = float("-inf")
        self._repack()

    def _repack(self, rows: list[int] | None = None, slack: bool = True) -> None:
        """Rebuild the pool with each head's live pairs packed into its own consecutive blocks.

        Parameters
        ----------
        rows : for each head of the new layout, the head it copies (batch operations); None keeps the heads.
        slack : keep about 1.5% unused blocks (at least one) for the pairs to come.
        """
        bs, dev = self.block_size, self.device
        slots, owned = self._head_slots()
        live = owned & (self._bias.view(-1)[slots] == 0)  # (nh, width)
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
        spare = (used // 64 + 1) if slack else 0

        keys, values, positions = self._kb.view(-1, self._kb.shape[-1]), self._vb.view(-1, self._vb.shape[-1]), self._pb
        src_pos = positions.view(-1)[src]
        self._nh = new_nh
        self._new_pool(used + spare)
        self._kb.view(-1, self._kb.shape[-1])[dst] = keys[src]
        self._vb.view(-1, self._vb.shape[-1])[dst] = values[src]
        self._pb.view(-1)[dst] = src_pos
        self._bias.view(-1)[dst] = 0
        self._assign_consecutive_blocks(n_blocks)
        self._slot = np.full((new_nh, max(self.seen, 1) + 64), -1, dtype=np.int32)
        self._slot[head.cpu().numpy(), src_pos.cpu().numpy()] = dst.cpu().numpy()
        self._n, self._end, self._holes = n, list(n), [[] for _ in range(new_nh)]

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
        self._slot = np.full((self._nh, 64), -1, dtype=np.int32)
        self._n, self._end = [0] * self._nh, [0] * self._nh
        self._holes = [[] for _ in range(self._nh)]
        self._blocks = [[] for _ in range(self._nh)]
        self._n_used = 0
        self.n_evicted = torch.zeros(bsz, n_heads, dtype=torch.long, device=self.device)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        q_len, dev = key_states.shape[2], self.device
        if self.seen == 0 and self._n_used == 0:
            self._append_first(key_states, value_states)
            return
        if q_len == 1:
            slots = self._next_slots()
            slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
        else:
            slots = self._next_slots_multi(q_len)  # (nh, q) numpy
            slots_t = self._to_device(slots.reshape(-1))
        self._writable(slots_t)
        d_k, d_v = self._kb.shape[-1], self._vb.shape[-1]
        self._kb.view(-1, d_k).index_copy_(0, slots_t, key_states.reshape(-1, d_k))
        self._vb.view(-1, d_v).index_copy_(0, slots_t, value_states.reshape(-1, d_v))
        if q_len == 1:
            self._pb.view(-1).index_fill_(0, slots_t, self.seen)
        else:
            positions = torch.arange(self.seen, self.seen + q_len, dtype=torch.int32, device=dev)
            self._pb.view(-1).index_copy_(0, slots_t, positions.repeat(self._nh))
        self._bias.view(-1).index_fill_(0, slots_t, 0)
        self._ensure_slot_width(self.seen + q_len)
        self._slot[:, self.seen : self.seen + q_len] = np.asarray(slots, dtype=np.int32).reshape(self._nh, q_len)

    def _append_first(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The first pairs of an empty layer (the prefill): each head gets consecutive blocks, in head order, so
        the pairs go in with one strided copy per tensor instead of a scatter."""
        q_len, nh, bs = key_states.shape[2], self._nh, self.block_size
        per_head = _ceil_div(q_len, bs)
        self._grow_pool(nh * per_head)
        width = per_head * bs
        used = slice(0, nh * per_head)
        self._kb[used].view(nh, width, -1)[:, :q_len] = key_states.reshape(nh, q_len, -1)
        self._vb[used].view(nh, width, -1)[:, :q_len] = value_states.reshape(nh, q_len, -1)
        self._pb[used].view(nh, width)[:, :q_len] = torch.arange(q_len, dtype=torch.int32, device=self.device)
        self._bias[used].view(nh, width)[:, :q_len] = 0
        self._assign_consecutive_blocks([per_head] * nh)
        self._n, self._end = [q_len] * nh, [q_len] * nh
        self._ensure_slot_width(q_len)
        self._slot[:, :q_len] = np.arange(nh, dtype=np.int32)[:, None] * width + np.arange(q_len, dtype=np.int32)

    def _next_slots(self) -> list[int]:
        """One new slot per head (a decoding step): its latest hole, else its next fresh slot (host arithmetic)."""
        bs = self.block_size
        full = [i for i in range(self._nh) if not self._holes[i] and self._end[i] == len(self._blocks[i]) * bs]
        if full:
            self._take_blocks(full)
        slots = []
        for i in range(self._nh):
            holes = self._holes[i]
            if holes:
                slots.append(holes.pop())
            else:
                end = self._end[i]
                slots.append(self._blocks[i][end // bs] * bs + end % bs)
                self._end[i] = end + 1
            self._n[i] += 1
        return slots

    def _next_slots_multi(self, q_len: int) -> np.ndarray:
        """``(nh, q_len)`` new slots: each head's holes first, then fresh slots after its last used one."""
        bs = self.block_size
        from_holes = [min(q_len, len(h)) for h in self._holes]
        fresh = [q_len - k for k in from_holes]
        wanted = [
            _ceil_div(end + m, bs) - len(blocks) for end, m, blocks in zip(self._end, fresh, self._blocks, strict=True)
        ]
        needing = [i for i, w in enumerate(wanted) for _ in range(max(w, 0))]
        if needing:
            self._take_blocks(needing)
        slots = np.empty((self._nh, q_len), dtype=np.int64)
        for i in range(self._nh):
            k, end = from_holes[i], self._end[i]
            if k:
                slots[i, :k] = self._holes[i][-k:]
                del self._holes[i][-k:]
            local = np.arange(end, end + fresh[i])
            slots[i, k:] = np.asarray(self._blocks[i], dtype=np.int64)[local // bs] * bs + local % bs
            self._end[i] = end + fresh[i]
            self._n[i] += q_len
        return slots

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
        slots = self._slot[:, new_seen : self.seen]
        stored = slots >= 0
        removed_live = self._to_device(stored.sum(-1)).view(self._bsz, self._heads)
        self.seen = new_seen
        self._drop_and_repack(self._to_device(slots[stored].astype(np.int64)))
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
        if n_pos > _HOLES_MAX:
            wanted = mask.to(dtype=torch.bool).reshape(self._nh, n_pos).cpu().numpy()
            slots = self._slot[:, start : start + n_pos]  # (nh, n)
            hit = wanted & (slots >= 0)
            if hit.any():
                self._count_evicted(hit.sum(-1).tolist())
                self._drop_and_repack(self._to_device(slots[hit].astype(np.int64)))
            return
        # A few positions (decoding): host-side loop, one device write.
        wanted = mask.reshape(self._nh, n_pos).tolist()
        counts, freed = [0] * self._nh, []
        for i, row in enumerate(wanted):
            for j, evict in enumerate(row):
                slot = int(self._slot[i, start + j]) if evict else -1
                if slot >= 0:
                    self._slot[i, start + j] = -1
                    self._holes[i].append(slot)
                    self._n[i] -= 1
                    counts[i] += 1
                    freed.append(slot)
        if not freed:
            return
        self._count_evicted(counts)
        self._bias.view(-1).index_fill_(0, torch.tensor(freed, dtype=torch.long, device=self.device), float("-inf"))
        # Decoding refills holes at once (one pair in per head and step); if they pile up, pack the pool.
        if sum(map(len, self._holes)) > max(self.block_size, sum(self._n) // 32):
            self._repack()

    def _count_evicted(self, counts: list[int]) -> None:
        # Out of place: snapshots share n_evicted.
        delta = torch.tensor(counts, dtype=torch.long, device=self.n_evicted.device)
        self.n_evicted = self.n_evicted + delta.view(self._bsz, self._heads)

    def kept_counts(self) -> torch.Tensor:
        """``(B, H)`` pairs physically stored (here: exactly the kept pairs)."""
        return torch.tensor(self._n, dtype=torch.long, device=self.device).view(self._bsz, self._heads)

    def keep_mask(self) -> torch.Tensor:
        """``(B, H, seen)`` True at the positions whose pair is stored."""
        return self._to_device(self._slot[:, : self.seen] >= 0).view(self._bsz, self._heads, self.seen)

    def stored_pairs(self, batch: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``(n, d)``, values ``(n, d)`` and positions ``(n,)`` stored for one (batch row, KV head), in slot
        order (not position order)."""
        blocks = torch.tensor(self._blocks[batch * self._heads + head], dtype=torch.long, device=self.device)
        flat = (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).view(-1)
        flat = flat[self._bias.view(-1)[flat] == 0]
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
        """Bytes allocated by this layer: the block pool (free blocks included), its bookkeeping tensors and the
        host-side slot map."""
        if not self.is_initialized:
            return 0
        tensors = (self._kb, self._vb, self._pb, self._bias, self._owner)
        return sum(t.numel() * t.element_size() for t in tensors) + self._slot.nbytes

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
        slots_x_group = self._n_used * self.block_size * (n_q_heads // self._heads)
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
        nh, bs, nu = self._nh, self.block_size, self._n_used
        keys, values, positions = self._kb[:nu], self._vb[:nu], self._pb[:nu]  # the used blocks only
        owner, owns_bias, routing = self._routing()

        bias = self._bias[:nu, None, :]  # (nu, 1, bs): -inf in free slots
        if am is None and q_pos is None:
            blocked = None  # one token: it sees every live slot
        elif am is not None:
            block_row = (owner // self._heads).clamp_max(am.shape[0] - 1)  # (nu,) batch row of each block
            seen_at = am[:, :, positions.view(-1)].view(am.shape[0], q_len, nu, bs)  # (B', q, nu, bs)
            seen_at = seen_at[block_row, :, torch.arange(nu, device=self.device)]  # (nu, q, bs)
            blocked = ~seen_at
        else:
            blocked = positions[:, None, :] > q_pos[None, :, None]  # (nu, q, bs) causal
        if blocked is not None:  # per query position, repeated over the group like the folded queries
            bias = bias.masked_fill(blocked, float("-inf")).repeat(1, groups, 1)

        # Fold the query heads of a group into the query axis: (B, Hq, q, d) -> (B*Hkv, G*q, d); each block meets
        # its owner's queries. Scale, mask and logits in one batched matmul.
        q_blocks = query.reshape(nh, rows, head_dim).index_select(0, owner)  # (nu, G*q, d)
        logits = torch.baddbmm(bias, q_blocks, keys.transpose(1, 2), alpha=scale).float()  # (nu, G*q, bs)

        # Softmax split over blocks, merged per head (flash-decoding style): exact, no loop over heads. The merges
        # are reductions over a head's blocks, written with the (heads, blocks) routing matrix.
        block_max = logits.amax(-1)  # (nu, G*q)
        head_max = (block_max[None] + owns_bias).amax(1)  # (nh, G*q)
        if q_pos is not None or am is not None:  # (one token: every head sees its own new pair)
            head_max = torch.nan_to_num(head_max, neginf=0.0)  # a row that sees nothing would give NaN
        weights = logits.sub_(head_max.index_select(0, owner)[:, :, None]).exp_()  # (nu, G*q, bs), in place
        block_sum = weights.sum(-1)  # (nu, G*q)
        block_out = torch.bmm(weights.to(values.dtype), values).float()  # (nu, G*q, d)
        head_sum = routing @ block_sum  # (nh, G*q)
        head_out = (routing @ block_out.view(nu, -1)).view(nh, rows, -1)
        out = (head_out / head_sum[:, :, None]).to(query.dtype)  # (B*Hkv, G*q, d)
        return out.view(bsz, n_q_heads, q_len, -1)

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint sharing the key/value pools; later writes into slots it sees copy the pools first."""
        self._protected = {key: entry for key, entry in self._protected.items() if entry[0]() is not None}
        if self._kb is not None:
            entry = self._protected.get(id(self._kb))
            live = self._bias == 0
            seen = live if entry is None or entry[0]() is not self._kb else entry[1] | live
            self._protected[id(self._kb)] = (weakref.ref(self._kb), seen)
        return self._state_copy(self.__dict__)

    @staticmethod
    def _state_copy(source: dict[str, Any]) -> dict[str, Any]:
        state = {name: value for name, value in source.items() if name != "_protected"}
        for name in ("_pb", "_bias", "_owner"):
            if state.get(name) is not None:
                state[name] = state[name].clone()
        state["_slot"] = state["_slot"].copy()
        state["_routing_cache"] = None
        state["_n"], state["_end"] = list(state["_n"]), list(state["_end"])
        state["_holes"] = [list(h) for h in state["_holes"]]
        state["_blocks"] = [list(b) for b in state["_blocks"]]
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
