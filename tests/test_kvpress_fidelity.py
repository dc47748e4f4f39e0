"""Fidelity against the reference implementation (kvpress 0.5.5 ``DMSPress(KVzapPress)``, transformers 5.2.x).

Run with ``pytest -m kvpress`` in an environment with kvpress installed. kvpress patches every transformers
attention function when imported, so these tests are kept out of the default run and import it lazily.
Set ``KVZAP_REQUIRE_KVPRESS=1`` (CI does) to make a missing kvpress an error instead of a skip.
"""

import os

import pytest
import torch
from transformers import DynamicCache

from kvzap import DMSThresholdPress, KVzapScorer, KVzapSurrogate
from kvzap.pipeline import KVPressTextGenerationPipeline
from tests.conftest import char_tokenizer, random_ids, tiny_model

pytestmark = pytest.mark.kvpress

CONTEXT = "The pass phrase is blue-otter-77. " + "Filler sentence number one, then two, then three. " * 6


def import_kvpress():
    if os.environ.get("KVZAP_REQUIRE_KVPRESS") == "1":
        import kvpress
    else:
        kvpress = pytest.importorskip("kvpress")
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    return kvpress, KVzapConfig, KVzapModel


# kvpress hides evicted pairs with one "fake key" per head that must have a negative dot product with every query
# of a step; for a multi-token question that only exists when head_dim exceeds the number of queries, so the
# pipeline comparison uses heads of dimension 64 (the decoding comparison keeps grouped-query attention).
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256}


def shared_surrogate(input_dim=64, output_dim=2):
    torch.manual_seed(11)
    surrogate = KVzapSurrogate(input_dim=input_dim, output_dim=output_dim, n_modules=2, hidden_dim=8)
    with torch.no_grad():
        for layer in surrogate.layers:
            layer[2].weight.mul_(20)  # spread the scores around 0 so a threshold of 0 evicts about half
    return surrogate


def presses(threshold, window, decoding, input_dim=64, output_dim=2):
    """Our press and kvpress's, with identical surrogate weights (kvpress's Hub download is bypassed)."""
    kvpress, KVzapConfig, KVzapModel = import_kvpress()
    surrogate = shared_surrogate(input_dim, output_dim)
    config = KVzapConfig(input_dim=input_dim, output_dim=output_dim, n_modules=2, hidden_dim=8)
    reference_model = KVzapModel(config)
    reference_model.load_state_dict(surrogate.state_dict())
    scorer = kvpress.KVzapPress(model_type="mlp")
    scorer.kvzap_model = reference_model
    scorer.post_init_from_model = lambda model: None  # weights are set above, never fetched
    theirs = kvpress.DMSPress(scorer, threshold=threshold, sliding_window_size=window, decoding=decoding)
    ours = DMSThresholdPress(
        KVzapScorer("mlp", surrogate), threshold=threshold, sliding_window_size=window, decoding=decoding
    )
    return ours, theirs


def evicted_theirs(model):
    out = []
    for layer in model.model.layers:
        idx = layer.self_attn.masked_key_indices
        out.append(set() if idx is None else set(zip(*(i.tolist() for i in idx), strict=True)))
    return out


def evicted_ours(cache):
    return [set(map(tuple, (~layer.keep_mask()).nonzero().tolist())) for layer in cache.layers]


@pytest.mark.parametrize("window", [0, 4, 16])
@pytest.mark.parametrize("batch", [1, 2])
def test_same_evicted_set_after_prefill_and_decoding(window, batch):
    ours, theirs = presses(threshold=0.0, window=window, decoding=True)
    ids = random_ids(batch, 60, seed=window)
    ref_model, our_model = tiny_model("llama"), tiny_model("llama")
    ref_cache, our_cache = DynamicCache(config=ref_model.config), DynamicCache(config=our_model.config)

    with theirs(ref_model):
        ref_logits = [ref_model(ids[:, :40], past_key_values=ref_cache).logits]
    with ours(our_model):
        our_logits = [our_model(ids[:, :40], past_key_values=our_cache).logits]
    after_prefill = evicted_ours(our_cache)
    assert after_prefill == evicted_theirs(ref_model)
    assert any(after_prefill)
    assert ours.compression_ratio == pytest.approx(theirs.compression_ratio)

    for t in range(40, 60):  # decoding, token by token
        with theirs(ref_model):
            ref_logits.append(ref_model(ids[:, t : t + 1], past_key_values=ref_cache).logits)
        with ours(our_model):
            our_logits.append(our_model(ids[:, t : t + 1], past_key_values=our_cache).logits)
    assert evicted_ours(our_cache) == evicted_theirs(ref_model)
    assert ours.compression_ratio == pytest.approx(theirs.compression_ratio)
    torch.testing.assert_close(torch.cat(our_logits, 1), torch.cat(ref_logits, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("decoding", [False, True])
def test_same_greedy_answers_through_the_pipelines(decoding):
    kvpress, _, _ = import_kvpress()
    from kvpress.pipeline import KVPressTextGenerationPipeline as ReferencePipeline

    tokenizer = char_tokenizer()
    ours, theirs = presses(threshold=0.0, window=8, decoding=decoding, input_dim=128)
    their_pipe = ReferencePipeline(model=tiny_model("llama", **WIDE_HEADS), tokenizer=tokenizer)
    our_pipe = KVPressTextGenerationPipeline(model=tiny_model("llama", **WIDE_HEADS), tokenizer=tokenizer)
    for question in ["What is the pass phrase?", "Repeat the filler."]:
        expected = their_pipe(CONTEXT, question=question, press=theirs, max_new_tokens=16)["answer"]
        answer = our_pipe(CONTEXT, question=question, press=ours, max_new_tokens=16)["answer"]
        assert answer == expected
        assert ours.compression_ratio == pytest.approx(theirs.compression_ratio)
        assert ours.compression_ratio > 0.1
