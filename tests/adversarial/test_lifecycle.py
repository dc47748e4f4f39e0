"""Applying presses: exceptions, nesting, two presses, one press on two models, threads, reuse, use after exit."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from transformers import DynamicCache

from kvzap import DMSThresholdPress, KVzapScorer, KVzapSurrogate, RandomScorer
from kvzap._compat import cache_kwarg_name
from tests.adversarial._probe import (
    assert_model_unchanged,
    evicted_sets,
    inf_press,
    model_fingerprint,
    pruning_press,
)
from tests.conftest import random_ids, tiny_model


@pytest.fixture
def model():
    return tiny_model("llama")


def run(model, press, ids, decode_steps=0):
    """Prefill ``ids`` under ``press`` then decode greedily; returns (last logits, cache)."""
    cache = DynamicCache(config=model.config)
    kw = cache_kwarg_name(model)
    with press(model):
        logits = model(ids, **{kw: cache}).logits[:, -1]
        for step in range(decode_steps):
            token = logits.argmax(-1, keepdim=True)
            position = torch.full((ids.shape[0], 1), ids.shape[1] + step)
            logits = model(token, position_ids=position, **{kw: cache}).logits[:, -1]
    return logits, cache


@pytest.mark.parametrize("where", ["prefill", "decoding", "body"])
def test_an_exception_anywhere_leaves_the_model_as_found(model, where):
    before = model_fingerprint(model)

    class Boom(RuntimeError):
        pass

    class FailingScorer(RandomScorer):
        def score(self, module, hidden_states, keys, values, positions):
            if where == "prefill" or (where == "decoding" and hidden_states.shape[1] == 1):
                raise Boom("scorer failed")
            return super().score(module, hidden_states, keys, values, positions)

    press = DMSThresholdPress(FailingScorer(), threshold=0.0, sliding_window_size=0, decoding=True)
    with pytest.raises(Boom):
        run(model, press, random_ids(1, 10), decode_steps=3)
        raise Boom("body failed")
    assert_model_unchanged(before, model)
    # The press and the model still work after the failure, and give the reference result.
    logits, _ = run(model, inf_press(), random_ids(1, 10))
    assert torch.equal(logits, model(random_ids(1, 10)).logits[:, -1])


def test_nesting_the_same_press_or_two_presses_is_refused(model):
    first, second = pruning_press(), inf_press()
    with first(model):
        for press in (first, second):
            before = model_fingerprint(model)
            with pytest.raises(RuntimeError, match="already applied"), press(model):
                pass
            assert_model_unchanged(before, model)
    assert model.config._attn_implementation == "sdpa"


def test_a_press_is_reusable_and_gives_the_same_result_every_time(model):
    press = pruning_press("compact", decoding=True)
    results = [run(model, press, random_ids(1, 30, seed=1), decode_steps=4) for _ in range(3)]
    for logits, cache in results[1:]:
        assert torch.equal(logits, results[0][0])
        for a, b in zip(evicted_sets(cache), evicted_sets(results[0][1]), strict=True):
            assert torch.equal(a, b)


def test_two_presses_on_two_models_at_once_equal_each_alone():
    a, b = tiny_model("llama", seed=0), tiny_model("qwen2", seed=1)
    ids = random_ids(1, 30, seed=2)
    ref_a, _ = run(a, pruning_press("masked"), ids, 3)
    ref_b, _ = run(b, pruning_press("compact"), ids, 3)
    pa, pb = pruning_press("masked"), pruning_press("compact")
    kw = cache_kwarg_name(a)
    ca, cb = DynamicCache(config=a.config), DynamicCache(config=b.config)
    with pa(a), pb(b):
        la, lb = a(ids, **{kw: ca}).logits[:, -1], b(ids, **{kw: cb}).logits[:, -1]
        for step in range(3):
            pos = torch.tensor([[30 + step]])
            la = a(la.argmax(-1, keepdim=True), position_ids=pos, **{kw: ca}).logits[:, -1]
            lb = b(lb.argmax(-1, keepdim=True), position_ids=pos, **{kw: cb}).logits[:, -1]
    assert torch.equal(la, ref_a) and torch.equal(lb, ref_b)


def test_one_press_on_two_models_in_two_threads_equals_each_alone():
    """Issue 12 item 4: the press's per-call state is per thread, so no evictions are lost or mixed."""
    models = [tiny_model("llama", seed=0), tiny_model("llama", seed=1)]
    ids = [random_ids(1, 40, seed=3), random_ids(1, 40, seed=4)]
    press = pruning_press("compact", decoding=True)
    references = [run(m, press, x, decode_steps=6) for m, x in zip(models, ids, strict=True)]
    results, ratios, errors = [None, None], [None, None], []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            barrier.wait()
            for _ in range(4):  # several rounds, so forwards of the two threads interleave
                results[i] = run(models[i], press, ids[i], decode_steps=6)
            ratios[i] = press.compression_ratio  # this thread's own last sequence
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (logits, cache), (ref_logits, ref_cache) in zip(results, references, strict=True):
        assert torch.equal(logits, ref_logits)
        for ours, theirs in zip(evicted_sets(cache), evicted_sets(ref_cache), strict=True):
            assert torch.equal(ours, theirs)
    for (_, cache), ratio in zip(results, ratios, strict=True):
        shares = [float((~layer.keep_mask()).float().mean()) for layer in cache.layers]
        assert ratio == pytest.approx(sum(shares) / len(shares))


