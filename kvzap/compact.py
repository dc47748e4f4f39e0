"""Compact storage: evicted KV pairs are physically freed, in per-head pages (blocks) of a shared pool.

One concern, at this length: :class:`CompactLayer`, the adapter from transformers' cache-layer protocol and the
press's eviction interface to the paged parts in :mod:`kvzap.paged` (table, pool, attention), which already live
apart. Every method left here (settling the host and the device, update, crop and batch operations, evict,
attend) changes the same table-and-pool state of one layer under one invariant (every live pair has exactly one
slot, which the table knows once settled), which splitting the class would spread over several files.

:class:`CompactLayer` implements the :class:`~kvzap.prunable.PrunableLayer` interface for full-attention layers.
KV heads keep very different numbers of pairs (measured on SmolLM2-135M at 4k tokens and ~68% eviction: 3% to
100% per head; padding every head of a layer to its busiest one would store 0.49 of the full cache for 0.32
kept), so the layout must not pad heads to a common length. It is paged, like a serving engine's KV cache, and
split the same way (:mod:`kvzap.paged`):

- a **block table** on the host (:class:`~kvzap.paged.table.BlockTable`): each head's ordered list of blocks,
  the slot map ``(heads, positions)`` (evicting a given position is O(1), never a search), holes, counts, and
  the plans of repacks. Serving engines compute slot mappings on the CPU too: a decoding step's bookkeeping is a
  few Python operations, and the device only receives index arrays;
- a **pool** on the device (:class:`~kvzap.paged.pool.BlockPool`): keys, values, positions, bias (0 live,
  -inf free) and owners of ``num_blocks`` blocks; snapshots share it by reference, with copy on write;
- a pure **paged-attention** function (:func:`~kvzap.paged.attention.paged_attention`) with segment
  reductions.

:class:`CompactLayer` is the adapter between these and transformers' cache-layer protocol. What it does:

- **Prefill** (the first forward): ``update`` keeps a reference to the new pairs and returns them, and
  transformers' own sdpa reads them (dense prefill). Nothing is written into the pool yet: the press's
  evictions (``evict`` in its post-hook: a padded batch's padding, then the press's decisions) are gathered into
  one keep mask on the host, and the kept pairs only are written at the end of the forward
  (:meth:`CompactLayer.end_forward`, or the layer's next use if the press never got there), each head into its
  own consecutive blocks. So a layer never holds the prompt twice, never stores an evicted pair of the prompt
  (padding included), and its dense pairs are freed when the press's post-hook ends.
- **Append** (later forwards) writes each head's new pairs into its holes first (not while a snapshot shares
  the pool), then into its next fresh slots; a head whose last block is full takes the next unused block (the
  pool grows by 1/32 when it runs out: amortised O(1) per token).
- **Evict** of a few positions (decoding: the token leaving the sliding window) happens on the device: the
  host knows which slot holds each position (it chose the slots), so the eviction sets the bias of those slots
  to -inf where the mask says so, and adds to ``n_evicted``, without reading the mask. The host's table
  catches up once every :data:`_SYNC_EVERY` such evictions (one device read), after an eviction of more than
  :data:`_HOLES_MAX` positions (a question's, a prefill chunk's), or when a crop, reorder or snapshot needs it:
  the slots freed become holes then. Holes piling up (more than a block, and more than 1/32 of the live pairs)
  repack the pool, trimmed to the blocks in use, except while a snapshot shares it (the pipeline's
  checkpoint): a repack would then hold two pools, so the holes stay dead slots until the snapshot is gone.
- **Snapshots** (the pipeline's checkpoint) share the pool; the table is copied. Before sharing, the pool gets
  room for a block per head and 1/32 more: while the pool is shared, appends go to fresh slots only (refilling a
  hole, or growing the pool, would keep two pools alive), and evicted slots stay dead until the snapshot is gone.
  A question and answer longer than that room grow the pool: then the snapshot's pool and the layer's coexist
  until the next restore.
- **Attention** of a decoded token (one query position) on CPU runs the fused kernel of
  :mod:`kvzap.paged.kernels` (one call per layer and step, compiled on first use; the generic function serves
  when it cannot be built, and everywhere else). Otherwise it reads the used blocks (always a prefix of the
  pool) as a batch; causal masks of multi-token steps come from the stored positions, so they are exact
  whatever was evicted.

- **Quantized storage** (``kv_bits`` 8 or 4; presses store at 8 bits only, as 4-bit codes lose needles,
  ``research/kv-bits-4``): each kept pair is quantized once, when it is written into the
  pool (the prefill's pack, an append, a hole refilled), with a float16 scale and minimum per slot and group
  of channels (:mod:`kvzap.paged.quant` says why per slot, with the errors measured); repacks, crops and batch
  reorders copy the codes as they are, and snapshots share them like float pairs. The fused kernel dequantizes
  each block as it reads it; the generic path (CUDA, multi-token steps) dequantizes the used blocks
  (:meth:`~kvzap.paged.pool.BlockPool.block_pairs`) and attends as with float pairs;
  :meth:`~kvzap.paged.pool.BlockPool.pairs` gives the float pairs of any slots.

Sliding-window layers (Mistral, Gemma3 local layers) keep the masked storage: their window already bounds
their size. :func:`compact_layer_like` picks the storage per layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from kvzap._compat import DynamicLayer, crop_count
from kvzap.cache import prunable_layer_like
from kvzap.heap import release_freed, release_pages
from kvzap.paged.attention import paged_attention
from kvzap.paged.gathered import gathered_attention
from kvzap.paged.kernels import decode_kernel
from kvzap.paged.pool import BlockPool
from kvzap.paged.quant import check_kv_bits
from kvzap.paged.table import BlockTable, PackPlan
from kvzap.prunable import PrunableLayer, check_evict_mask

__all__ = ["CompactLayer", "compact_layer_like", "DEFAULT_BLOCK_SIZE"]

#: Slots per block. Small enough that the partly filled last block of each head wastes little (on average half
#: a block per head: 1.5 MB for SmolLM2-135M in fp32), large enough that the batched matmuls over blocks stay
#: efficient (measured on 2 CPU threads, 8.7k kept pairs: 64 slots was 2-3x faster than 16 or 32).
DEFAULT_BLOCK_SIZE = 64

# Evictions of more than this many positions per call (not decoding's) are reported to the host table at once.
_HOLES_MAX = 4

# Device evictions between two catch-ups of the host table (each catch-up is one device-to-host read).
_SYNC_EVERY = 16


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
    kv_bits : None, 8 or 4, default None
        Width of the stored pairs: None keeps the model's dtype; 8 or 4 quantize each kept pair when it is
        written, with float16 scales per slot and group of channels (:mod:`kvzap.paged.quant`), and every
        attention path dequantizes them.
    """

    # Snapshot rules (see PrunableLayer): the table is copied; the pool gives a PoolState sharing its tensors;
    # the first forward's dense pairs and the device evictions not yet seen by the table are settled first.
    _SHARED_FIELDS = PrunableLayer._SHARED_FIELDS | {"block_size", "kv_bits", "_bsz", "_heads"}
    _COPIED_FIELDS = PrunableLayer._COPIED_FIELDS | {"table", "pool"}
    _TRANSIENT_FIELDS = PrunableLayer._TRANSIENT_FIELDS | {
        "_dense",
        "_dense_keep",
        "_freed",
        "_pending_span",
        "_heads_arange",
    }

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, kv_bits: int | None = None, **kwargs):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
        kv_bits = check_kv_bits(kv_bits)
        super().__init__(**kwargs)
        self.block_size = block_size
        self.kv_bits = kv_bits
        self._init_compact()

    def _init_compact(self) -> None:
        self._init_prunable()
        self._bsz = 0
        self._heads = 0
        self.table = BlockTable.empty(0, self.block_size)
        self.pool = BlockPool(self.block_size, self.kv_bits)
        # The first forward's new pairs (B, H, q, d), not written into the pool yet (see the module docstring).
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None
        # Which of them the evictions of that forward keep, (heads, q) on the host; None while none ran.
        self._dense_keep: np.ndarray | None = None
        # Device evictions the table has not seen: (heads (N,), positions (N,), freed (N,) bool device tensor), and
        # the span of positions they covered (an eviction overlapping it must check which slots are still live).
        self._freed: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
        self._pending_span = (0, 0)
        self._heads_arange: np.ndarray | None = None  # np.arange(heads), kept (decoding needs it in every step)

    @property
    def _nh(self) -> int:
        return self._bsz * self._heads

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # --- settling the host and the device -----------------------------------------------------------------------
    def _settle(self) -> None:
        """Write the first forward's pairs if still pending, and bring the table up to date with the device."""
        if self._dense is not None:
            self._write_dense()
        self._sync()

    def _sync(self) -> None:
        """Report the device evictions to the table (one device read): their slots become holes."""
        if not self._freed:
            return
        freed = torch.cat([f for _, _, f in self._freed]).cpu().numpy()
        heads = np.concatenate([h for h, _, _ in self._freed])
        positions = np.concatenate([p for _, p, _ in self._freed])
        self._freed, self._pending_span = [], (0, 0)
        self.table.forget(heads[freed], positions[freed], as_holes=True)
        # While a snapshot shares the pool, holes stay dead slots: packing them away (or refilling one) would copy
        # the pool, and the snapshot keeps the old one alive. The pool then grows by the new tokens only.
        if self.table.holes_pile_up() and not self.pool.kv_shared:
            self._repack()

    def _write_dense(self) -> None:
        """Write the first forward's pairs into a new pool, only those its evictions kept (``_dense_keep``
        ``(heads, q)``, None: all), each head into consecutive blocks; then drop the dense pairs."""
        keys, values = self._dense
        keep = self._dense_keep
        self._dense = self._dense_keep = None
        q_len = keys.shape[2]
        if keep is None:
            keep = np.ones((self._nh, q_len), dtype=bool)
        plan = self.table.dense_plan(keep, offset=self.seen - q_len)
        # Gather the kept pairs straight from the (B, H, q, d) tensors: no copy of the whole prompt.
        head = np.repeat(np.arange(self._nh), plan.counts)
        index = [torch.from_numpy(a).to(keys.device) for a in (head // self._heads, head % self._heads)]
        j = torch.from_numpy(plan.src % q_len).to(keys.device)
        self._pack(plan, keys[index[0], index[1], j], values[index[0], index[1], j])

    def _pack(self, plan: PackPlan, kept_keys: torch.Tensor, kept_values: torch.Tensor) -> None:
        """Rebuild the pool from a plan and its gathered pairs ``(N, d)``, trimmed to the blocks in use (each head's
        last block has room for about half a block of new pairs; the pool grows when a head needs more)."""
        used = int(plan.n_blocks.sum())
        self.pool.pack(kept_keys, kept_values, plan.dst, plan.positions, plan.owner, used, len(plan.counts))
        self.table.adopt(plan, self.seen)

    def _repack(self, rows: list[int] | None = None) -> None:
        """Rebuild the pool with each head's stored pairs packed into its own consecutive blocks; ``rows[i]`` is
        the old head that new head ``i`` copies (batch operations), None keeps the heads."""
        self._sync()
        plan = self.table.pack_plan(self.seen, rows)
        # The stored pairs are copied as stored: quantized codes are never rounded twice.
        used = int(plan.n_blocks.sum())
        self.pool.repack(plan.src, plan.dst, plan.positions, plan.owner, used, len(plan.counts))
        self.table.adopt(plan, self.seen)

    # --- transformers cache layer ------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, n_heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.is_initialized = True
        # transformers reads dtype/device off these; the pairs themselves live in the block pool.
        self.keys = key_states.new_empty(bsz, n_heads, 0, head_dim)
        self.values = value_states.new_empty(bsz, n_heads, 0, value_states.shape[-1])
        self._bsz, self._heads = bsz, n_heads
        self.table = BlockTable.empty(bsz * n_heads, self.block_size)
        self.pool.allocate(0, key_states, value_states, bsz * n_heads)
        self.n_evicted = torch.zeros(bsz, n_heads, dtype=torch.long, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Record the new pairs ``(B, H, q, d)`` and return them.

        On the sequence's first forward they are the whole cache, and transformers' sdpa reads them (dense
        prefill); they reach the pool when the press evicts or the forward ends. Afterwards they are written
        into the pool at once, and :meth:`attend` reads the blocks and ignores them, so no forward ever copies
        the cache into a dense tensor.
        """
        self._check_bound()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[:2] != (self._bsz, self._heads):
            raise ValueError(
                f"This cache layer holds {self._bsz} sequences x {self._heads} KV heads, got new pairs of shape "
                f"{tuple(key_states.shape)}: use a fresh cache for a new batch."
            )
        if self._dense is not None:  # a first forward that never reached the press's post-hook
            self._write_dense()
        if self.seen == 0 and self.table.n_used == 0:
            self._dense = (key_states, value_states)
        else:
            self._append(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.last_keys, self.last_values = key_states, value_states
        return key_states, value_states

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        q_len, nh = key_states.shape[2], self._nh
        use_holes = not self.pool.kv_shared  # refilling a hole would copy a pool that a snapshot shares
        needing = self.table.blocks_needed(q_len, use_holes)
        if needing:
            total = self.table.n_used + len(needing)
            if total > self.pool.num_blocks:
                old = self.pool.num_blocks
                # Geometric growth (amortised O(1) per pair), by at least a block.
                self.pool.grow(max(total, old + max(old // 32, 1)), free_owner=nh)
            self.pool.set_owner(self.table.take_blocks(needing), needing)
        slots, _ = self.table.place(self.seen, q_len, use_holes)
        if q_len == 1:
            positions = self.seen
        else:
            positions = torch.arange(self.seen, self.seen + q_len, dtype=torch.int32, device=self.device).repeat(nh)
        d_k, d_v = key_states.shape[-1], value_states.shape[-1]
        self.pool.write(slots.reshape(-1), key_states.reshape(-1, d_k), value_states.reshape(-1, d_v), positions)

    def end_forward(self) -> None:
        """End of the press's post-hook: pairs of a first forward that no eviction wrote go into the pool now."""
        super().end_forward()
        if self._dense is not None:
            dense = list(self._dense)
            nbytes = sum(t.nbytes for t in dense)
            before = sum(t.nbytes for t in self.pool.tensors())
            self._write_dense()
            kept = sum(t.nbytes for t in self.pool.tensors()) - before
            # The prompt's dense pairs are gone: give their pages back to the system (``dense`` holds their last
            # references), and trim the heap if resident memory outgrew the pool kept (kvzap.heap).
            release_pages(dense)
            release_freed(nbytes, self.device, kept)

    def _reset_transient(self) -> None:
        super()._reset_transient()
        self._dense, self._dense_keep, self._freed, self._pending_span = None, None, [], (0, 0)

    @property
    def reads_own_storage(self) -> bool:
        return self._dense is None

    def get_seq_length(self) -> int:
        """Tokens seen (true positions), not pairs stored: transformers derives position ids from it."""
        return self.seen

    def crop(self, arg: int) -> None:
        """Forget the last tokens (``arg`` follows the installed transformers' convention, see ``crop_count``)."""
        self._settle()
        n_crop = crop_count(self.seen, arg)
        if n_crop == 0:
            return
        new_seen = self.seen - n_crop
        removed_live = (self.table.slot[:, new_seen : self.seen] >= 0).sum(-1)  # (nh,) host
        self.seen = new_seen
        self._repack()  # keeps the pairs of positions < new_seen only
        # Cropped positions that had been evicted no longer count as evicted.
        removed_evicted = torch.from_numpy(n_crop - removed_live).to(self.n_evicted.device)
        self.n_evicted = self.n_evicted - removed_evicted.view(self._bsz, self._heads)

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self._init_compact()

    def _select_rows(self, rows: list[int]) -> None:
        """Rebuild the storage with batch rows ``rows`` (repeats allowed): every new row gets its own blocks."""
        if not self.is_initialized:
            return
        self._settle()
        self._repack(rows=[b * self._heads + h for b in rows for h in range(self._heads)])
        self._select_press_state(torch.tensor(rows, dtype=torch.long))
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

        The eviction is applied on the device without reading ``mask``; the host table learns of it later (see
        the module docstring). The evictions of a prefill read their mask (they decide what is written).
        """
        check_evict_mask(mask, (self._bsz, self._heads), start, self.seen)
        n_pos = mask.shape[-1]
        if n_pos == 0:
            return
        nh, mask = self._nh, mask.to(dtype=torch.bool)
        if self._dense is not None:
            # The prefill: the pairs are written at the end of the forward, only those no eviction took.
            wanted = mask.reshape(nh, n_pos).cpu().numpy()
            q_len = self._dense[0].shape[2]
            if self._dense_keep is None:
                self._dense_keep = np.ones((nh, q_len), dtype=bool)
            first = start - (self.seen - q_len)
            span = self._dense_keep[:, first : first + n_pos]
            newly = span & wanted  # already evicted positions count once
            span &= ~wanted
            self._count_evicted(torch.from_numpy(newly.sum(-1)))
            return
        # On the device. The table knows the slot of every position it has not seen evicted; a pair evicted on
        # the device since the last catch-up is skipped there (its slot is no longer live).
        end = start + n_pos
        slots = self.table.slot[:, start:end].reshape(-1)
        dev = self.device
        lo, hi = self._pending_span
        if slots.min() >= 0 and not (start < hi and lo < end):
            # The usual case (each position leaves the window once): every slot is live, so the mask is exactly
            # what is freed. A few device operations, no read.
            freed = mask.reshape(-1).to(dev)
            if n_pos == 1:
                heads, offsets = self._head_index(), np.zeros(nh, dtype=np.int64)
            else:
                heads, offsets = np.divmod(np.arange(slots.size), n_pos)
            self.pool.kill(torch.from_numpy(slots.astype(np.int64)).to(dev), freed)
            self._count_evicted(freed.view(nh, n_pos).sum(-1) if n_pos > 1 else freed)
        else:
            stored = np.flatnonzero(slots >= 0)
            if stored.size == 0:
                return
            wanted = mask.reshape(-1).index_select(0, torch.from_numpy(stored).to(mask.device)).to(dev)
            freed = self.pool.free(torch.from_numpy(slots[stored].astype(np.int64)).to(dev), wanted)
            heads, offsets = np.divmod(stored, n_pos)
            counts = torch.zeros(nh, dtype=torch.long, device=dev)
            counts.index_add_(0, torch.from_numpy(heads).to(dev), freed.long())
            self._count_evicted(counts)
        self._freed.append((heads, start + offsets, freed))
        self._pending_span = (min(lo, start), max(hi, end)) if self._freed[:-1] else (start, end)
        if n_pos > _HOLES_MAX or len(self._freed) >= _SYNC_EVERY:
            # Larger evictions (a question's, a prefill chunk's) are reported at once, so that their slots can be
            # refilled or packed away before the next chunk; decoding's wait for 16 steps.
            self._sync()

    def _head_index(self) -> np.ndarray:
        if self._heads_arange is None or len(self._heads_arange) != self._nh:
            self._heads_arange = np.arange(self._nh)
        return self._heads_arange

    def _count_evicted(self, counts: torch.Tensor) -> None:
        """Add ``counts`` ``(nh,)`` to ``n_evicted``, out of place (snapshots share ``n_evicted``)."""
        self.n_evicted = self.n_evicted + counts.to(self.n_evicted.device).view(self._bsz, self._heads)

    def sync(self) -> None:
        """Bring the host table up to date with the device (one read); done automatically when needed."""
        self._settle()

    def kept_counts(self) -> torch.Tensor:
        """``(B, H)`` pairs physically stored (here: exactly the kept pairs)."""
        self._settle()
        return torch.tensor(self.table.n, dtype=torch.long, device=self.device).view(self._bsz, self._heads)

    def keep_mask(self) -> torch.Tensor:
        """``(B, H, seen)`` True at the positions whose pair is stored."""
        self._settle()
        keep = torch.from_numpy(self.table.slot[:, : self.seen] >= 0).to(self.device)
        return keep.view(self._bsz, self._heads, self.seen)

    def stored_pairs(self, batch: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``(n, d)``, values ``(n, d)`` and positions ``(n,)`` stored for one (batch row, KV head), in slot
        order (not position order)."""
        self._settle()
        flat = torch.from_numpy(self.table.head_slots(batch * self._heads + head)).to(self.device)
        flat = flat[self.pool.bias.view(-1)[flat] == 0]
        keys, values = self.pool.pairs(flat)  # dequantized when the storage is quantized
        return keys, values, self.pool.positions.view(-1)[flat]

    def capacities(self) -> torch.Tensor:
        """``(B, H)`` slots held by each (batch row, KV head): its blocks times the block size."""
        return torch.from_numpy(self.table.capacities()).view(self._bsz, self._heads)

    def held_objects(self) -> list[Any]:
        """Pool tensors, host slot map, placeholders, pending dense pairs and evictions, and the base's."""
        return [
            *super().held_objects(),
            *self.pool.tensors(),
            self.table.slot,
            self.keys,
            self.values,
            self._dense,
            self._dense_keep,
            self._freed,
            self._heads_arange,
        ]

    def physical_bytes(self) -> int:
        """Bytes this layer holds: the block pool (free blocks included) with its bookkeeping tensors, the host
        slot map, and everything else counted by :func:`kvzap.cache.kv_bytes`."""
        from kvzap.cache import _tensor_bytes

        return _tensor_bytes(self.held_objects()) if self.is_initialized else 0

    def _pair_bytes(self) -> int:
        """Bytes of one pair in the model's dtype (an unpruned cache's)."""
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    def kept_bytes(self) -> int:
        """Bytes of the kept keys and values as stored (quantized: their codes and scales; no free slots, no
        bookkeeping)."""
        if not self.is_initialized:
            return 0
        self._settle()
        return sum(self.table.n) * self.pool.slot_pair_bytes()

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
        nu, pool = self.table.n_used, self.pool
        kernel = self._decode_kernel(query) if q_len == 1 else None
        if kernel is not None:
            mask = None if am is None else am[:, 0].contiguous()  # (B or 1, seen)
            args = (query.contiguous(), pool.keys, pool.values, pool.bias, pool.owner, pool.positions, mask, nu)
            if pool.quantized:  # the kernel dequantizes each block as it reads it
                out = kernel(*args, self._heads, float(scale), pool.key_scales, pool.value_scales, pool.kv_bits)
            else:
                out = kernel(*args, self._heads, float(scale))  # (B, Hq, 1, d)
            return out.transpose(1, 2).contiguous(), None
        if q_len > 1:
            return self._attend_gathered(query, am, scale), None
        # The generic decoding path (CUDA, no kernel): the used blocks in the model's dtype (dequantized
        # copies when the storage is quantized), one query position.
        blocks = (*pool.block_pairs(nu), pool.positions[:nu], pool.bias[:nu], pool.owner[:nu])
        out = paged_attention(query, *blocks, self._heads, scale, mask=am)  # (B, Hq, 1, d)
        return out.transpose(1, 2).contiguous(), None

    def _attend_gathered(self, query: torch.Tensor, am: torch.Tensor | None, scale: float) -> torch.Tensor:
        """A multi-token step (prefill chunk, question): each head's live pairs gathered in position order, then
        torch's fused sdpa per head (:mod:`kvzap.paged.gathered`). Returns ``(B, q, Hq, d)``."""
        self._sync()  # the table must know every eviction: a pair evicted on the device only would be gathered
        q_len = query.shape[2]
        slot = self.table.slot[:, : self.seen]
        heads, positions = np.nonzero(slot >= 0)  # head by head, in position order
        flat = torch.from_numpy(slot[heads, positions].astype(np.int64)).to(self.device)
        counts = np.bincount(heads, minlength=self._nh).tolist()
        keys, values = self.pool.pairs(flat)  # dequantized when the storage is quantized
        q_pos = torch.arange(self.seen - q_len, self.seen, device=self.device)
        out = gathered_attention(
            query, keys, values, torch.from_numpy(positions).to(self.device), counts, self._heads, scale, q_pos, am
        )
        return out.transpose(1, 2).contiguous()

    def _decode_kernel(self, query: torch.Tensor):
        """The fused CPU kernel (:mod:`kvzap.paged.kernels`) for a decoding step, or None where it does not apply:
        CPU tensors of one dtype, no gradient, and the kernel built (or buildable) here."""
        if (
            self.pool.keys is None
            or query.device.type != "cpu"
            or query.dtype != self.pool.dtype
            or (query.requires_grad and torch.is_grad_enabled())
        ):
            return None
        return decode_kernel()

    # --- snapshots ----------------------------------------------------------------------------------------------
    def _needs_press(self) -> bool:
        return True  # only kvzap's attention reads the blocks

    def snapshot(self):
        """A checkpoint sharing the pool (see :mod:`kvzap.paged.pool`). Room for new pairs is made first: growing
        a pool that a snapshot shares would leave two pools alive, the snapshot's and the layer's."""
        self._settle()
        if self.is_initialized:
            nh = self._nh
            wanted = self.table.n_used + nh + self.table.n_used // 32  # a block per head, and 1/32
            if self.pool.num_blocks < wanted and not self.pool.kv_shared:
                self.pool.grow(wanted, free_owner=nh)
        return super().snapshot()

    def _copy_field(self, name: str, value: Any) -> Any:
        if name == "table":
            return value.copy()
        if name == "pool":
            live = np.zeros(value.num_blocks * self.block_size, dtype=bool)
            live[self.table.slot[self.table.slot >= 0]] = True
            return value.state(live)
        return super()._copy_field(name, value)

    def _restore_field(self, name: str, value: Any) -> Any:
        if name == "table":
            return value.copy()
        if name == "pool":  # the live pool adopts the state's tensors, shared with it from now on
            self.pool.restore(value)
            return self.pool
        return super()._restore_field(name, value)


def compact_layer_like(layer: Any, *, kv_bits: int | None = None) -> PrunableLayer:
    """Like :func:`~kvzap.cache.prunable_layer_like`, with compact storage for full-attention layers.

    Sliding-window layers get the masked storage (their window bounds their size anyway), in the model's dtype:
    ``kv_bits`` (None, 8 or 4, see :class:`CompactLayer`) applies to the compact layers only.

    Raises
    ------
    TypeError
        For cache layers kvzap cannot prune (static, quantized, offloaded ...).
    """
    kv_bits = check_kv_bits(kv_bits)
    if type(layer) is DynamicLayer:
        return CompactLayer(kv_bits=kv_bits)
    return prunable_layer_like(layer)
