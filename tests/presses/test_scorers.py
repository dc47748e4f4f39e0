"""Scorers: KVzap weight resolution, placement and scores; baselines."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import kvzap.surrogates.bundled as bundled
from kvzap import DMSPress, KeyNormScorer, KVzapPress, KVzapScorer, KVzapSurrogate, RecencyScorer, TopKPress
from kvzap._compat import cache_kwarg_name
from kvzap.surrogates import SurrogateNotFoundError
from tests.conftest import random_ids


def surrogate(hidden_dim=8, seed=0):
    torch.manual_seed(seed)
    return KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2, hidden_dim=hidden_dim)


class Capture(KVzapScorer):
    def score(self, module, hidden_states, keys, values, positions):
        scores = super().score(module, hidden_states, keys, values, positions)
        self.seen = getattr(self, "seen", {})
        self.seen[module.layer_idx] = scores
        return scores


def test_kvzap_scores_are_the_surrogate_applied_to_normalised_hidden_states(llama):
    sur = surrogate()
    scorer = Capture("mlp", sur)
    ids = random_ids(1, 12)
    with DMSPress(scorer, threshold=-100)(llama):
        llama(ids)
    hidden = llama.model.layers[0].input_layernorm(llama.model.embed_tokens(ids))  # (1, 12, 64)
    expected = sur(hidden, 0).transpose(1, 2)  # (1, H, 12)
    torch.testing.assert_close(scorer.seen[0], expected)


def test_seed_code_form_runs(llama, tmp_path):
    surrogate(hidden_dim=None).save_pretrained(tmp_path / "s")
    press = DMSPress(KVzapPress(model_type="linear", surrogate=str(tmp_path / "s")), threshold=-4)
    press.decoding = False
    with press(llama):
        llama(random_ids(1, 200))
    assert 0 <= press.compression_ratio <= 1
    assert press.scorer.source == str(tmp_path / "s")


def test_bundled_surrogate_is_found_by_model_name(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    surrogate().save_pretrained(tmp_path / "tiny-llama" / "mlp")
    scorer = KVzapScorer("mlp")
    scorer.setup(llama)
    assert scorer.source.startswith("bundled:")


def test_missing_surrogate_offline_says_how_to_fix(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    before = llama.config._attn_implementation
    with pytest.raises(SurrogateNotFoundError, match="kvzap train"), DMSPress(KVzapScorer(), threshold=-4)(llama):
        pass
    assert llama.config._attn_implementation == before


def test_a_bundled_variant_is_picked_by_name(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    surrogate(seed=0).save_pretrained(tmp_path / "tiny-llama" / "mlp")
    surrogate(seed=1).save_pretrained(tmp_path / "tiny-llama" / "mlp-average")
    surrogate(hidden_dim=None).save_pretrained(tmp_path / "tiny-llama" / "linear")
    scores = {}
    for variant in (None, "average"):
        scorer = Capture("mlp", variant=variant)
        with DMSPress(scorer, threshold=-100)(llama):
            llama(random_ids(1, 12))
        folder = "mlp" if variant is None else "mlp-average"
        assert scorer.source == f"bundled:{tmp_path / 'tiny-llama' / folder}"
        scores[variant] = scorer.seen[0]
    assert not torch.equal(scores[None], scores["average"])
    assert repr(Capture("mlp", variant="average")) == "KVzapScorer(model_type='mlp', variant='average')"


def test_bad_variants_are_refused_before_anything_changes(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    surrogate().save_pretrained(tmp_path / "other-model" / "mlp-average")
    surrogate().save_pretrained(tmp_path / "tiny-llama" / "mlp")
    # Refused when built: a name no bundled model has, a variant of the other type, or a variant with weights.
    with pytest.raises(
        ValueError, match=r"variant='avg' is not a bundled KVzap-mlp variant.*'average' \(other-model\)"
    ):
        KVzapScorer("mlp", variant="avg")
    with pytest.raises(ValueError, match="bundled linear variants: none"):
        KVzapScorer("linear", variant="average")
    with pytest.raises(ValueError, match="pass only one of them"):
        KVzapScorer("mlp", surrogate(), variant="average")
    # Bundled for another model only: refused when the press is applied, the model untouched, and never looked up
    # on the Hub (no network call: the Hub would answer something else).
    import kvzap.surrogates.checkpoint as checkpoint

    def no_hub(*args, **kwargs):
        raise AssertionError("looked up on the Hub")

    monkeypatch.setattr(checkpoint, "hf_hub_download", no_hub)
    with pytest.raises(AssertionError, match="looked up on the Hub"):  # the patch is live: no linear is bundled
        KVzapScorer("linear").setup(llama)
    before = (llama.config._attn_implementation, [dict(m._forward_hooks) for m in llama.modules()])
    press = DMSPress(KVzapScorer("mlp", variant="average"), threshold=-4)
    with pytest.raises(SurrogateNotFoundError, match=r"variant 'average'.*bundled for other-model only"), press(llama):
        pass
    assert (llama.config._attn_implementation, [dict(m._forward_hooks) for m in llama.modules()]) == before


def test_weights_are_placed_once(llama, monkeypatch):
    scorer = KVzapScorer("mlp", surrogate())
    press = DMSPress(scorer, threshold=0.0)
    with press(llama):
        llama(random_ids(1, 8))

    def no_move(*args, **kwargs):
        raise AssertionError("surrogate weights moved again")

    monkeypatch.setattr(nn.Module, "to", no_move)
    with press(llama):
        llama(random_ids(1, 8))


def test_bad_scorer_arguments():
    with pytest.raises(ValueError, match="'linear' or 'mlp'"):
        KVzapScorer("transformer")
    with pytest.raises(TypeError, match="surrogate must be"):
        KVzapScorer("mlp", surrogate=3)
    with pytest.raises(ValueError, match="model_type"):
        KVzapScorer("linear", surrogate())


def test_baseline_scorers(llama):
    keys = torch.randn(2, 3, 5, 4)
    assert torch.equal(KeyNormScorer().score(None, None, keys, keys, torch.arange(5)), -keys.norm(dim=-1))
    recency = RecencyScorer().score(None, None, keys, keys, torch.arange(10, 15))
    assert recency.shape == (2, 3, 5) and recency[1, 2].tolist() == [10, 11, 12, 13, 14]
    # Recency with a top-k press keeps exactly the most recent tokens.
    cache = DynamicCache(config=llama.config)
    with TopKPress(RecencyScorer(), target_compression=0.5)(llama):
        llama(random_ids(1, 20), **{cache_kwarg_name(llama): cache})
    assert cache.layers[0].keep_mask()[0, 0].tolist() == [False] * 10 + [True] * 10
