"""The masked storage: per-head masking equals deleting pairs; eviction bookkeeping; checkpoints."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import StaticLayer

from kvzap.cache import (
    MaskedLayer,
    MaskedSlidingWindowLayer,
    kv_bytes,
    masked_sdpa,
    prunable_layer_like,
    restore_cache,
    snapshot_cache,
)


def _reference_per_head(query, key, value, keep, scaling):
    """Naive reference: for every query head, physically drop the evicted pairs of its KV head."""
    bsz, n_q, q_len, d = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    groups = n_q // n_kv
    out = torch.zeros(bsz, q_len, n_q, d)
    for b in range(bsz):
        for h in range(n_q):
            kvh = h // groups
            for i in range(q_len):
                pos = kv_len - q_len + i  # causal: query i sees keys 0..pos
                idx = [j for j in range(pos + 1) if keep[b, kvh, j]]
                k, v = key[b, kvh, idx], value[b, kvh, idx]
                w = torch.softmax(query[b, h, i] @ k.T * scaling, dim=-1)
                out[b, i, h] = w @ v
    return out


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("seed", range(4))
def test_masked_sdpa_equals_deleting_pairs_per_head(q_len, seed):
    g = torch.Generator().manual_seed(seed)
    bsz, n_q, n_kv, kv_len, d = 2, 6, 3, 17, 8
    query = torch.randn(bsz, n_q, q_len, d, generator=g)
    key = torch.randn(bsz, n_kv, kv_len, d, generator=g)
    value = torch.randn(bsz, n_kv, kv_len, d, generator=g)
    keep = torch.rand(bsz, n_kv, kv_len, generator=g) > 0.4
    keep[..., -q_len:] = True  # the current tokens are always present
    out = masked_sdpa(query, key, value, keep, None, scaling=d**-0.5)
    assert out.shape == (bsz, q_len, n_q, d)
    torch.testing.assert_close(out, _reference_per_head(query, key, value, keep, d**-0.5), atol=1e-5, rtol=1e-5)


def _fill(layer, bsz=1, heads=2, length=10, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(bsz, heads, length, d, generator=g)
    return layer.update(k, k.clone())


def test_evict_counts_and_alignment():
    layer = MaskedLayer()
    _fill(layer, length=10)
    mask = torch.zeros(1, 2, 4, dtype=torch.bool)
    mask[0, 0, 1] = mask[0, 1, 3] = True
    layer.evict(2, mask)  # absolute positions 2..5
    assert layer.keep[0, 0].tolist() == [True] * 3 + [False] + [True] * 6
    assert layer.keep[0, 1].tolist() == [True] * 5 + [False] + [True] * 4
    assert layer.n_evicted.tolist() == [[1, 1]]
    layer.evict(2, mask)  # evicting twice counts once
    assert layer.n_evicted.tolist() == [[1, 1]]
    assert layer.kept_counts().tolist() == [[9, 9]]
    assert layer.seen == 10 and layer.last_keys.shape == (1, 2, 10, 4)


def test_sliding_layer_keeps_mask_aligned_with_stored_pairs():
    layer = MaskedSlidingWindowLayer(sliding_window=6)
    keys, _ = _fill(layer, length=8)
    assert keys.shape[-2] == 8 and layer.keys.shape[-2] == 5  # stores sliding_window - 1
    assert layer._attn_keep.shape[-1] == 8 and layer.keep.shape[-1] == 5
    mask = torch.ones(1, 2, 8, dtype=torch.bool)
    layer.evict(0, mask)  # only positions 3..7 are still stored
    assert layer.n_evicted.tolist() == [[5, 5]]
    assert not layer.keep.any()


def test_crop_restores_counts():
    layer = MaskedLayer()
    _fill(layer, length=10)
    layer.evict(8, torch.ones(1, 2, 2, dtype=torch.bool))
    layer.crop(-3)
    assert layer.seen == 7 and layer.keys.shape[-2] == 7 and layer.keep.shape[-1] == 7
    assert layer.n_evicted.tolist() == [[0, 0]]


def test_snapshot_restore_undoes_updates_evictions_and_press_state():
    cache = DynamicCache()
    cache.layers.append(MaskedLayer())
    layer = cache.layers[0]
    _fill(layer, length=6)
    layer.press_state["pending"] = torch.zeros(1, 2, 3)
    snap = snapshot_cache(cache)
    _fill(layer, length=3, seed=1)
    layer.evict(0, torch.ones(1, 2, 6, dtype=torch.bool))
    layer.press_state["pending"] = torch.ones(1, 2, 1)
    restore_cache(cache, snap)
    assert layer.seen == 6 and layer.keys.shape[-2] == 6 and bool(layer.keep.all())
    assert layer.n_evicted.sum() == 0 and layer.press_state["pending"].shape == (1, 2, 3)


def test_kv_bytes_counts_kept_pairs():
    cache = DynamicCache()
    cache.layers.append(MaskedLayer())
    layer = cache.layers[0]
    _fill(layer, length=10, d=4)
    layer.evict(0, torch.ones(1, 2, 5, dtype=torch.bool))
    # The dense pairs sit in buffers with room for 10 // 64 + 16 more tokens (appended in place).
    buffers = 2 * (2 * 26 * 4 * 4)
    # Within the forward, the layer also holds the new pairs (the press reads them) ...
    assert kv_bytes(cache).physical == buffers + 2 * (2 * 10 * 4 * 4) + 2 * 10 + 2 * 10 + 2 * 8
    layer.end_forward()
    layer.press_state["pending"] = torch.zeros(1, 2, 3)
    kept, physical, full = kv_bytes(cache)
    assert full == 2 * 10 * 2 * 4 * 4 and kept == full // 2
    # ... after it: every pair (masked storage), the keep mask, n_evicted and the press's state.
    assert physical == buffers + 2 * 10 + 2 * 8 + 2 * 3 * 4


def test_masked_layers_append_in_place_where_no_snapshot_looks():
    cache = DynamicCache()
    cache.layers.append(MaskedLayer())
    layer = cache.layers[0]
    _fill(layer, length=10)
    storage = layer.keys.untyped_storage().data_ptr()
    snap = snapshot_cache(cache)
    _fill(layer, length=3, seed=1)  # after the snapshot's 10 positions: in place, nothing copied
    assert layer.keys.untyped_storage().data_ptr() == storage and layer.keys.shape[-2] == 13
    restore_cache(cache, snap)
    _fill(layer, length=2, seed=2)  # the same slots again: the snapshot does not see them
    assert layer.keys.untyped_storage().data_ptr() == storage
    layer.crop(-5)  # now at 7 < 10, which the snapshot sees: the next append takes a new buffer
    _fill(layer, length=1, seed=3)
    assert layer.keys.untyped_storage().data_ptr() != storage
    restore_cache(cache, snap)
    expected = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer.keys, expected) and torch.equal(layer.values, expected)
    _fill(layer, length=40, seed=4)  # no room left: a larger buffer
    assert layer.keys.shape[-2] == 50 and torch.equal(layer.keys[:, :, :10], expected)


def test_unprunable_layers_are_refused():
    with pytest.raises(TypeError, match="DynamicCache"):
        prunable_layer_like(StaticLayer(max_cache_len=8))
