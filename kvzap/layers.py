"""Which attention layers kvzap prunes: the one place that decides.

A layer whose cache transformers bounds by a sliding window (Mistral with ``sliding_window``, Gemma 3's local
layers: those ``DynamicCache(config=...)`` builds as ``DynamicSlidingWindowLayer``) holds at most a window of
pairs whatever the press does, and kvzap stores it densely (masked), so evicting from it frees no memory. Such
layers are left alone by default: not scored, not evicted, not counted in the statistics, not calibrated, and
their KVzip+ targets are neither collected nor trained. ``prune_sliding_layers=True`` (on a press, on
calibration, on collection) treats them like full-attention layers.

The decision is read from the model's configuration, through the cache transformers itself would build for it,
so the press, calibration, collection and training agree on every model and transformers version.
"""

from __future__ import annotations

import weakref

from torch import nn
from transformers import DynamicCache, PreTrainedModel

from kvzap import _compat

__all__ = ["sliding_layers", "prunable_layers", "is_sliding_module", "describe"]

# attention module -> whether its layer is a sliding one (the press asks once per layer and forward)
_MODULE_IS_SLIDING: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _sliding_from_config(config) -> tuple[int, ...]:
    """Layers that ``DynamicCache(config=config)`` makes ``DynamicSlidingWindowLayer``."""
    cache = DynamicCache(config=config)
    return tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, _compat.DynamicSlidingWindowLayer))


def sliding_layers(model: PreTrainedModel) -> tuple[int, ...]:
    """Indices of the layers whose cache is bounded by a sliding window, in layer order.

    Read from ``DynamicCache(config=model.config)``: exactly the layers transformers makes
    ``DynamicSlidingWindowLayer`` (config ``layer_types`` "sliding_attention", or a ``sliding_window`` without
    ``layer_types`` as in Mistral).
    """
    return _sliding_from_config(model.config)


def is_sliding_module(module: nn.Module) -> bool:
    """True when the attention ``module``'s layer is a sliding one (same rule as :func:`sliding_layers`).

    Read from the module's own ``config`` (every supported architecture keeps it), memoised per module.
    """
    known = _MODULE_IS_SLIDING.get(module)
    if known is None:
        config = getattr(module, "config", None)
        known = config is not None and _compat.layer_index(module) in _sliding_from_config(config)
        _MODULE_IS_SLIDING[module] = known
    return known


def prunable_layers(model: PreTrainedModel, prune_sliding_layers: bool = False) -> tuple[int, ...]:
    """Indices of the layers a press scores and evicts (and calibration counts, collection stores, fitting trains).

    Parameters
    ----------
    model : a causal LM supported by kvzap.
    prune_sliding_layers : also prune the layers bounded by a sliding window (see the module docstring).

    Returns
    -------
    tuple of int, sorted; empty when every layer is a sliding one and ``prune_sliding_layers`` is False.
    """
    n_layers = len(_compat.attention_modules(model))
    if prune_sliding_layers:
        return tuple(range(n_layers))
    sliding = set(sliding_layers(model))
    return tuple(i for i in range(n_layers) if i not in sliding)


def describe(model: PreTrainedModel) -> str:
    """One sentence saying which layers are sliding, for error messages and logs."""
    sliding = sliding_layers(model)
    n_layers = len(_compat.attention_modules(model))
    if not sliding:
        return f"all {n_layers} layers of this model use full attention"
    if len(sliding) == n_layers:
        return f"all {n_layers} layers of this model use a sliding window"
    return f"layers {list(sliding)} of this model's {n_layers} use a sliding window"
