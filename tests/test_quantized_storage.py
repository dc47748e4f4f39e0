"""Compact storage with the kept pairs quantized (``kv_bits`` 8 or 4): codes and scales, both attention paths,
bytes measured from outside, snapshots, crops, batch operations, every generate mode, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from benchmarks.outside import full_cache_bytes, model_storage_keys, reachable_bytes
from kvzap import _compat
from kvzap.cache import kv_bytes, restore_cache, snapshot_cache
from kvzap.compact import CompactLayer, compact_layer_like
from kvzap.paged import kernels
from kvzap.paged.attention import paged_attention
from kvzap.paged.pool import BlockPool
from kvzap.paged.quant import dequantize, group_size, quantize
from kvzap.presses.baseline_scorers import RandomScorer
from kvzap.presses.threshold import DMSThresholdPress
from tests.adversarial._probe import assert_model_unchanged, model_fingerprint, pruning_press
from tests.conftest import random_ids, tiny_model
from tests.test_compact import _steps


class _FourBitStoragePress(DMSThresholdPress):
    """The storage's 4-bit codes under a press, which presses refuse (``kv_bits=4``): what a study runs."""

    def _storage_layer(self, layer):
        return compact_layer_like(layer, kv_bits=4)


def _press(kv_bits, threshold=0.7, window=4, **kwargs):
    """A threshold press storing at ``kv_bits`` (4: through :class:`_FourBitStoragePress`)."""
    if isinstance(kv_bits, int) and not isinstance(kv_bits, bool) and kv_bits == 4:
        factory, kv_bits = _FourBitStoragePress, None
    else:
        factory = DMSThresholdPress
    return factory(
        RandomScorer(seed=0), threshold=threshold, sliding_window_size=window, decoding=True, kv_bits=kv_bits, **kwargs
    )


@pytest.fixture(scope="module")
def wide():
    """Head size 64, as in SmolLM2-135M: groups and per-slot scales weigh what they weigh on the real model."""
    return tiny_model("llama", hidden_size=256, max_position_embeddings=8192)


@pytest.fixture
def kernel_state():
    saved = (kernels._enabled, kernels._op, kernels._error)
    yield
    kernels._enabled, kernels._op, kernels._error = saved


def _kernel_or_skip():
    try:
        return kernels.build()
    except Exception as exc:  # no compiler or ninja here
        pytest.skip(f"the CPU decode kernel cannot be built here: {exc}")


