"""Where every kept KV pair lives: the masked storage, and the operations on a whole cache.

A press decides *which* pairs to evict; a cache layer decides *how* eviction is stored and how attention reads
what is left, through the interface of :class:`~kvzap.prunable.PrunableLayer` (defined in :mod:`kvzap.prunable`
with its snapshot rules, and importable from here). This module provides:

- the *masked* storage (:class:`MaskedLayer`, :class:`MaskedSlidingWindowLayer`): the pairs stay in a dense
  ``[batch, kv_heads, seq, head_dim]`` tensor and a boolean ``keep`` mask hides the evicted ones from every head
  (same logits as deleting them); the *compact* storage, which frees them, is :mod:`kvzap.compact`;
- :func:`prunable_layer_like`, which wraps an empty transformers cache layer;
- checkpoints of a whole cache (:func:`snapshot_cache`, :func:`restore_cache`) and its bytes (:func:`kv_bytes`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import Cache

from kvzap._compat import DynamicLayer, DynamicSlidingWindowLayer, crop_count
from kvzap.prunable import LayerState, PrunableLayer, check_evict_mask

__all__ = [
    "PrunableLayer",
    "MaskedLayer",
    "MaskedSlidingWindowLayer",
    "own_window",
    "prunable_layer_like",
    "snapshot_cache",
    "restore_cache",
    "masked_sdpa",
    "kv_bytes",
    "KVBytes",
    "LayerState",
]


def _tensor_bytes(objects, seen_storages: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages and numpy arrays in ``objects`` (nested tuples, lists and dicts are
    walked), each storage counted whole and once."""
    seen_storages = set() if seen_storages is None else seen_storages
    total = 0
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else id(obj)
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
        elif isinstance(obj, np.ndarray):
            base = obj if obj.base is None else obj.base
            if id(base) not in seen_storages:
                seen_storages.add(id(base))
                total += base.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, list)):
            stack.extend(obj)
    return total


