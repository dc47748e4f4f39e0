"""The attention function kvzap registers with transformers, and how it finds the cache layer to read.

``transformers.AttentionInterface`` maps an implementation name to a function; a press applied to a model
switches the model to :data:`ATTENTION_NAME` for the duration of the ``with`` block and switches it back on
exit. Nothing is registered at import time: :func:`ensure_registered` runs the first time a press is applied,
and adding a new name to the registry changes no existing implementation.

The attention function receives the attention module but not the cache, so the press binds each attention
module to its current cache layer (in a forward pre-hook) through :func:`bind`; modules without a binding, or
whose layer can be read densely (nothing evicted from a masked layer, the first forward of a compact one), run
transformers' own sdpa unchanged, bit for bit.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvzap.cache import PrunableLayer

__all__ = ["ATTENTION_NAME", "ensure_registered", "bind", "unbind", "kvzap_attention"]

ATTENTION_NAME = "kvzap_sdpa"

# attention module -> the cache layer it reads during the current forward
_BINDINGS: weakref.WeakKeyDictionary[nn.Module, PrunableLayer] = weakref.WeakKeyDictionary()
_registered = False


def bind(module: nn.Module, layer: PrunableLayer) -> None:
    """Make ``module``'s attention read ``layer`` during the forward about to run, and mark the layer as used
    inside the press (:meth:`~kvzap.cache.PrunableLayer.begin_forward`)."""
    _BINDINGS[module] = layer
    layer.begin_forward()


def unbind(modules) -> None:
    """Forget the bindings of ``modules``; a layer whose forward never reached the press's post-hook (the forward
    raised) has it ended here, so that it holds no dense pairs of that forward."""
    for module in modules:
        layer = _BINDINGS.pop(module, None)
        if layer is not None and layer._bound:
            layer.end_forward()


def kvzap_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention that respects per-head eviction.

    Shapes follow transformers: ``query (B, Hq, q, d)``, ``key``/``value`` as returned by the cache layer,
    output ``(B, q, Hq, d)``.
    """
    layer = _BINDINGS.get(module)
    if layer is None or not layer.reads_own_storage:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("kvzap attention does not support attention logit soft-capping (e.g. Gemma2).")
    return layer.attend(module, query, key, value, attention_mask, scaling, dropout)


def ensure_registered() -> None:
    """Register :func:`kvzap_attention` and its mask function under :data:`ATTENTION_NAME` (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, kvzap_attention)
        # Without a mask function of the same name, transformers hands custom attention `attention_mask=None`.
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
