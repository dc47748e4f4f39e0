"""What every adversarial probe checks: a result equal to a reference, or a clear error raised before any state
changed (the model and the cache exactly as they were)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvzap import DMSThresholdPress, KeyNormScorer

MINUS_INF = float("-inf")


def model_fingerprint(model) -> dict:
    """Everything a press could leave behind: attention implementation, hooks, module attributes, weights."""
    modules = dict(model.named_modules())
    return {
        "attn": model.config._attn_implementation,
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._forward_hooks_with_kwargs))
            for name, m in modules.items()
        },
        "attrs": {name: sorted(vars(m)) for name, m in modules.items()},
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_model_unchanged(before: dict, model, attrs: bool = True) -> None:
    after = model_fingerprint(model)
    assert before["attn"] == after["attn"]
    assert before["hooks"] == after["hooks"]
    if attrs:
        assert before["attrs"] == after["attrs"]
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])


def cache_fingerprint(cache) -> list:
    """Types, lengths and contents of a cache's layers (an unused cache has none)."""
    rows = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        rows.append((type(layer).__name__, None if keys is None else keys.clone()))
    return rows


def assert_cache_unchanged(before: list, cache) -> None:
    after = cache_fingerprint(cache)
    assert [t for t, _ in before] == [t for t, _ in after]
    for (_, a), (_, b) in zip(before, after, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@contextlib.contextmanager
def refused(model, error: type[BaseException] | tuple, match: str, cache=None, attrs: bool = True):
    """The body must raise ``error`` whose message matches ``match``, leaving the model (and cache) unchanged.

    ``attrs=False`` skips the module attributes (``generate`` itself stores a static cache on the model).
    """
    before = model_fingerprint(model)
    cache_before = cache_fingerprint(cache) if cache is not None else None
    with pytest.raises(error, match=match):
        yield
    assert_model_unchanged(before, model, attrs)
    if cache is not None:
        assert_cache_unchanged(cache_before, cache)


def inf_press(storage: str = "compact", **kwargs) -> DMSThresholdPress:
    """A press that evicts nothing: its results must equal the model's without any press."""
    return DMSThresholdPress(KeyNormScorer(), threshold=MINUS_INF, storage=storage, **kwargs)


def pruning_press(storage: str = "compact", window: int = 4, decoding: bool = True, **kwargs) -> DMSThresholdPress:
    """A press evicting about half of the pairs outside a small window (minus a tiny model's key norm is ~ -0.6)."""
    return DMSThresholdPress(
        KeyNormScorer(), threshold=-0.6, sliding_window_size=window, decoding=decoding, storage=storage, **kwargs
    )


def evicted_sets(cache) -> list[torch.Tensor]:
    """Per layer, the ``(batch, kv_heads, stored)`` mask of evicted pairs."""
    return [~layer.keep_mask() for layer in cache.layers]