def masked_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Grouped-query attention where each KV head sees only its kept pairs.

    Parameters
    ----------
    query : Tensor ``(B, Hq, q, d)``
    key, value : Tensor ``(B, Hkv, kv, d)``
    keep : bool Tensor ``(B, Hkv, kv)``; False hides the pair from every query head of the group.
    attention_mask : bool Tensor broadcastable to ``(B, 1, q, kv)`` (True = may attend) or None for plain
        causal attention where the ``q`` queries are the last ``q`` positions of the ``kv`` keys.
    scaling : softmax scale (``1/sqrt(d)`` when None).

    Returns
    -------
    Tensor ``(B, q, Hq, d)``, the layout transformers' attention functions return.
    """
    bsz, n_q_heads, q_len, head_dim = query.shape
    n_kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = n_q_heads // n_kv_heads
    if attention_mask is None:
        # bottom-right aligned causal mask: query i sits at key index kv_len - q_len + i
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        attention_mask = (torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None])[None, None]
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    attention_mask = attention_mask[..., -q_len:, -kv_len:]
    mask = attention_mask & keep[:, :, None, :]  # (B, Hkv, q, kv)
    # Fold the query heads of a group into the query axis so keys/values are never repeated:
    # (B, Hq, q, d) -> (B, Hkv, G*q, d), and the mask (B, Hkv, q, kv) -> (B, Hkv, G*q, kv).
    q = query.reshape(bsz, n_kv_heads, groups * q_len, head_dim)
    mask = mask.unsqueeze(2).expand(bsz, n_kv_heads, groups, q_len, kv_len).reshape(bsz, n_kv_heads, -1, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # (B, Hkv, G*q, d)
    return out.reshape(bsz, n_q_heads, q_len, head_dim).transpose(1, 2).contiguous()


class _MaskedStorage(PrunableLayer):
    """Dense storage plus a ``keep`` mask aligned with the stored keys.

    Works on top of both ``DynamicLayer`` and ``DynamicSlidingWindowLayer``: the stored pairs always cover the
    absolute positions ``seen - stored .. seen - 1``, whatever the parent class drops. Every mutation replaces
    tensors instead of writing into them, so a snapshot shares them all.
    """

    keep: torch.Tensor | None
    _attn_keep: torch.Tensor | None

    _SHARED_FIELDS = PrunableLayer._SHARED_FIELDS | {"keep", "_evict_called"}
    # _attn_keep: the keep mask of what this forward's update returned, read by attend in the same forward.
    _TRANSIENT_FIELDS = PrunableLayer._TRANSIENT_FIELDS | {"_attn_keep"}

    def _init_masked(self) -> None:
        self._init_prunable()
        self.keep = None
        self._attn_keep = None
        # Host-side: evict has been called on a non-empty range. Attention then goes through the keep mask, so
        # that no forward has to read n_evicted from the device to know whether a pair was evicted.
        self._evict_called = False

    @property
    def reads_own_storage(self) -> bool:
        return self._evict_called

    def _needs_press(self) -> bool:
        return self.has_evictions  # outside a press: reading the device is fine

    def held_objects(self) -> list[Any]:
        return [*super().held_objects(), self.keys, self.values, self.keep, self._attn_keep]

    def end_forward(self) -> None:
        super().end_forward()
        self._attn_keep = None

    def _reset_transient(self) -> None:
        super()._reset_transient()
        self._attn_keep = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_bound()
        bsz, n_heads, q_len, _ = key_states.shape
        if self.keep is None:
            self.keep = torch.ones(bsz, n_heads, 0, dtype=torch.bool, device=key_states.device)
            self.n_evicted = torch.zeros(bsz, n_heads, dtype=torch.long, device=key_states.device)
        new = torch.ones(bsz, n_heads, q_len, dtype=torch.bool, device=key_states.device)
        keep_full = torch.cat([self.keep, new], dim=-1)  # (B, H, stored_before + q)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # The parent may return (sliding window) or store fewer pairs than stored_before + q: align to the right.
        self.keep = keep_full[..., keep_full.shape[-1] - self.keys.shape[-2] :]
        self._attn_keep = keep_full[..., keep_full.shape[-1] - keys.shape[-2] :]
        self.seen += q_len
        self.last_keys, self.last_values = key_states, value_states
        return keys, values

    def evict(self, start: int, mask: torch.Tensor) -> None:
        """Evict pairs at absolute positions ``start + j`` where ``mask[b, h, j]`` is True.

        Positions no longer stored (slid out of a sliding-window layer) are ignored. Nothing is read back from
        the device.
        """
        check_evict_mask(mask, tuple(self.keep.shape[:2]), start, self.seen)
        n = mask.shape[-1]
        if n == 0:
            return
        stored = self.keep.shape[-1]
        offset = start - (self.seen - stored)  # index of ``start`` in the stored tensor
        lo, hi = max(offset, 0), min(offset + n, stored)
        if lo >= hi:
            return
        mask = mask[..., lo - offset : hi - offset].to(self.keep.device)
        window = self.keep[..., lo:hi]
        newly = window & mask
        # Out of place on purpose: snapshots share tensors with the live cache.
        self.keep = torch.cat([self.keep[..., :lo], window & ~mask, self.keep[..., hi:]], dim=-1)
        self.n_evicted = self.n_evicted + newly.sum(-1)
        self._evict_called = True

    def kept_counts(self) -> torch.Tensor:
        return self.keep.sum(-1)

    def keep_mask(self) -> torch.Tensor:
        return self.keep

    def attend(self, module, query, key, value, attention_mask, scaling, dropout=0.0):
        keep = self._attn_keep[..., -key.shape[-2] :]
        return masked_sdpa(query, key, value, keep, attention_mask, scaling, dropout), None

    def crop(self, arg: int) -> None:
        n = crop_count(self.keys.shape[-2] if self.keys is not None else 0, arg)
        if n > 0:
            removed = self.keep[..., -n:]
            self.n_evicted = self.n_evicted - (~removed).sum(-1)
            self.keep = self.keep[..., :-n]
            self.seen -= n
            super().crop(-n)

    def reset(self) -> None:
        super().reset()
        self._init_masked()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keep is not None:
            self._select_press_state(torch.arange(self.keep.shape[0]).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)
        if self.keep is not None:
            self.keep = self.keep.repeat_interleave(repeats, dim=0)
            self.n_evicted = self.n_evicted.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keep is not None:
            self._select_press_state(torch.arange(self.keep.shape[0])[torch.as_tensor(indices).cpu()].reshape(-1))
        super().batch_select_indices(indices)
        if self.keep is not None:
            self.keep = self.keep[indices]
            self.n_evicted = self.n_evicted[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.keep is not None:
            self._select_press_state(beam_idx.cpu().reshape(-1))
        super().reorder_cache(beam_idx)
        if self.keep is not None:
            self.keep = self.keep.index_select(0, beam_idx.to(self.keep.device))
            self.n_evicted = self.n_evicted.index_select(0, beam_idx.to(self.keep.device))


class _GrowBuffer:
    """Dense keys and values ``(B, H, capacity, d)`` with room to append in place.

    ``claimed`` is the longest prefix a snapshot has seen: the buffer is written in place only from there on
    (a layer appending below it, after a crop or a restore to an earlier snapshot, takes a new buffer).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values, self.claimed = keys, values, 0


