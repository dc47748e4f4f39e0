"""Left-padded batches under a press: reading each row's padding from the attention mask, and evicting it.

Padded batches (left padding, as ``generate`` pads decoder-only models): each row's padding columns are evicted
right after the attention of the forward that appended them, before the press decides anything, so they are never
attended afterwards, never stored by the compact storage, and never counted in a statistic (they are taken off
both the evicted and the seen counts of their row). The press's own decisions on padding columns are ignored.

The pad counts are read on the host from a sequence's first forward only (a 2-D mask, or the 4-D causal mask
transformers builds from it); later forwards check the mask's shape without reading it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvzap import _compat
from kvzap.cache import PrunableLayer
from kvzap.layers import is_sliding_module

__all__ = ["pad_columns"]


def _left_padding(attention_mask: Any, read: bool = True) -> tuple[torch.Tensor, int] | None:
    """The pad counts of a left-padded batch: ``((B,) long, their max)``, or None without padding (or when
    ``read`` is False: the mask's type and shape are checked, its values not read).

    A 2-D mask ``(B, n)`` marks padding with zeros, which must all come before the row's first one (left padding,
    as ``generate`` pads decoder-only models). A 4-D mask ``(B, 1, q, kv)`` is a custom pattern (packed
    sequences, prefix-LM) that eviction cannot honour, since evicted pairs are hidden by kvzap's own masks: it is
    refused whatever it holds. Reads the mask on the host once per forward.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"kvzap presses take attention_mask as a tensor (batch, tokens) or None, got "
            f"{type(attention_mask).__name__}."
        )
    if attention_mask.dim() != 2:
        raise ValueError(
            f"kvzap presses take a 2-D attention_mask (batch, tokens), the 4-D causal mask of a left-padded batch, "
            f"or none at all, got a {attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}. Pass the "
            "2-D mask (batch, tokens) of a left-padded batch, or none."
        )
    if not read or not _compat.padded_rows(attention_mask):
        return None
    ones = attention_mask != 0
    if bool((ones[:, :-1] & ~ones[:, 1:]).any()):
        raise ValueError(
            "kvzap presses support left-padded batches only (zeros before each row's first token, as `generate` "
            "pads decoder-only models), but this attention mask has a zero after a one (right padding, or a hole): "
            "pad on the left (tokenizer.padding_side = 'left')."
        )
    pads = (~ones).sum(-1)  # (B,) zeros before the first one
    pad_max = int(pads.max())
    if pad_max == attention_mask.shape[-1]:
        raise ValueError(
            "A row of the attention mask holds only zeros: a sequence without tokens, or a first prefill chunk "
            "shorter than a row's padding. Drop empty sequences; in a chunked prefill, make the first chunk hold "
            "all the padding (the pipeline does)."
        )
    return pads, pad_max