def test_statistics_are_per_thread():
    model = tiny_model("llama")
    press = pruning_press()
    run(model, press, random_ids(1, 20))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_error_of(lambda: press.compression_ratio)))
    thread.start()
    thread.join()
    assert isinstance(seen[0], RuntimeError) and "per thread" in str(seen[0])
    assert press.compression_ratio > 0


def _error_of(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - returned to the test
        return error
    return None


def test_one_model_in_two_threads_at_once_is_refused(model):
    """The attention function reads each module's cache through one binding: a second concurrent forward of the
    same model would read the first one's cache. It is refused, and the first forward is unaffected."""
    press = pruning_press("compact")
    entered, release = threading.Event(), threading.Event()

    class SlowScorer(RandomScorer):
        def score(self, module, hidden_states, keys, values, positions):
            if threading.current_thread() is not threading.main_thread():
                entered.set()
                release.wait(10)
            return super().score(module, hidden_states, keys, values, positions)

    press = DMSThresholdPress(SlowScorer(), threshold=0.0, sliding_window_size=2)
    ids = random_ids(1, 12)
    reference = model(ids).logits
    out = {}
    with press(model):
        thread = threading.Thread(target=lambda: out.setdefault("logits", model(ids).logits))
        thread.start()
        entered.wait(10)
        try:
            with pytest.raises(RuntimeError, match="another thread"):
                model(ids)
        finally:
            release.set()
            thread.join()
    assert torch.equal(out["logits"], reference)  # prefill logits are those of the dense forward


def test_one_scorer_cannot_serve_two_models_with_other_weights_at_once(tmp_path):
    """A learned scorer holds the weights of one model (resolved from its name): a second model with another
    name while the first press is applied would swap them under the first one's feet."""
    a, b = tiny_model("llama"), tiny_model("llama")
    b.config._name_or_path = "another-model"
    torch.manual_seed(0)
    KVzapSurrogate(64, 2, 2, hidden_dim=8).save_pretrained(tmp_path)
    pa = DMSThresholdPress(KVzapScorer("mlp", surrogate=tmp_path), threshold=0.0)
    with pa(a):
        before = model_fingerprint(b)
        with pytest.raises(RuntimeError, match="give each model its own scorer"):
            with DMSThresholdPress(pa.scorer, threshold=0.0)(b):
                pass
        assert_model_unchanged(before, b)
    with DMSThresholdPress(pa.scorer, threshold=0.0)(b):  # free again once the first press is removed
        b(random_ids(1, 8))


def test_a_press_can_be_copied_and_pickled():
    press = pruning_press()
    for clone in (copy.deepcopy(press), pickle.loads(pickle.dumps(press))):
        assert clone == press
        _, cache = run(tiny_model("llama"), clone, random_ids(1, 20))
        assert clone.compression_ratio > 0


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_a_pruned_cache_used_after_the_with_block(model, storage):
    """After exit, a pruned cache either keeps giving the logits of the pruned context, or raises a clear error
    (naming the press) on first use."""
    ids = random_ids(1, 30, seed=5)
    kw = cache_kwarg_name(model)
    logits, cache = run(model, pruning_press(storage, decoding=False), ids)
    token = logits.argmax(-1, keepdim=True)
    # The reference: the same step still under the press (pruned context, true position).
    ref_cache = run(model, pruning_press(storage, decoding=False), ids)[1]
    with pruning_press(storage, decoding=False)(model):
        expected = model(token, position_ids=torch.tensor([[30]]), **{kw: ref_cache}).logits
    try:
        after = model(token, position_ids=torch.tensor([[30]]), **{kw: cache}).logits
    except (RuntimeError, ValueError) as error:
        assert "press" in str(error)
    else:
        assert torch.allclose(after, expected, atol=1e-5)


def test_an_oracle_scorer_serves_one_applied_press_at_a_time():
    from kvzap import KVzipPlusScorer, TopKPress
    from tests.conftest import char_tokenizer

    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    scorer = KVzipPlusScorer(char_tokenizer())
    with TopKPress(scorer, target_compression=0.5)(a):
        before = model_fingerprint(b)
        with pytest.raises(RuntimeError, match="its own scorer"), TopKPress(scorer, target_compression=0.5)(b):
            pass
        assert_model_unchanged(before, b)
    with TopKPress(scorer, target_compression=0.5)(b):  # free again once the first press is removed
        b(random_ids(1, 12))