# --- codes and scales -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_codes_round_to_the_nearest_level_of_each_group(bits):
    torch.manual_seed(0)
    x = torch.randn(50, 64) * torch.linspace(0.1, 20, 64)  # channels of very different ranges (outliers)
    codes, scales = quantize(x, bits)
    group = group_size(bits, 64)
    assert codes.dtype == torch.uint8 and codes.shape == (50, 64 if bits == 8 else 32)
    assert scales.dtype == torch.float16 and scales.shape == (50, 64 // group, 2)
    back = dequantize(codes, scales, bits, torch.float32)
    step = scales[..., 0].float().repeat_interleave(group, -1)  # (50, 64) the step of each channel's group
    assert ((back - x).abs() <= 0.5 * step * 1.01 + 1e-6).all()
    if bits == 4:  # two channels per byte, the even one in the low nibble
        low = (x[:, 0] - scales[:, 0, 1].float()) / scales[:, 0, 0].float()
        assert torch.equal((codes[:, 0] & 15).long(), low.round().clamp(0, 15).long())


def test_a_head_size_that_is_not_a_multiple_of_the_group_takes_one_group():
    x = torch.randn(3, 24)
    codes, scales = quantize(x, 8)
    assert scales.shape == (3, 1, 2) and codes.shape == (3, 24)
    assert (dequantize(codes, scales, 8, torch.float32) - x).abs().max() < 0.02


# --- both attention paths ---------------------------------------------------------------------------------------
def _random_pool(bits, dtype=torch.float32, nu=7, bs=8, d=64, nh=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = BlockPool(bs, bits)
    like = torch.zeros(1, d, dtype=dtype)
    pool.allocate(nu, like, like, free_owner=nh)
    slots = np.flatnonzero(np.random.default_rng(seed).random(nu * bs) < 0.8)
    keys = torch.randn(len(slots), d, generator=gen).to(dtype)
    values = torch.randn(len(slots), d, generator=gen).to(dtype)
    pool.write(slots, keys, values, torch.from_numpy(slots.astype(np.int32)))
    pool.set_owner(list(range(nu)), [b % nh for b in range(nu)])
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernel_reads_the_codes_as_the_generic_path_reads_the_dequantized_pairs(bits, dtype):
    op = _kernel_or_skip()
    pool = _random_pool(bits, dtype)
    query = torch.randn(1, 6, 1, 64).to(dtype)  # 3 KV heads, groups of 2
    keys, values = pool.block_pairs(pool.num_blocks)
    generic = paged_attention(query, keys, values, pool.positions, pool.bias, pool.owner, 3, 0.125)
    fused = op(
        query, pool.keys, pool.values, pool.bias, pool.owner, pool.positions, None, pool.num_blocks, 3, 0.125,
        pool.key_scales, pool.value_scales, bits,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, generic, atol=tol, rtol=tol)


def test_the_kernel_refuses_codes_without_scales_or_with_the_wrong_bits():
    op = _kernel_or_skip()
    pool = _random_pool(8)
    query = torch.randn(1, 3, 1, 64)
    args = (query, pool.keys, pool.values, pool.bias, pool.owner, pool.positions, None, pool.num_blocks, 3, 0.1)
    with pytest.raises(RuntimeError, match="scales"):
        op(*args, None, None, 8)
    with pytest.raises(RuntimeError, match="bits"):
        op(*args, pool.key_scales, pool.value_scales, 5)
    with pytest.raises(RuntimeError, match="dtype"):
        op(*args)  # uint8 codes read as float pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_fused_store_writes_the_codes_and_scales_of_quantize(bits, dtype, kernel_state):
    """pool.write through the fused quantize-and-store operator equals quantize() and a copy, bit for bit
    (constant vectors, whose scale is 0, and groups of very different ranges included)."""
    _kernel_or_skip()
    gen = torch.Generator().manual_seed(1)
    keys = (torch.randn(40, 64, generator=gen) * torch.linspace(0.05, 30, 64)).to(dtype)
    values = torch.randn(40, 64, generator=gen).to(dtype)
    keys[5], values[7] = 0.25, -3.0
    slots = np.random.default_rng(1).permutation(6 * 8)[:40]
    pools = {}
    for enabled in (True, False):
        kernels.set_kernels(enabled)
        pool = pools[enabled] = BlockPool(8, bits)
        pool.allocate(6, keys[:1], values[:1], free_owner=3)
        assert (pool._quantize_kernel(keys) is not None) is enabled
        pool.write(slots, keys, values, 3)
    for name in ("keys", "values", "key_scales", "value_scales", "positions", "bias"):
        assert torch.equal(getattr(pools[True], name), getattr(pools[False], name)), name


def test_the_fused_store_refuses_slots_out_of_range_and_mismatched_codes():
    _kernel_or_skip()
    op = torch.ops.kvzap.quantize_store
    codes = torch.zeros(2, 4, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 4, 2, 2, dtype=torch.float16)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        op(codes, scales, torch.tensor([0, 8]), x, 8, 32)
    with pytest.raises(RuntimeError, match="codes"):
        op(codes[..., :32], scales, torch.tensor([0, 1]), x, 8, 32)
    with pytest.raises(RuntimeError, match="bits"):
        op(codes, scales, torch.tensor([0, 1]), x, 5, 32)
    assert not codes.any() and not scales.any()  # nothing written before a refusal


@pytest.mark.parametrize("bits", [8, 4])
def test_decoding_with_and_without_the_kernel_gives_the_same_logits(wide, bits, kernel_state):
    """The generic path (also CUDA's) against the fused CPU kernel, through the model."""
    _kernel_or_skip()
    runs = {}
    for enabled in (True, False):
        kernels.set_kernels(enabled)
        runs[enabled] = _steps(wide, _press(bits), DynamicCache(config=wide.config), 2, prefill=200)
    for step, (a, b) in enumerate(zip(runs[True], runs[False], strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {step}")


# --- accuracy ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bits", "tolerance"), [(8, 0.02), (4, 0.2)])
def test_quantized_pairs_give_logits_close_to_the_models_dtype_with_the_same_evictions(wide, bits, tolerance):
    reference_press, press = _press(None), _press(bits)
    ref_cache, cache = DynamicCache(config=wide.config), DynamicCache(config=wide.config)
    reference = _steps(wide, reference_press, ref_cache, 1, prefill=300)
    quantized = _steps(wide, press, cache, 1, prefill=300)
    scale = torch.cat([r[:, -1] for r in reference]).std()
    worst = max(float((a - b).abs().max()) for a, b in zip(reference, quantized, strict=True))
    assert 0 < worst < tolerance * float(scale)  # quantized, and close
    assert press.compression_ratio == reference_press.compression_ratio > 0.5
    for a, b in zip(ref_cache.layers, cache.layers, strict=True):
        assert torch.equal(a.kept_counts(), b.kept_counts())


# --- bytes ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bits", "dtype", "goal"), [(8, torch.float32, 0.12), (4, torch.float32, 0.07), (8, torch.bfloat16, 0.20)]
)
@torch.no_grad()
def test_bytes_measured_from_outside_meet_the_goals_and_equal_the_accounting(bits, dtype, goal):
    """~70% evicted over 8k tokens (P(N(0, 1) < 0.52) = 0.70), SmolLM2's head size: everything reachable from the
    cache (codes, scales, positions, bias, owners, host table) against the full cache in the model's dtype."""
    model = tiny_model(
        "llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=8192
    ).to(dtype)
    press = _press(bits, threshold=0.52, window=128)
    cache, kw = DynamicCache(config=model.config), _compat.cache_kwarg_name(model)
    with press(model):
        token = model(random_ids(1, 8192, vocab=model.config.vocab_size), logits_to_keep=1, **{kw: cache}).logits
        for _ in range(8):
            token = model(token[:, -1:].argmax(-1), **{kw: cache}).logits
    evicted = press.compression_ratio
    assert 0.65 < evicted < 0.75, evicted
    kept, physical, full = kv_bytes(cache)  # first: it brings each table up to date (pending evictions reported)
    outside = reachable_bytes(cache, model_storage_keys(model)).total
    assert outside == physical  # the accounting counts the codes and scales exactly as they are held
    assert full == full_cache_bytes(model.config, 8192 + 8, dtype=dtype)
    assert outside / full <= goal, outside / full
    layer = cache.layers[0]
    assert kept == sum(sum(layer.table.n) for layer in cache.layers) * layer.pool.slot_pair_bytes()


# --- snapshots, crops, batch operations -------------------------------------------------------------------------
def _stored(layer: CompactLayer) -> dict:
    """{(batch row, head): {position: (key, value)}} as dequantized from the layer."""
    out = {}
    for b in range(layer._bsz):
        for h in range(layer._heads):
            keys, values, positions = layer.stored_pairs(b, h)
            out[b, h] = {int(p): (k, v) for k, v, p in zip(keys, values, positions, strict=True)}
    return out


def _filled(bits=8, bsz=2, seen=40):
    layer = CompactLayer(block_size=8, kv_bits=bits)
    torch.manual_seed(0)
    layer.update(torch.randn(bsz, 2, seen, 16), torch.randn(bsz, 2, seen, 16))
    mask = torch.rand(bsz, 2, seen) < 0.5
    layer.evict(0, mask)
    layer.end_forward()
    layer.update(torch.randn(bsz, 2, 3, 16), torch.randn(bsz, 2, 3, 16))
    return layer


@pytest.mark.parametrize("bits", [8, 4])
def test_repacks_crops_and_batch_operations_copy_the_codes_unchanged(bits):
    layer = _filled(bits)
    before = _stored(layer)
    layer._repack()
    assert _stored(layer).keys() == before.keys()
    for head, pairs in _stored(layer).items():
        for p, (k, v) in pairs.items():
            assert torch.equal(k, before[head][p][0]) and torch.equal(v, before[head][p][1])
    layer.reorder_cache(torch.tensor([1, 0]))
    swapped = _stored(layer)
    for (b, h), pairs in swapped.items():
        assert all(torch.equal(k, before[1 - b, h][p][0]) for p, (k, _) in pairs.items())
    layer.batch_repeat_interleave(2)  # rows 1, 1, 0, 0 of the original
    repeated = _stored(layer)
    assert all(torch.equal(repeated[2, h][p][1], before[0, h][p][1]) for h in range(2) for p in before[0, h])
    layer.crop(-(layer.seen - 30))  # forget the last tokens, down to 30
    cropped = _stored(layer)
    assert all(max(pairs, default=0) < 30 for pairs in cropped.values())
    assert all(torch.equal(cropped[0, h][p][0], before[1, h][p][0]) for h in range(2) for p in cropped[0, h])


def test_appends_into_a_block_of_quantized_pairs_leave_them_unchanged():
    layer = _filled(8)
    before = _stored(layer)
    for _ in range(5):
        layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    after = _stored(layer)
    assert all(torch.equal(after[h][p][0], k) for h, pairs in before.items() for p, (k, _) in pairs.items())


@torch.no_grad()
def test_a_snapshot_shares_the_codes_and_a_restore_gives_the_same_continuation(wide):
    # Scores from the keys (a random scorer would draw other scores after the restore).
    press, cache, kw = pruning_press(kv_bits=8), DynamicCache(config=wide.config), _compat.cache_kwarg_name(wide)
    with press(wide):
        wide(random_ids(1, 120, seed=1), **{kw: cache})
        snap = snapshot_cache(cache)
        layer = cache.layers[0]
        assert layer.pool.keys.dtype == torch.uint8 and snap[0].fields["pool"].keys is layer.pool.keys  # shared

        def continuation():
            out = [wide(random_ids(1, 5, seed=2), **{kw: cache}).logits]
            for _ in range(4):
                out.append(wide(out[-1][:, -1:].argmax(-1), **{kw: cache}).logits)
            return out

        first = continuation()
        restore_cache(cache, snap)
        second = continuation()
    assert press.compression_ratio > 0.2  # pruned too
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)  # deterministic: the same pairs quantized the same way, whatever happened between


GENERATE_MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, temperature=0.7, top_k=20),
    "beams": dict(num_beams=2, do_sample=False, max_new_tokens=5),
    "beams_return_2": dict(num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=5),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
}