def _left_padding_4d(
    mask: torch.Tensor, read: bool, inputs: Any, past: int, modules: list[nn.Module]
) -> tuple[torch.Tensor, int] | None:
    """The pad counts of a 4-D mask that is the causal mask of a left-padded batch, as :func:`_left_padding`.

    Such a mask ``(B, 1, q, past + q)`` (bool, True = may attend, or additive float: 0 or a large negative value)
    lets the query of absolute position ``p`` of row ``b`` attend to the keys ``pads[b] <= j <= p``: what
    transformers builds itself from the 2-D mask of a left-padded batch. kvzap honours exactly that pattern (a
    padding query may attend to nothing or to everything: its output is never used), and refuses any other one (packed
    sequences, prefix-LM, a sliding window drawn into the mask) before anything changes, since the pairs it
    evicts are hidden by its own masks, and a model with sliding-window layers, to which transformers would hand
    the same mask as to its full-attention layers. Only a sequence's first forward reads the mask's values; later
    ones check its shape.
    """
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"A 4-D attention_mask must be bool (True = may attend) or an additive float mask, got {mask.dtype}. "
            "Pass the 2-D mask (batch, tokens) of a left-padded batch instead."
        )
    sliding = [_compat.layer_index(m) for m in modules if is_sliding_module(m)]
    if sliding:
        raise ValueError(
            f"A 4-D attention_mask is used as-is by every layer, but layers {sliding} of this model attend through "
            "a sliding window that such a mask does not draw. Pass the 2-D mask (batch, tokens) of a left-padded "
            "batch, from which transformers builds each layer's own mask."
        )
    known = isinstance(inputs, torch.Tensor) and inputs.dim() >= 2
    batch, q_len = (int(inputs.shape[0]), int(inputs.shape[1])) if known else (mask.shape[0], mask.shape[2])
    if mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_len, past + q_len):
        raise ValueError(
            f"A 4-D attention_mask must have shape (batch, 1, new tokens, cached + new tokens) = ({batch}, 1, "
            f"{q_len}, {past + q_len}) for this forward, got {tuple(mask.shape)}. Pass the 2-D mask (batch, "
            "tokens) of a left-padded batch instead."
        )
    rows, keys = q_len, past + q_len
    if not read:
        return None
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    allowed = allowed[:, 0]  # (B, q, kv)
    last = allowed[:, -1]  # (B, kv): the last token of each row is a real one
    if not bool(last.any(dim=-1).all()):
        raise ValueError(
            "A row of the 4-D attention_mask lets its last token attend to nothing: a sequence without tokens. "
            "Drop empty sequences."
        )
    pads = last.to(torch.uint8).argmax(dim=-1)  # (B,) first key the last token may attend to
    positions = past + torch.arange(rows, device=mask.device)  # (q,) absolute positions of the queries
    columns = torch.arange(keys, device=mask.device)
    expected = (columns[None, None, :] >= pads[:, None, None]) & (columns[None, None, :] <= positions[None, :, None])
    real = positions[None, :] >= pads[:, None]  # (B, q) queries of real tokens
    # A padding query attends to nothing (transformers' own masks), or to everything (the legacy masks that
    # unmask fully masked rows for sdpa); anything else is a pattern of its own (e.g. a first packed document).
    padding_rows_ok = ~allowed.any(dim=-1) | allowed.all(dim=-1)  # (B, q)
    if not bool((allowed == expected)[real].all()) or not bool(padding_rows_ok[~real].all()):
        raise ValueError(
            "This 4-D attention_mask is not the causal mask of a left-padded batch (each token attending to every "
            "earlier real token and itself): custom patterns (packed sequences, prefix-LM, windows) cannot be "
            "combined with eviction, since kvzap hides evicted pairs with its own masks. Pass the 2-D mask "
            "(batch, tokens) of a left-padded batch, or none."
        )
    pads = pads.long().expand(batch)  # a mask of batch 1 serves every row
    pad_max = int(pads.max())
    if pad_max == 0:
        return None
    return pads, pad_max


def _evict_padding(layer: PrunableLayer, q_len: int) -> None:
    """Evict the padding columns among the ``q_len`` pairs the layer's last update appended.

    Called before the press decides anything, so that the compact storage never stores them; the pairs this
    evicts are added to the layer's ``_PAD_EVICTED`` counts (a sliding-window layer may no longer store some).
    """
    state = layer.press_state
    pad_max = state.get(_PAD_MAX, 0)
    first = layer.seen - q_len
    if pad_max <= first:
        return
    pads = state[_PADS]
    n = min(pad_max, layer.seen) - first
    columns = torch.arange(first, first + n, device=pads.device)
    mask = (columns[None, :] < pads[:, None])[:, None, :].expand(-1, layer.n_evicted.shape[1], -1)  # (B, H, n)
    before = layer.n_evicted
    layer.evict(first, mask)
    state[_PAD_EVICTED] = state[_PAD_EVICTED] + (layer.n_evicted - before).to(pads.device)


def pad_offsets(layer: PrunableLayer) -> tuple[torch.Tensor | None, int]:
    """``(B,)`` padding columns before each row's first token (None without padding), and their maximum (an int
    known on the host: reading it syncs no device)."""
    pads = layer.press_state.get(_PADS)
    return pads, (int(layer.press_state[_PAD_MAX]) if pads is not None else 0)


def pad_columns(layer: PrunableLayer, first: int, n: int) -> torch.Tensor | None:
    """``(B, n)`` True where columns ``first .. first + n - 1`` of the layer are padding; None without padding."""
    pads = layer.press_state.get(_PADS)
    if pads is None or layer.press_state[_PAD_MAX] <= first:
        return None
    return torch.arange(first, first + n, device=pads.device)[None, :] < pads[:, None]


# Keys of a layer's press_state that the base press owns (a sequence's padding), whatever press subclass runs.
_PADS, _PAD_MAX, _PAD_EVICTED = "pads", "pad_max", "pad_evicted"
