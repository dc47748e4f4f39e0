"""Applying a press: the model is left exactly as found, and bad input fails before anything changes."""

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kvzap import DMSThresholdPress, KVzapScorer, KVzapSurrogate, RandomScorer, TopKPress
from kvzap._compat import cache_kwarg_name
from tests.conftest import random_ids, tiny_model


def model_fingerprint(model):
    """Everything a press could leave behind: attention implementation, hooks, module attributes, weights."""
    modules = dict(model.named_modules())
    return {
        "attn": (model.config._attn_implementation, model.config.to_dict()),
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._forward_hooks_with_kwargs))
            for name, m in modules.items()
        },
        "attrs": {name: sorted(vars(m)) for name, m in modules.items()},
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_same(before, after):
    assert before["attn"] == after["attn"]
    assert before["hooks"] == after["hooks"]
    assert before["attrs"] == after["attrs"]
    assert before["weights"].keys() == after["weights"].keys()
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])


def test_model_is_left_exactly_as_found(family):
    model = tiny_model(family)
    before = model_fingerprint(model)
    press = DMSThresholdPress(RandomScorer(), threshold=0.0, sliding_window_size=4, decoding=True)
    with press(model):
        assert model.config._attn_implementation != "sdpa"
        model.generate(random_ids(1, 30), max_new_tokens=3, do_sample=False)
    assert_same(before, model_fingerprint(model))


def test_model_is_restored_when_the_body_raises(llama):
    before = model_fingerprint(llama)
    press = DMSThresholdPress(RandomScorer(), threshold=0.0, sliding_window_size=4)
    with pytest.raises(KeyError, match="boom"), press(llama):
        llama(random_ids(1, 20))
        raise KeyError("boom")
    assert_same(before, model_fingerprint(llama))
    # and a forward after the press gives the plain model's logits again
    ids = random_ids(1, 20)
    torch.testing.assert_close(llama(ids).logits, tiny_model("llama")(ids).logits)


def test_importing_kvzap_changes_nothing_global():
    code = (
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "before = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))\n"
        "import kvzap\n"
        "after = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))\n"
        "assert before == after, after\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unsupported_model_is_refused_before_any_change():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    before = model_fingerprint(model)
    press = DMSThresholdPress(RandomScorer(), threshold=0.0)
    with pytest.raises(ValueError, match="not supported"), press(model):
        pass
    assert_same(before, model_fingerprint(model))
    with pytest.raises(TypeError, match="PreTrainedModel"), press(object()):
        pass


def test_wrong_surrogate_shape_is_refused_before_any_change(llama):
    before = model_fingerprint(llama)
    press = DMSThresholdPress(KVzapScorer("linear", KVzapSurrogate(32, 2, 2)), threshold=-4)
    with pytest.raises(ValueError, match="hidden"), press(llama):
        pass
    assert_same(before, model_fingerprint(llama))


def test_nested_presses_are_refused_and_the_outer_one_survives(llama):
    outer = DMSThresholdPress(RandomScorer(), threshold=0.0)
    with outer(llama):
        with pytest.raises(RuntimeError, match="nested"), DMSThresholdPress(RandomScorer(), threshold=1.0)(llama):
            pass
        assert llama.config._attn_implementation == "kvzap_sdpa"
    assert llama.config._attn_implementation == "sdpa"


def test_right_padded_batches_are_refused(llama):
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="left-padded"), DMSThresholdPress(RandomScorer(), threshold=0.0)(llama):
        llama(ids, attention_mask=mask)
    with DMSThresholdPress(RandomScorer(), threshold=0.0)(llama):  # an all-ones mask is fine
        llama(ids, attention_mask=torch.ones_like(ids))


def test_cache_prefilled_without_the_press_is_refused(llama):
    cache = DynamicCache(config=llama.config)
    kw = cache_kwarg_name(llama)
    llama(random_ids(1, 10), **{kw: cache})
    with pytest.raises(ValueError, match="without the press"), DMSThresholdPress(RandomScorer(), threshold=0)(llama):
        llama(random_ids(1, 2), **{kw: cache})


def test_lazily_built_cache_works(llama):
    cache = DynamicCache()  # no config: layers are created on first use
    press = DMSThresholdPress(RandomScorer(), threshold=0.0, sliding_window_size=2)
    with press(llama):
        llama(random_ids(1, 12), **{cache_kwarg_name(llama): cache})
    assert len(cache.layers) == 2 and press.compression_ratio > 0


def test_topk_press_evicts_the_requested_share_per_head(llama):
    press = TopKPress(RandomScorer(1), target_compression=0.25)
    cache = DynamicCache(config=llama.config)
    with press(llama):
        llama(random_ids(2, 40), **{cache_kwarg_name(llama): cache})
    for layer in cache.layers:
        assert (layer.n_evicted == 10).all()
    assert press.compression_ratio == pytest.approx(0.25)
    assert press.head_compression_ratios.shape == (2, 2) and press.sample_compression_ratios.shape == (2,)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        TopKPress(RandomScorer(), target_compression=1.0)


class PrefillReadingScorer(RandomScorer):
    """Counts the prefill-input calls and the scoring calls (an oracle's extra forward would run in the former)."""

    reads_prefill_inputs = True

    def setup(self, model):
        super().setup(model)
        self.begins, self.scored = 0, 0

    def begin_prefill(self, model, input_ids, inputs_embeds, chunked):
        self.begins += 1

    def score(self, module, hidden_states, keys, values, positions):
        self.scored += 1
        return super().score(module, hidden_states, keys, values, positions)


@pytest.mark.parametrize("threshold", [float("-inf"), 0.0])
def test_a_threshold_of_minus_inf_needs_no_scores(llama, threshold):
    scorer = PrefillReadingScorer()
    press = DMSThresholdPress(scorer, threshold=threshold, sliding_window_size=2, decoding=True)
    cache = DynamicCache(config=llama.config)
    kw = cache_kwarg_name(llama)
    with press(llama):
        llama(random_ids(1, 12), **{kw: cache})
        llama(random_ids(1, 1, seed=1), **{kw: cache})
    assert press.scores_needed is (threshold != float("-inf"))
    if press.scores_needed:
        assert scorer.begins == 1 and scorer.scored > 0 and press.compression_ratio > 0
    else:  # no score can be below -inf: neither the prefill reader nor the scorer runs, statistics still exist
        assert scorer.begins == 0 and scorer.scored == 0 and press.compression_ratio == 0.0