def _generate(model, ids, press, **kwargs):
    torch.manual_seed(0)
    kwargs = {"max_new_tokens": 8, "pad_token_id": 0, **kwargs}
    with press(model):
        return model.generate(ids, **kwargs)


@pytest.mark.parametrize("mode", sorted(GENERATE_MODES))
def test_every_generate_mode_runs_deterministically_with_quantized_pairs(mode):
    model = tiny_model("llama")
    ids = random_ids(1 if mode == "prompt_lookup" else 2, 30, seed=3)  # speculative decoding: batch 1 only
    kwargs = dict(GENERATE_MODES[mode])
    first = _generate(model, ids, _press(8, threshold=0.0), **kwargs)
    second = _generate(model, ids, _press(8, threshold=0.0), **kwargs)
    assert torch.equal(first, second)
    reference = _generate(model, ids, _press(None, threshold=0.0), **kwargs)
    assert first.shape == reference.shape
    new = first.shape[1] - ids.shape[1]
    assert (first[:, -new:] == reference[:, -new:]).float().mean() >= 0.75  # 8 bits: mostly the same tokens


def test_assisted_generation_with_quantized_pairs_gives_the_greedy_tokens_of_quantized_pairs():
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1, num_hidden_layers=1)
    ids = random_ids(1, 30, seed=4)
    greedy = _generate(model, ids, _press(8, threshold=-math.inf), do_sample=False, max_new_tokens=12)
    assisted = _generate(
        model, ids, _press(8, threshold=-math.inf), do_sample=False, max_new_tokens=12, assistant_model=assistant
    )
    assert torch.equal(assisted, greedy)