class _AppendInPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into a buffer with spare room instead of concatenating.

    transformers' layer concatenates (a new tensor per update). With a checkpoint alive (the pipeline's, between
    questions), the checkpoint would then keep the old tensors and the layer a full copy of them: two dense
    caches. Here ``keys``/``values`` are views of a :class:`_GrowBuffer` and an update writes after them, where no
    snapshot looks; the buffer is reallocated with 1/64 spare room (plus 16 tokens) when full.
    """

    _buf: _GrowBuffer | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q_len = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        buf = self._buf
        backed = (
            buf is not None
            and n > 0
            and self.keys.untyped_storage().data_ptr() == buf.keys.untyped_storage().data_ptr()
            and buf.keys.shape[:2] == key_states.shape[:2]
        )
        if not backed or n + q_len > buf.keys.shape[-2] or n < buf.claimed:
            # First update, tensors replaced by a batch operation, no room left, or a snapshot sees slots from n on.
            capacity = n + q_len + (n + q_len) // 64 + 16
            bsz, heads = key_states.shape[:2]
            buf = self._buf = _GrowBuffer(
                key_states.new_empty(bsz, heads, capacity, key_states.shape[-1]),
                value_states.new_empty(bsz, heads, capacity, value_states.shape[-1]),
            )
            if n:
                buf.keys[:, :, :n] = self.keys
                buf.values[:, :, :n] = self.values
        buf.keys[:, :, n : n + q_len] = key_states
        buf.values[:, :, n : n + q_len] = value_states
        self.keys, self.values = buf.keys[:, :, : n + q_len], buf.values[:, :, : n + q_len]
        return self.keys, self.values


class MaskedLayer(_MaskedStorage, _AppendInPlaceLayer):
    """A full-attention ``DynamicLayer`` whose evicted pairs are masked out per KV head."""

    # _buf: shared with snapshots; written in place only past the longest prefix a snapshot has seen.
    _SHARED_FIELDS = _MaskedStorage._SHARED_FIELDS | {"_buf"}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._init_masked()
        self._buf = None

    def reset(self) -> None:
        super().reset()
        self._buf = None

    def snapshot(self) -> LayerState:
        if self._buf is not None and self.keys is not None:
            self._buf.claimed = max(self._buf.claimed, self.keys.shape[-2])
        return super().snapshot()

    def held_objects(self) -> list[Any]:
        buf = [] if self._buf is None else [self._buf.keys, self._buf.values]
        return [*super().held_objects(), *buf]


class MaskedSlidingWindowLayer(_MaskedStorage, DynamicSlidingWindowLayer):
    """A sliding-window ``DynamicSlidingWindowLayer`` (Mistral, Gemma3 local layers) with per-head eviction."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._init_masked()

    def end_forward(self) -> None:
        super().end_forward()
        own_window(self)


def own_window(layer: DynamicSlidingWindowLayer) -> None:
    """Give a sliding-window layer's stored window storage of its own once a forward appended several tokens.

    transformers' ``DynamicSlidingWindowLayer.update`` stores a slice of the concatenation of its window and the
    new tokens, so after a prefill of ``T`` tokens the layer keeps all ``T`` pairs alive until its next update
    (every 5.x release we support). Cloning the window (and a masked layer's ``keep`` mask, sliced the same way)
    bounds the layer by its window as soon as the forward ends, with the same values, so logits do not change.
    A decoding step leaves one slid-out pair behind, as transformers does: copying the window on every step to
    free it would cost more than it frees.
    """
    for name in ("keys", "values", "keep"):
        value = getattr(layer, name, None)
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        own = value.numel() * value.element_size()
        one_token = own // value.shape[-2] if value.dim() == 4 else own // value.shape[-1]
        if value.untyped_storage().nbytes() > own + one_token:
            # Replaced, never written in place: a snapshot sharing the old tensor keeps it.
            setattr(layer, name, value.clone(memory_format=torch.contiguous_format))


