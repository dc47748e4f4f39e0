"""Compact storage: same logits as the masked storage, exact byte accounting, slot reuse, checkpoints."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvzap import _compat
from kvzap.cache import MaskedLayer, restore_cache, snapshot_cache
from kvzap.compact import CompactLayer, compact_layer_like
from kvzap.presses.baseline_scorers import ConstantScorer, RandomScorer
from kvzap.presses.threshold import DMSThresholdPress
from tests.conftest import random_ids, tiny_model

# Families with at least one full-attention layer (Mistral's tiny config is sliding-only: masked storage).
FULL_ATTENTION_FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma3_text"]


def _press(threshold=0.0, window=4, scorer=None, storage="compact"):
    # Sliding-window layers pruned too: these tests compare both storages on every kind of layer.
    return DMSThresholdPress(
        scorer or RandomScorer(seed=0),
        threshold=threshold,
        sliding_window_size=window,
        decoding=True,
        storage=storage,
        prune_sliding_layers=True,
    )


def _steps(model, press, cache, batch, prefill=40, question=6, n_decode=5):
    """Prefill, one multi-token question step, then greedy decoding; returns the logits of every forward."""
    kw = _compat.cache_kwarg_name(model)
    logits = []
    with torch.no_grad(), press(model):
        logits.append(model(random_ids(batch, prefill, seed=1), **{kw: cache}).logits)
        logits.append(model(random_ids(batch, question, seed=2), **{kw: cache}).logits)
        for _ in range(n_decode):
            token = logits[-1][:, -1:].argmax(-1)
            logits.append(model(token, **{kw: cache}).logits)
    return logits


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", FULL_ATTENTION_FAMILIES)
def test_compact_and_masked_give_the_same_logits(family, batch):
    model = tiny_model(family)
    runs = {}
    for compact in (False, True):
        cache, press = DynamicCache(config=model.config), _press(storage="compact" if compact else "masked")
        runs[compact] = (_steps(model, press, cache, batch), cache, press)
    (masked_logits, masked_cache, _), (compact_logits, compact_cache, compact_press) = runs[False], runs[True]
    assert any(isinstance(layer, CompactLayer) for layer in compact_cache.layers)
    assert 0.2 < compact_press.compression_ratio < 0.8  # pruning really happened
    for step, (a, b) in enumerate(zip(masked_logits, compact_logits, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    for masked, compact in zip(masked_cache.layers, compact_cache.layers, strict=True):
        # Same decisions, and the compact layer stores exactly the kept pairs.
        assert torch.equal(compact.n_evicted, masked.n_evicted)
        assert torch.equal(compact.kept_counts(), masked.kept_counts())
        if isinstance(compact, CompactLayer):
            assert torch.equal(compact.kept_counts(), compact.seen - compact.n_evicted)
            stored = torch.tensor(
                [[compact.table.n[b * compact._heads + h] for h in range(compact._heads)] for b in range(batch)]
            )
            assert torch.equal(stored, compact.kept_counts())


def test_positions_and_seq_length_match_the_unpruned_cache():
    model = tiny_model("llama")
    pruned, dense = DynamicCache(config=model.config), DynamicCache(config=model.config)
    _steps(model, _press(), pruned, batch=1)
    _steps(model, _press(threshold=float("-inf")), dense, batch=1)
    assert pruned.get_seq_length() == dense.get_seq_length() == 40 + 6 + 5
    assert pruned.layers[0].kept_counts().sum() < pruned.layers[0].seen * pruned.layers[0]._heads
    # Positions are exact: the pruned logits equal those of the masked storage (see above) and of explicit ids.
    kw = _compat.cache_kwarg_name(model)
    snap = snapshot_cache(pruned)
    with torch.no_grad(), _press()(model):
        implicit = model(random_ids(1, 3, seed=5), **{kw: pruned}).logits
        restore_cache(pruned, snap)
        explicit = model(random_ids(1, 3, seed=5), position_ids=torch.arange(51, 54)[None], **{kw: pruned}).logits
    torch.testing.assert_close(implicit, explicit)


def test_physical_bytes_follow_kept_pairs():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    _steps(model, _press(threshold=0.5), cache, batch=2, prefill=600, n_decode=1)
    layer = cache.layers[0]
    d = model.config.hidden_size // model.config.num_attention_heads
    pair_bytes = 2 * d * 4  # fp32 key + value
    bs = layer.block_size
    assert layer.kept_bytes() == int(layer.kept_counts().sum()) * pair_bytes
    assert layer.full_bytes() == 2 * layer._heads * layer.seen * pair_bytes
    kept, cap = layer.kept_counts(), layer.capacities()
    # Each head holds whole blocks, only its last one partly filled.
    assert bool((cap >= kept).all()) and bool((cap - kept < bs).all())
    # The pool: the heads' blocks plus a few unused ones; per slot a key, a value, a position and a bias.
    assert layer.num_blocks * bs >= int(cap.sum()) and layer.num_blocks <= int(cap.sum()) // bs * 33 // 32 + 4
    pool = layer.num_blocks * (bs * (pair_bytes + 4 + 4) + 8)  # int32 position, fp32 bias, int64 owner per block
    slot_map = layer.table.slot.nbytes  # host-side, int32
    state = layer.press_state  # scores of the window's tokens, and the buffered new pairs not scored yet
    press = [state["pending"], *(t for entry in state["unscored"] for t in entry)]
    press_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in press}.values())
    assert press_bytes > 0
    # Kept between steps: np.arange(heads) (host) and a 0-dim -inf (device).
    small = (0 if layer._heads_arange is None else layer._heads_arange.nbytes) + (layer.pool._ninf is not None) * 4
    assert layer.physical_bytes() == pool + slot_map + press_bytes + layer.n_evicted.numel() * 8 + small
    assert layer.physical_bytes() < 0.6 * layer.full_bytes()  # ~70% pruned


def test_freed_slots_are_reused_during_decoding():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    # Every pair leaving the 4-token window is evicted: each decoded token frees exactly one slot per head.
    press = _press(threshold=1.0, scorer=ConstantScorer(0.0))
    kw = _compat.cache_kwarg_name(model)
    with torch.no_grad(), press(model):
        model(random_ids(1, 30), **{kw: cache})
        layer = cache.layers[0]
        pool = (layer.pool.keys.data_ptr(), layer.pool.values.data_ptr(), layer.num_blocks)
        counts, caps = layer.kept_counts(), layer.capacities()
        for step in range(10):
            model(random_ids(1, 1, seed=step), **{kw: cache})
            assert torch.equal(layer.kept_counts(), counts) and torch.equal(layer.capacities(), caps)
    assert (
        layer.pool.keys.data_ptr(),
        layer.pool.values.data_ptr(),
        layer.num_blocks,
    ) == pool  # no reallocation, no copy
    assert counts.tolist() == [[4, 4]] and layer.seen == 40
    assert sorted(layer.stored_pairs(0, 0)[2].tolist()) == [36, 37, 38, 39]


def test_evicted_slots_are_reused_by_the_next_append_without_moving_pairs():
    layer = CompactLayer(block_size=4)
    keys = torch.randn(1, 2, 10, 8)
    layer.update(keys, -keys)  # 3 blocks per head, 10 of 12 slots used
    layer.end_forward()  # the forward ends: the prefill's pairs go into the pool
    slot = int(layer.table.slot[0, 3])
    before = layer.pool.keys.clone()
    layer.evict(3, torch.tensor([[[True], [False]]]))  # on the device; kept_counts() brings the table up to date
    assert layer.kept_counts().tolist() == [[9, 10]] and layer.capacities().tolist() == [[12, 12]]
    assert torch.equal(layer.pool.keys, before)  # nothing moved: the slot is only marked free
    new = torch.randn(1, 2, 1, 8)
    layer.update(new, -new)
    assert int(layer.table.slot[0, 10]) == slot  # head 0's new pair fills the hole
    assert torch.equal(layer.pool.keys.view(-1, 8)[slot], new[0, 0, 0])
    assert layer.kept_counts().tolist() == [[10, 11]] and layer.capacities().tolist() == [[12, 12]]
    assert sorted(layer.stored_pairs(0, 0)[2].tolist()) == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    # A multi-token step uses the holes first, then fresh slots (and blocks).
    layer.evict(5, torch.tensor([[[True], [True]]]))
    layer.sync()  # holes are reused once the table has caught up with the device (at most 16 evictions later)
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    assert layer.kept_counts().tolist() == [[12, 13]] and layer.capacities().tolist() == [[12, 16]]
    assert sorted(layer.stored_pairs(0, 1)[2].tolist()) == [p for p in range(14) if p != 5]


def test_holes_that_pile_up_are_packed_away():
    layer = CompactLayer(block_size=4)
    layer.update(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8))
    layer.end_forward()
    for position in range(5):  # 5 holes in head 0, none refilled: more than a block, so the pool is repacked
        layer.evict(position, torch.tensor([[[True], [False]]]))
    layer.sync()  # the table learns of the device evictions (done by itself every 16 of them)
    assert layer.kept_counts().tolist() == [[35, 40]] and layer.capacities().tolist() == [[36, 40]]
    assert all(not holes for holes in layer.table.holes)
    assert sorted(layer.stored_pairs(0, 0)[2].tolist()) == list(range(5, 40))


def _filled(bsz=2, heads=2, length=10, d=4):
    layer = CompactLayer()
    k = torch.randn(bsz, heads, length, d, generator=torch.Generator().manual_seed(0))
    layer.update(k, -k)
    return layer


def test_evict_crop_and_batch_ops_keep_counts_exact():
    layer, masked = _filled(), MaskedLayer()
    masked.update(torch.zeros(2, 2, 10, 4), torch.zeros(2, 2, 10, 4))
    mask = torch.rand(2, 2, 6, generator=torch.Generator().manual_seed(1)) > 0.5
    for storage in (layer, masked):
        storage.evict(2, mask)
        storage.evict(2, mask)  # evicting twice counts once
        storage.crop(-3)
    assert torch.equal(layer.n_evicted, masked.n_evicted) and torch.equal(layer.kept_counts(), masked.kept_counts())
    assert layer.get_seq_length() == 7
    for i in range(4):
        assert sorted(layer.stored_pairs(i // 2, i % 2)[2].tolist()) == [
            p for p in range(7) if not (2 <= p < 8 and mask.view(4, 6)[i, p - 2])
        ]
    layer.batch_repeat_interleave(2)
    assert layer.kept_counts().shape == (4, 2) and torch.equal(layer.kept_counts()[::2], masked.kept_counts())
    layer.batch_select_indices(torch.tensor([3]))
    assert torch.equal(layer.kept_counts(), masked.kept_counts()[1:])


def test_misuse_is_refused():
    layer = _filled()
    with pytest.raises(ValueError, match="evict covers positions"):
        layer.evict(8, torch.ones(2, 2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        layer.evict(0, torch.ones(1, 2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="fresh cache"):
        layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


def test_sliding_layers_keep_the_masked_storage():
    from kvzap._compat import DynamicLayer, DynamicSlidingWindowLayer

    assert isinstance(compact_layer_like(DynamicLayer()), CompactLayer)
    assert not isinstance(compact_layer_like(DynamicSlidingWindowLayer(sliding_window=8)), CompactLayer)


def test_without_evictions_compact_reads_its_own_storage_after_the_prefill():
    model = tiny_model("llama")
    logits = {}
    for compact in (False, True):
        cache = DynamicCache(config=model.config)
        press = _press(threshold=float("-inf"), storage="compact" if compact else "masked")
        logits[compact] = _steps(model, press, cache, batch=2, n_decode=2)
    layer = cache.layers[0]
    assert isinstance(layer, CompactLayer) and not layer.has_evictions and layer.reads_own_storage
    # The prefill runs transformers' sdpa on the same tensors: identical. Later steps read the blocks
    # (no dense copy of the cache per step): equal to float precision.
    torch.testing.assert_close(logits[True][0], logits[False][0], rtol=0, atol=0)
    for a, b in zip(logits[False][1:], logits[True][1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _check_bookkeeping(layer: CompactLayer, stored: dict[int, dict[int, torch.Tensor]]) -> None:
    """The host-side tables against a plain model of what each head stores (position -> key)."""
    layer.sync()
    bs, d = layer.block_size, layer.pool.keys.shape[-1]
    used = sorted(b for blocks in layer.table.blocks for b in blocks)
    assert used == list(range(layer.table.n_used)) and layer.table.n_used <= layer.num_blocks  # used blocks: a prefix
    live = layer.pool.bias.view(-1) == 0
    assert int(live.sum()) == sum(layer.table.n)
    for i in range(layer._nh):
        own = {b * bs + j for b in layer.table.blocks[i] for j in range(bs)}
        assert bool((layer.pool.owner[layer.table.blocks[i]] == i).all()) if layer.table.blocks[i] else True
        expected = stored[i]
        assert layer.table.n[i] == len(expected) and layer.table.end[i] <= len(layer.table.blocks[i]) * bs
        for hole in layer.table.holes[i]:
            assert hole in own and not bool(live[hole])
        assert sorted(int(p) for p in (layer.table.slot[i] >= 0).nonzero()[0]) == sorted(expected)
        for position, key in expected.items():
            slot = int(layer.table.slot[i, position])
            assert slot in own and bool(live[slot]) and int(layer.pool.positions.view(-1)[slot]) == position
            assert torch.equal(layer.pool.keys.view(-1, d)[slot], key)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(1, 6)),
            st.tuples(st.just("evict"), st.integers(0, 10_000), st.integers(1, 8), st.integers(0, 2**16)),
            st.tuples(st.just("crop"), st.integers(1, 3)),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_block_tables_slot_map_and_holes_stay_consistent(ops):
    layer, bsz, heads, d = CompactLayer(block_size=4), 2, 2, 3
    stored = {i: {} for i in range(bsz * heads)}  # per head: position -> key
    generator = torch.Generator().manual_seed(0)
    for op in [("append", 5), *ops]:
        if op[0] == "append":
            keys = torch.randn(bsz, heads, op[1], d, generator=generator)
            layer.update(keys, -keys)
            for i in range(bsz * heads):
                for j in range(op[1]):
                    stored[i][layer.seen - op[1] + j] = keys.view(bsz * heads, op[1], d)[i, j]
        elif op[0] == "evict":
            start = op[1] % layer.seen
            n = min(op[2], layer.seen - start)
            bits = torch.tensor([(op[3] >> k) & 1 for k in range(bsz * heads * n)], dtype=torch.bool)
            mask = bits.view(bsz, heads, n)
            before = layer.n_evicted.clone()
            layer.evict(start, mask)
            removed = torch.zeros(bsz * heads, dtype=torch.long)
            for i in range(bsz * heads):
                for j in range(n):
                    if mask.view(-1, n)[i, j] and start + j in stored[i]:
                        del stored[i][start + j]
                        removed[i] += 1
            assert torch.equal(layer.n_evicted - before, removed.view(bsz, heads))
        elif layer.seen > op[1]:
            layer.crop(-op[1])  # forget the last op[1] tokens
            for i in stored:
                stored[i] = {p: k for p, k in stored[i].items() if p < layer.seen}
        _check_bookkeeping(layer, stored)
    assert torch.equal(layer.kept_counts().view(-1), torch.tensor([len(stored[i]) for i in range(bsz * heads)]))


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_a_pruned_cache_refuses_use_outside_the_press_and_works_again_inside(storage):
    model = tiny_model("llama")
    kw = _compat.cache_kwarg_name(model)
    cache, press = DynamicCache(config=model.config), _press(storage=storage)
    with torch.no_grad(), press(model):
        model(random_ids(1, 30), **{kw: cache})
    assert press.compression_ratio > 0
    before = [(layer.seen, layer.n_evicted.clone()) for layer in cache.layers]
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"inside `with press\(model\):`, or start a new cache"):
        model(random_ids(1, 1, seed=3), **{kw: cache})
    # Refused before any change: the cache continues inside the press as if nothing had happened.
    assert [(layer.seen, layer.n_evicted.tolist()) for layer in cache.layers] == [
        (seen, n.tolist()) for seen, n in before
    ]
    reference = DynamicCache(config=model.config)
    with torch.no_grad(), _press(storage=storage)(model):
        model(random_ids(1, 30), **{kw: reference})
        expected = model(random_ids(1, 1, seed=3), **{kw: reference}).logits
    with torch.no_grad(), press(model):
        got = model(random_ids(1, 1, seed=3), **{kw: cache}).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_masked_cache_with_nothing_evicted_keeps_working_outside_the_press():
    model = tiny_model("llama")
    kw = _compat.cache_kwarg_name(model)
    cache, press = DynamicCache(config=model.config), _press(threshold=float("-inf"), storage="masked")
    with torch.no_grad(), press(model):
        model(random_ids(1, 30), **{kw: cache})
    with torch.no_grad():
        got = model(random_ids(1, 1, seed=3), **{kw: cache}).logits
        plain = DynamicCache(config=model.config)
        model(random_ids(1, 30), **{kw: plain})
        expected = model(random_ids(1, 1, seed=3), **{kw: plain}).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_no_dense_pairs_outlive_the_forward_and_snapshots_hold_only_their_state(storage):
    model = tiny_model("gemma3_text")  # a sliding and a full-attention layer
    cache = DynamicCache(config=model.config)
    logits = _steps(model, _press(storage=storage), cache, batch=1, prefill=60, n_decode=3)
    assert len(logits) == 5
    for layer in cache.layers:
        assert layer.last_keys is None and layer.last_values is None
        assert getattr(layer, "_dense", None) is None
        # Every attribute is either in the snapshot (shared or copied) or declared transient.
        assert layer.unclassified_fields() == set()
        state = layer.snapshot()
        assert not set(state.fields) & layer._TRANSIENT_FIELDS
        assert set(state.fields) == set(vars(layer)) - layer._TRANSIENT_FIELDS
        assert state.fields["press_state"] is not layer.press_state
    compact = [layer for layer in cache.layers if isinstance(layer, CompactLayer)]
    assert (storage == "compact") == bool(compact)
    for layer in compact:  # the pool is shared with the snapshot, the table copied
        state = layer.snapshot()
        assert state.fields["pool"].keys is layer.pool.keys and state.fields["table"] is not layer.table


def test_a_new_attribute_must_be_declared_before_a_snapshot():
    layer = _filled()
    layer.scratch = torch.zeros(3)
    with pytest.raises(RuntimeError, match="scratch"):
        layer.snapshot()


def _reachable_bytes(root) -> int:
    """Bytes of every tensor storage and numpy array reachable from ``root`` through attributes, dicts, lists and
    tuples, each storage once (asks nothing of kvzap)."""
    import numpy as np

    seen_objects, storages, total, stack = set(), set(), 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in storages:  # (empty storages share addresses)
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, np.ndarray):
            total += obj.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return total


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_memory_reachable_from_the_cache_is_what_kv_bytes_reports(storage):
    from kvzap.cache import kv_bytes

    model = tiny_model("llama", hidden_size=256)  # head_dim 64, as in SmolLM2: bookkeeping per pair to scale
    cache = DynamicCache(config=model.config)
    _steps(model, _press(threshold=0.7, storage=storage), cache, batch=1, prefill=2000, question=20, n_decode=20)
    kept, physical, full = kv_bytes(cache)
    outside = _reachable_bytes(cache)
    assert outside == physical  # the library's accounting misses nothing the cache holds
    if storage == "compact":
        assert kept / full < 0.4 and outside <= kept + 0.05 * full
    else:  # the full cache, its mask and the press state
        assert outside <= full + 0.05 * full


@pytest.mark.parametrize("family", FULL_ATTENTION_FAMILIES)
def test_threshold_minus_inf_what_is_bit_identical_and_what_is_within_1e_6(family):
    """Nothing is evicted at -inf. The compact prefill is transformers' sdpa on the same tensors: bit-identical.
    Later compact steps read the blocks with a split softmax (another order of float sums): measured within 2.4e-7
    of no press on these models (fp32 logits), asserted within 1e-6."""
    model = tiny_model(family)
    kw = _compat.cache_kwarg_name(model)
    plain, cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    reference = []
    with torch.no_grad():
        reference.append(model(random_ids(2, 200, seed=1), **{kw: plain}).logits)
        reference.append(model(random_ids(2, 6, seed=2), **{kw: plain}).logits)
        for _ in range(10):
            reference.append(model(reference[-1][:, -1:].argmax(-1), **{kw: plain}).logits)
    logits = _steps(model, _press(threshold=float("-inf")), cache, batch=2, prefill=200, question=6, n_decode=10)
    assert torch.equal(logits[0], reference[0])
    for step, (a, b) in enumerate(zip(reference[1:], logits[1:], strict=True)):
        assert float((a - b).abs().max()) <= 1e-6, step


class _FailingScorer(ConstantScorer):
    def score(self, module, hidden_states, keys, values, positions):
        raise RuntimeError("scorer failed")


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_a_press_that_fails_mid_forward_leaves_complete_layers_without_dense_pairs(storage):
    model = tiny_model("llama")
    kw = _compat.cache_kwarg_name(model)
    cache = DynamicCache(config=model.config)
    press = _press(scorer=_FailingScorer(0.0), storage=storage)
    with torch.no_grad(), pytest.raises(RuntimeError, match="scorer failed"), press(model):
        model(random_ids(1, 30), **{kw: cache})
    layer = cache.layers[0]  # its forward ran, its press failed
    assert layer.seen == 30 and layer.last_keys is None and getattr(layer, "_dense", None) is None
    assert layer.kept_counts().tolist() == [[30, 30]]  # every pair stored (nothing was evicted)
