"""Compact storage: evicted KV pairs are physically freed, one buffer per (sequence, KV head).

:class:`CompactLayer` implements the :class:`~kvzap.cache.PrunableLayer` interface for full-attention layers.
Heads keep very different numbers of pairs, so a dense ``(batch, heads, seq, head_dim)`` tensor padded to the
busiest head would hold far more than the kept share. Instead, every (batch row ``b``, KV head ``h``) owns

- ``keys[i]``, ``values[i]``: ``(capacity_i, head_dim)`` buffers whose first ``n_i`` slots are live;
- ``pos[i]``: ``(capacity_i,)`` long, the absolute position of the pair in each slot,

with ``i = b * kv_heads + h``. Slots are unordered: attention reads ``pos`` to build exact causal masks.

- **Append** writes the new pairs at slots ``n_i ..``; when full, the buffer grows geometrically by 1/8 (still
  amortised O(1) per token, but the slack stays near 12.5% of the kept pairs instead of up to 100% with doubling).
- **Evict** removes pairs by moving live pairs from the tail into the freed slots (swap-remove), so the live
  slots stay a prefix ``0 .. n_i - 1``: a freed slot is reused by the next appended pair of that head and the
  attention call reads a contiguous slice with no holes to mask. When more than about a quarter of a buffer
  is free (after the prefill eviction), it is reallocated to the live pairs plus about 3%.
- **Snapshots** share buffers with the live cache. Appends only write past the snapshot's live prefix; a write
  inside a prefix that a snapshot still references (an eviction, or an append after restoring an older
  snapshot) first copies that head's buffer (copy on write).

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

__all__ = ["CompactLayer", "compact_layer_like"]


def _slack(n: int) -> int:
    """Free slots given to a buffer of ``n`` live pairs when it grows."""
    return n // 8 + 16


def _trimmed_slack(n: int) -> int:
    """Free slots kept when a buffer is shrunk after evictions: DMS decoding appends one pair per step and frees
    about as many, so little headroom is needed (about 3% instead of the 12.5% of growth)."""
    return n // 32 + 16


class CompactLayer(PrunableLayer, DynamicLayer):
    """A full-attention cache layer holding only the kept pairs of every (batch row, KV head).

    ``update`` returns the new pairs: on the first forward they are the whole cache and transformers' own sdpa
    reads them (dense prefill); afterwards :meth:`attend` reads this layer's storage.
    ``get_seq_length()`` is the number of tokens seen, so position ids and mask sizes are those of an unpruned
    cache.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._init_compact()

    def _init_compact(self) -> None:
        self._init_prunable()
        self._bsz = 0
        self._heads = 0
        self._k: list[torch.Tensor] = []  # per (b, h): (capacity, d)
        self._v: list[torch.Tensor] = []  # per (b, h): (capacity, d)
        self._pos: list[torch.Tensor] = []  # per (b, h): (capacity,) absolute positions
        self._n: list[int] = []  # per (b, h): live slots 0 .. n - 1
        self._first_forward = True  # the new pairs of the first update are the whole cache
        # id(key buffer) -> (weak reference to it, length of the prefix a snapshot references); not restored.
        self._protected: dict[int, tuple[weakref.ref, int]] = {}

    # --- storage helpers -------------------------------------------------------------------------------------
    def _alloc(self, i: int, capacity: int) -> None:
        """Move head ``i``'s live pairs into fresh buffers of ``capacity`` slots."""
        n = self._n[i]
        k, v, pos = self._k[i], self._v[i], self._pos[i]
        new_k = k.new_empty(capacity, k.shape[-1])
        new_v = v.new_empty(capacity, v.shape[-1])
        new_pos = pos.new_empty(capacity)
        new_k[:n], new_v[:n], new_pos[:n] = k[:n], v[:n], pos[:n]
        self._k[i], self._v[i], self._pos[i] = new_k, new_v, new_pos

    def _protected_length(self, buffer: torch.Tensor) -> int:
        entry = self._protected.get(id(buffer))
        return entry[1] if entry is not None and entry[0]() is buffer else 0  # ids of dead tensors get reused

    def _make_writable(self, i: int, lowest_slot: int) -> None:
        """Copy head ``i``'s buffers before writing at ``lowest_slot`` if a snapshot references that slot."""
        if self._protected_length(self._k[i]) > lowest_slot:
            self._alloc(i, self._k[i].shape[0])

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, n_heads, q_len, _ = key_states.shape
        positions = torch.arange(self.seen, self.seen + q_len, device=key_states.device)
        for b in range(bsz):
            for h in range(n_heads):
                i = b * n_heads + h
                n = self._n[i]
                if n + q_len > self._k[i].shape[0]:
                    self._alloc(i, n + q_len + _slack(n + q_len))  # geometric growth: amortised O(1)
                else:
                    self._make_writable(i, n)
                self._k[i][n : n + q_len] = key_states[b, h]
                self._v[i][n : n + q_len] = value_states[b, h]
                self._pos[i][n : n + q_len] = positions
                self._n[i] = n + q_len

    def _remove(self, i: int, hit: torch.Tensor) -> int:
        """Free the live slots of head ``i`` where ``hit`` ``(n_i,)`` is True; returns how many were freed."""
        holes = hit.nonzero().squeeze(1)  # sorted slot indices
        n_removed = holes.numel()
        if n_removed == 0:
            return 0
        new_n = self._n[i] - n_removed
        dst = holes[holes < new_n]  # holes inside the new live prefix ...
        src = new_n + (~hit[new_n:]).nonzero().squeeze(1)  # ... filled by the live pairs past it (same count)
        if dst.numel() > 0:
            self._make_writable(i, int(dst[0]))
            self._k[i][dst] = self._k[i][src]
            self._v[i][dst] = self._v[i][src]
            self._pos[i][dst] = self._pos[i][src]
        self._n[i] = new_n
        if self._k[i].shape[0] - new_n > 2 * _slack(new_n):
            # give the freed memory back (e.g. after the prefill eviction)
            self._alloc(i, new_n + _trimmed_slack(new_n))
        return n_removed

    # --- transformers cache layer ------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, n_heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.is_initialized = True
        # transformers reads dtype/device off these; the pairs themselves live in the per-head buffers.
        self.keys = key_states.new_empty(bsz, n_heads, 0, head_dim)
        self.values = value_states.new_empty(bsz, n_heads, 0, value_states.shape[-1])
        self._bsz, self._heads = bsz, n_heads
        self._k = [key_states.new_empty(0, head_dim) for _ in range(bsz * n_heads)]
        self._v = [value_states.new_empty(0, value_states.shape[-1]) for _ in range(bsz * n_heads)]
        self._pos = [torch.empty(0, dtype=torch.long, device=self.device) for _ in range(bsz * n_heads)]
        self._n = [0] * (bsz * n_heads)
        self.n_evicted = torch.zeros(bsz, n_heads, dtype=torch.long, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new pairs ``(B, H, q, d)`` and return them.

        On the sequence's first forward they are the whole cache, and transformers' sdpa reads them (dense
        prefill); afterwards :meth:`attend` reads the per-head storage and ignores them, so no forward ever
        copies the cache into a dense tensor.
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
        removed_live = torch.zeros_like(self.n_evicted)
        for i in range(len(self._n)):
            freed = self._remove(i, self._pos[i][: self._n[i]] >= new_seen)
            removed_live.view(-1)[i] = freed
        # Cropped positions that had been evicted no longer count as evicted.
        self.n_evicted = self.n_evicted - (n_crop - removed_live)
        self.seen = new_seen

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self._init_compact()

    def _select_rows(self, rows: list[int]) -> None:
        """Rebuild the storage with batch rows ``rows`` (repeats allowed): every new row gets its own buffers."""
        if not self.is_initialized:
            return
        ks, vs, ps, ns = [], [], [], []
        for b in rows:
            for h in range(self._heads):
                i = b * self._heads + h
                n = self._n[i]
                cap = n + _slack(n)
                k = self._k[i].new_empty(cap, self._k[i].shape[-1])
                v = self._v[i].new_empty(cap, self._v[i].shape[-1])
                p = self._pos[i].new_empty(cap)
                k[:n], v[:n], p[:n] = self._k[i][:n], self._v[i][:n], self._pos[i][:n]
                ks.append(k), vs.append(v), ps.append(p), ns.append(n)
        index = torch.tensor(rows, dtype=torch.long, device=self.n_evicted.device)
        self._k, self._v, self._pos, self._n = ks, vs, ps, ns
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
        mask = mask.to(device=self.device, dtype=torch.bool)
        flat = mask.reshape(-1, n_pos)  # (B*H, n)
        any_rows = flat.any(-1).tolist()  # one sync, then skip the heads with nothing to evict
        freed = [0] * len(self._n)
        for i, row_has_any in enumerate(any_rows):
            if not row_has_any:
                continue
            rel = self._pos[i][: self._n[i]] - start  # (n_i,) index into the mask, when in range
            in_range = (rel >= 0) & (rel < n_pos)
            hit = in_range & flat[i][rel.clamp(0, n_pos - 1)]
            freed[i] = self._remove(i, hit)
        newly = torch.tensor(freed, dtype=torch.long, device=self.n_evicted.device).view(self._bsz, self._heads)
        self.n_evicted = self.n_evicted + newly  # out of place: snapshots share this tensor

    def kept_counts(self) -> torch.Tensor:
        """``(B, H)`` pairs physically stored (here: exactly the kept pairs)."""
        return torch.tensor(self._n, dtype=torch.long, device=self.n_evicted.device).view(self._bsz, self._heads)

    def keep_mask(self) -> torch.Tensor:
        """``(B, H, seen)`` True at the positions whose pair is stored."""
        mask = torch.zeros(len(self._n), self.seen, dtype=torch.bool, device=self.device)
        for i, n in enumerate(self._n):
            mask[i, self._pos[i][:n]] = True
        return mask.view(self._bsz, self._heads, self.seen)

    def capacities(self) -> torch.Tensor:
        """``(B, H)`` allocated slots per (batch row, KV head)."""
        return torch.tensor([k.shape[0] for k in self._k], dtype=torch.long).view(self._bsz, self._heads)

    def physical_bytes(self) -> int:
        """Bytes allocated by this layer's buffers (keys, values and positions, free slots included)."""
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() + p.numel() * p.element_size()
            for k, v, p in zip(self._k, self._v, self._pos, strict=True)
        )

    def _pair_bytes(self) -> int:
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    def kept_bytes(self) -> int:
        """Bytes of the kept keys and values (no free slots, no positions)."""
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
        bsz, n_q_heads, q_len, head_dim = query.shape
        groups = n_q_heads // self._heads
        # Fold the query heads of a group into the query axis: (B, Hq, q, d) -> (B, Hkv, G*q, d).
        q = query.reshape(bsz, self._heads, groups * q_len, head_dim)
        if attention_mask is not None:
            if attention_mask.shape[-1] < self.seen:
                raise ValueError(
                    f"The attention mask covers {attention_mask.shape[-1]} keys, fewer than the {self.seen} "
                    "positions seen by this layer."
                )
            if attention_mask.dtype != torch.bool:
                attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
            attention_mask = attention_mask[..., -q_len:, -self.seen :]  # (B or 1, 1, q, seen)
        elif q_len > 1:
            q_pos = torch.arange(self.seen - q_len, self.seen, device=query.device)
        scale = scaling if scaling is not None else head_dim**-0.5
        outs = []
        for b in range(bsz):
            for h in range(self._heads):
                i = b * self._heads + h
                n = self._n[i]
                pos = self._pos[i][:n]
                if attention_mask is not None:
                    mask = attention_mask[min(b, attention_mask.shape[0] - 1), 0].index_select(-1, pos)  # (q, n)
                elif q_len > 1:
                    mask = pos[None, :] <= q_pos[:, None]  # (q, n): causal on true positions
                else:
                    mask = None  # a single new token sees every stored pair
                if mask is None and dropout == 0.0:
                    # One decoded token: a few query rows against n keys. Plain matmuls let BLAS spread the n keys
                    # over the threads, where a single-head sdpa call runs on one thread (measured 1.8x faster).
                    logits = (q[b, h] @ self._k[i][:n].T) * scale  # (G, n)
                    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
                    outs.append((weights @ self._v[i][:n])[None])  # (1, G, d)
                    continue
                if mask is not None:
                    mask = mask.repeat(groups, 1)  # (G*q, n), rows ordered like the folded queries
                outs.append(
                    torch.nn.functional.scaled_dot_product_attention(
                        q[b, h][None],
                        self._k[i][:n][None],
                        self._v[i][:n][None],
                        attn_mask=mask,
                        dropout_p=dropout,
                        scale=scaling,
                    )
                )  # (1, G*q, d)
        out = torch.cat(outs).view(bsz, n_q_heads, q_len, head_dim)  # (B*Hkv, G*q, d) -> (B, Hq, q, d)
        return out.transpose(1, 2).contiguous(), None

    def snapshot(self) -> dict[str, Any]:
        """A checkpoint sharing the buffers; later writes into the shared live prefixes copy first."""
        self._protected = {key: entry for key, entry in self._protected.items() if entry[0]() is not None}
        for k, n in zip(self._k, self._n, strict=True):
            self._protected[id(k)] = (weakref.ref(k), max(self._protected_length(k), n))
        state = {name: value for name, value in self.__dict__.items() if name != "_protected"}
        for name in ("_k", "_v", "_pos", "_n"):
            state[name] = list(state[name])
        state["press_state"] = dict(self.press_state)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in ("_k", "_v", "_pos", "_n"):
            setattr(self, name, list(state[name]))  # the checkpoint's lists stay untouched for the next restore
        self.press_state = dict(state["press_state"])


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