# --- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [3, 16, 0, -8, 8.0, "8", True, float("nan")])
def test_kv_bits_other_than_none_8_or_4_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match="kv_bits"):
        _press(bad)
    with pytest.raises((TypeError, ValueError), match="kv_bits"):
        CompactLayer(kv_bits=bad)
    press = _press(8)
    with pytest.raises((TypeError, ValueError), match="kv_bits"):
        press.kv_bits = bad
    assert press.kv_bits == 8
    assert _press(np.int64(8)).kv_bits == 8


def test_a_press_refuses_4_bits_with_the_measurement_before_the_model_changes():
    """4-bit storage loses needles against pruning alone (research/kv-bits-4): presses refuse it, whether given at
    construction, set afterwards or set inside ``with press(model):``; the storage keeps its 4-bit codes."""
    with pytest.raises(ValueError, match=r"kv_bits=4 is refused.*-4\.5 points.*kv_bits=8"):
        DMSThresholdPress(RandomScorer(seed=0), threshold=0.5, kv_bits=np.int64(4))
    model = tiny_model("llama")
    press = _press(8)
    before = model_fingerprint(model)
    with pytest.raises(ValueError, match="kv_bits=4 is refused"):
        press.kv_bits = 4
    with pytest.raises(ValueError, match="kv_bits=4 is refused"):
        with press(model):
            press.kv_bits = 4
    assert press.kv_bits == 8
    assert_model_unchanged(before, model)
    assert CompactLayer(kv_bits=4).kv_bits == 4


def test_kv_bits_with_the_masked_storage_is_refused_before_the_model_changes():
    with pytest.raises(ValueError, match="storage='compact'"):
        _press(8, storage="masked")
    model = tiny_model("llama")
    press = _press(8)
    press.storage = "masked"  # each valid alone: the pair is refused on entering
    before = model_fingerprint(model)
    with pytest.raises(ValueError, match="kv_bits"):
        with press(model):
            pass
    assert_model_unchanged(before, model)


def test_4_bits_refuse_an_odd_head_size_with_a_clear_error():
    layer = CompactLayer(kv_bits=4)
    with pytest.raises(ValueError, match="odd head size"):
        layer.update(torch.randn(1, 1, 4, 7), torch.randn(1, 1, 4, 7))