def prunable_layer_like(layer: Any) -> PrunableLayer:
    """A fresh prunable layer replacing an empty transformers cache layer of the same kind.

    Raises
    ------
    TypeError
        For cache layers kvzap cannot prune (static, quantized, offloaded ...).
    """
    if isinstance(layer, PrunableLayer):
        return layer
    if type(layer) is DynamicSlidingWindowLayer:
        return MaskedSlidingWindowLayer(sliding_window=layer.sliding_window)
    if type(layer) is DynamicLayer:
        return MaskedLayer()
    raise TypeError(
        f"kvzap presses prune `DynamicCache` layers, got a cache layer of type {type(layer).__name__}. "
        "Pass no cache (one is created) or a `transformers.DynamicCache`."
    )


def _check_cache_arg(cache: Any, what: str) -> None:
    if not isinstance(cache, Cache):
        raise TypeError(
            f"{what} takes a transformers Cache (the `past_key_values` of a forward, e.g. a DynamicCache), got "
            f"{type(cache).__name__}."
        )


def snapshot_cache(cache: Cache) -> list[Any]:
    """Cheap checkpoint of a dynamic cache: what each layer needs for a restore, its tensors shared, never
    copied (prunable layers give a :class:`LayerState`)."""
    _check_cache_arg(cache, "snapshot_cache")
    states = []
    for layer in cache.layers:
        if isinstance(layer, PrunableLayer):
            states.append(layer.snapshot())
        elif type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
            # These layers grow by concatenation (new tensors), so references are a faithful checkpoint.
            states.append(dict(layer.__dict__))
        else:
            raise TypeError(
                f"Cannot checkpoint a cache layer of type {type(layer).__name__}; use a `transformers.DynamicCache`."
            )
    return states


def restore_cache(cache: Cache, states: list[Any]) -> None:
    """Bring a cache back to a :func:`snapshot_cache` checkpoint (layers added since are dropped)."""
    _check_cache_arg(cache, "restore_cache")
    if not isinstance(states, list):
        raise TypeError(f"states must be the list snapshot_cache returned, got {type(states).__name__}.")
    if len(states) > len(cache.layers):
        # Checked before anything changes: a strict zip would fail halfway through the restore.
        raise ValueError(
            f"The checkpoint holds {len(states)} layers but the cache {len(cache.layers)}: restore a checkpoint into "
            "the cache it was taken of."
        )
    del cache.layers[len(states) :]
    for layer, state in zip(cache.layers, states, strict=True):
        if isinstance(layer, PrunableLayer):
            layer.restore(state)
        else:
            layer.__dict__.update(state)


class KVBytes(NamedTuple):
    """Bytes of a cache's keys and values."""

    kept: int  # pairs attention can see
    physical: int  # memory the layers hold: storage, bookkeeping (host tables included) and press state
    full: int  # the same tokens without any eviction


def kv_bytes(cache: Cache) -> KVBytes:
    """Kept, held and unpruned bytes of the keys and values of ``cache``.

    ``physical`` counts every tensor storage (whole, once) and numpy array that a prunable layer holds: its
    storage (compact: the block pool with positions, bias and owners; masked: the dense pairs and the mask), its
    host-side tables, ``n_evicted``, and the press's per-sequence state (pending scores, buffered hidden states,
    keys and values of tokens waiting in the window).
    """
    _check_cache_arg(cache, "kv_bytes")
    kept = physical = full = 0
    for layer in cache.layers:
        if isinstance(layer, PrunableLayer):
            layer._settle()  # pending writes and catch-ups first: what the layer holds from now on
            physical += _tensor_bytes(layer.held_objects())
        if hasattr(layer, "kept_bytes"):  # compact storage counts its kept and full pairs itself
            kept += layer.kept_bytes()
            full += layer.full_bytes()
            continue
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        bsz, n_heads, stored, head_dim = layer.keys.shape
        pair_bytes = 2 * head_dim * layer.keys.element_size()
        dense = bsz * n_heads * stored * pair_bytes
        full += dense
        if isinstance(layer, PrunableLayer):
            kept += int(layer.kept_counts().sum()) * pair_bytes
        else:
            physical += dense
            kept += dense
    return KVBytes(kept, physical, full)
