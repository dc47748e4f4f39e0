"""Where every kept KV pair lives.

A press decides *which* pairs to evict; a cache layer defined here decides *how* eviction is stored and how
attention reads what is left. Presses only talk to the small interface of :class:`PrunableLayer`:

- ``seen``: number of tokens ever appended to the layer (absolute positions ``0 .. seen - 1``);
- ``last_keys`` / ``last_values``: the new pairs of the last update, ``(batch, kv_heads, q_len, head_dim)``,
  for scorers that look at keys or values;
- ``evict(start, mask)``: evict the pairs at absolute positions ``start .. start + n - 1`` where
  ``mask`` ``(batch, kv_heads, n)`` is True; an evicted pair is never attended again by any head;
- ``n_evicted``: ``(batch, kv_heads)`` number of pairs evicted so far;
- ``press_state``: a dict that the press owns (per sequence state, e.g. scores of the tokens still inside the
  sliding window); it travels with the cache, so one press object serves any number of sequences;
- ``attend(module, query, key, value, attention_mask, scaling, dropout)``: attention over the kept pairs,
  called by the attention function registered in :mod:`kvzap.attention`;
- ``snapshot()`` / ``restore(state)``: cheap checkpoints used by the pipeline to answer several questions
  against the same compressed context.

This module provides the *masked* storage: the pairs stay in a dense ``[batch, kv_heads, seq, head_dim]``
tensor and a boolean ``keep`` mask hides the evicted ones from every head (same logits as deleting them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import Cache

from kvzap._compat import DynamicLayer, DynamicSlidingWindowLayer, crop_count

__all__ = [
    "PrunableLayer",
    "MaskedLayer",
    "MaskedSlidingWindowLayer",
    "prunable_layer_like",
    "snapshot_cache",
    "restore_cache",
    "masked_sdpa",
    "kv_bytes",
    "KVBytes",
]


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


class PrunableLayer:
    """Mixin giving a transformers cache layer the eviction interface presses use (see the module docstring)."""

    seen: int
    n_evicted: torch.Tensor | None
    press_state: dict[str, Any]
    last_keys: torch.Tensor | None
    last_values: torch.Tensor | None

    def _init_prunable(self) -> None:
        self.seen = 0
        self.n_evicted = None
        self.press_state = {}
        self.last_keys = None
        self.last_values = None

    # The interface -------------------------------------------------------------------------------------------
    def evict(self, start: int, mask: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def attend(self, module: nn.Module, query, key, value, attention_mask, scaling, dropout):  # pragma: no cover
        raise NotImplementedError

    def kept_counts(self) -> torch.Tensor:  # pragma: no cover - abstract
        """``(batch, kv_heads)`` number of pairs physically held for attention."""
        raise NotImplementedError

    def keep_mask(self) -> torch.Tensor:  # pragma: no cover - abstract
        """``(batch, kv_heads, stored)`` True for kept pairs, over the last ``stored`` positions still covered by
        the layer (all positions seen, except for sliding-window layers)."""
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def restore(self, state: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def has_evictions(self) -> bool:
        return self.n_evicted is not None and bool(self.n_evicted.any())

    @property
    def reads_own_storage(self) -> bool:
        """True when attention must go through :meth:`attend` (what ``update`` returned is not the whole cache,
        or evicted pairs must be hidden); otherwise transformers' own sdpa reads ``update``'s output."""
        return self.has_evictions


class _MaskedStorage(PrunableLayer):
    """Dense storage plus a ``keep`` mask aligned with the stored keys.

    Works on top of both ``DynamicLayer`` and ``DynamicSlidingWindowLayer``: the stored pairs always cover the
    absolute positions ``seen - stored .. seen - 1``, whatever the parent class drops.
    """

    keep: torch.Tensor | None
    _attn_keep: torch.Tensor | None

    def _init_masked(self) -> None:
        self._init_prunable()
        self.keep = None
        self._attn_keep = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
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

        Positions no longer stored (slid out of a sliding-window layer) are ignored.
        """
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
        super().batch_repeat_interleave(repeats)
        if self.keep is not None:
            self.keep = self.keep.repeat_interleave(repeats, dim=0)
            self.n_evicted = self.n_evicted.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.keep is not None:
            self.keep = self.keep[indices]
            self.n_evicted = self.n_evicted[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.keep is not None:
            self.keep = self.keep.index_select(0, beam_idx.to(self.keep.device))
            self.n_evicted = self.n_evicted.index_select(0, beam_idx.to(self.keep.device))

    # Every mutation above replaces tensors instead of writing into them, so a snapshot is a shallow copy.
    def snapshot(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["press_state"] = dict(self.press_state)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.press_state = dict(state["press_state"])


class MaskedLayer(_MaskedStorage, DynamicLayer):
    """A full-attention ``DynamicLayer`` whose evicted pairs are masked out per KV head."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._init_masked()


class MaskedSlidingWindowLayer(_MaskedStorage, DynamicSlidingWindowLayer):
    """A sliding-window ``DynamicSlidingWindowLayer`` (Mistral, Gemma3 local layers) with per-head eviction."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._init_masked()


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


def snapshot_cache(cache: Cache) -> list[dict[str, Any]]:
    """Cheap checkpoint of a dynamic cache (its tensors are shared, never copied)."""
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


def restore_cache(cache: Cache, states: list[dict[str, Any]]) -> None:
    """Bring a cache back to a :func:`snapshot_cache` checkpoint (layers added since are dropped)."""
    del cache.layers[len(states) :]
    for layer, state in zip(cache.layers, states, strict=True):
        if isinstance(layer, PrunableLayer):
            layer.restore(state)
        else:
            layer.__dict__.update(state)


class KVBytes(NamedTuple):
    """Bytes of a cache's keys and values."""

    kept: int  # pairs attention can see
    physical: int  # memory allocated for them (dense masked storage holds evicted pairs too)
    full: int  # the same tokens without any eviction


def kv_bytes(cache: Cache) -> KVBytes:
    """Kept, physically allocated and unpruned bytes of the keys and values of ``cache``."""
    kept = physical = full = 0
    for layer in cache.layers:
        if hasattr(layer, "physical_bytes"):  # compact storage accounts for itself
            kept += layer.kept_bytes()
            physical += layer.physical_bytes()
            full += layer.full_bytes()
            continue
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        bsz, n_heads, stored, head_dim = layer.keys.shape
        pair_bytes = 2 * head_dim * layer.keys.element_size()
        dense = bsz * n_heads * stored * pair_bytes
        physical += dense + (layer.keep.numel() if isinstance(layer, _MaskedStorage) else 0)
        full += dense
        if isinstance(layer, PrunableLayer) and layer.n_evicted is not None:
            kept += int(layer.kept_counts().sum()) * pair_bytes
        else:
            kept += dense
    return KVBytes(kept, physical, full)
