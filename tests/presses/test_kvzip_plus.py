"""The KVzip+ oracle scorer: exact scores of the prefill, served to the presses, and the model left as found."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, pipeline

import kvzap  # noqa: F401  (registers the pipeline task)
from kvzap import DMSThresholdPress, KVzipPlusScorer, Scorer, TopKPress
from kvzap._compat import cache_kwarg_name
from kvzap.attention import ATTENTION_NAME
from kvzap.kvzip import build_prefill_repeat_prompt, build_repeat_prompt, kvzip_plus_scores
from tests.conftest import char_tokenizer, random_ids, tiny_model
from tests.presses.test_base import assert_same, model_fingerprint

CONTEXT = "The secret code is 4921. Lorem ipsum dolor sit amet, consectetur adipiscing elit."
QUESTION = "What is the code?"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run faster on one thread than on cores shared with other jobs; restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class RecordingScorer(KVzipPlusScorer):
    """The oracle, keeping what it served per layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served: dict[int, torch.Tensor] = {}

    def score(self, module, hidden_states, keys, values, positions):
        scores = super().score(module, hidden_states, keys, values, positions)
        self.served[module.layer_idx] = scores
        return scores


class FixedScorer(Scorer):
    """Serves precomputed ``(n_layers, B, H, n)`` scores for the prefill (no extra forward)."""

    def __init__(self, scores: torch.Tensor):
        self.scores = scores

    def score(self, module, hidden_states, keys, values, positions):
        return self.scores[module.layer_idx][..., positions]


def prefill_ids(tokenizer, text: str = CONTEXT) -> torch.Tensor:
    """``(1, n)`` ids of a chat-formatted context turn, as the pipeline prefills it."""
    return tokenizer("<|user|>" + text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def direct_scores(model, tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """``(n_layers, B, H, n)`` KVzip+ log scores of each row, computed directly."""
    rows = [kvzip_plus_scores(model, tokenizer, build_prefill_repeat_prompt(tokenizer, row)).log_scores for row in ids]
    return torch.stack(rows, dim=1)


def prefill(model, press, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with press(model):
        model(ids, use_cache=True, **{cache_kwarg_name(model): cache})
    return cache


# --- the repeat prompt of a prefill ------------------------------------------------------------------------------
def test_prefill_repeat_prompt_is_the_training_prompt_of_its_context(tokenizer):
    context = tokenizer(CONTEXT, add_special_tokens=False)["input_ids"]
    ids = prefill_ids(tokenizer)[0]
    rp = build_prefill_repeat_prompt(tokenizer, ids)
    assert rp.prompt == slice(0, len(ids)) and rp.input_ids[: len(ids)].tolist() == ids.tolist()
    # The template prefix is not repeated: the sequence is the training script's repeat prompt of the context.
    assert rp.input_ids.tolist() == build_repeat_prompt(tokenizer, context).input_ids.tolist()
    assert rp.input_ids[rp.repeat].tolist() == context
    # A prefill without the template prefix is repeated whole.
    raw = build_prefill_repeat_prompt(tokenizer, context)
    assert raw.input_ids[raw.prompt].tolist() == context == raw.input_ids[raw.repeat].tolist()
    with pytest.raises(ValueError, match="non-empty"):
        build_prefill_repeat_prompt(tokenizer, [])


# --- the scores ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3_text"])
def test_scores_equal_kvzip_plus_scores(family, tokenizer):
    model = tiny_model(family)
    ids = prefill_ids(tokenizer)  # 84 tokens: crosses the 24-token sliding window of mistral and gemma3
    scorer = RecordingScorer(tokenizer)
    # Scores every layer (sliding ones too: they are scored only on request), evicts nothing.
    press = DMSThresholdPress(scorer, threshold=-1e30, sliding_window_size=4, prune_sliding_layers=True)
    prefill(model, press, ids)
    served = torch.stack([scorer.served[i] for i in sorted(scorer.served)])  # (n_layers, 1, H, n)
    torch.testing.assert_close(served, direct_scores(model, tokenizer, ids), rtol=0, atol=0)
    # On the context tokens they are the training targets of the context (what KVzap surrogates learn).
    context = tokenizer(CONTEXT, add_special_tokens=False)["input_ids"]
    targets = kvzip_plus_scores(model, tokenizer, context).log_scores  # (n_layers, H, len(context))
    torch.testing.assert_close(served[:, 0, :, -len(context) :], targets, rtol=0, atol=0)


def test_batch_rows_are_scored_separately(llama, tokenizer):
    ids = torch.cat([prefill_ids(tokenizer, "abcdefghij" * 3), prefill_ids(tokenizer, "0123456789" * 3)])
    scorer = RecordingScorer(tokenizer)
    prefill(llama, DMSThresholdPress(scorer, threshold=-1e30, sliding_window_size=4), ids)
    served = torch.stack([scorer.served[i] for i in sorted(scorer.served)])  # (n_layers, 2, H, n)
    torch.testing.assert_close(served, direct_scores(llama, tokenizer, ids), rtol=0, atol=0)


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_topk_evicts_exactly_the_lowest_scored_pairs(llama, tokenizer, storage):
    ids = prefill_ids(tokenizer)
    press = TopKPress(KVzipPlusScorer(tokenizer), target_compression=0.5, storage=storage)
    cache = prefill(llama, press, ids)
    expected_scores = direct_scores(llama, tokenizer, ids)
    n = ids.shape[1]
    n_evict = int(n * 0.5)
    for layer_idx, layer in enumerate(cache.layers):
        lowest = expected_scores[layer_idx].topk(n_evict, dim=-1, largest=False).indices  # (1, H, n_evict)
        expected_keep = torch.ones(1, expected_scores.shape[2], n, dtype=torch.bool).scatter_(-1, lowest, False)
        assert torch.equal(layer.keep_mask(), expected_keep)
    assert press.compression_ratio == pytest.approx(n_evict / n)


def test_threshold_evicts_the_pairs_scored_below_it_outside_the_window(llama, tokenizer):
    ids = prefill_ids(tokenizer)
    scores = direct_scores(llama, tokenizer, ids)
    threshold, window = float(scores.median()), 8
    press = DMSThresholdPress(KVzipPlusScorer(tokenizer), threshold=threshold, sliding_window_size=window)
    cache = prefill(llama, press, ids)
    n = ids.shape[1]
    for layer_idx, layer in enumerate(cache.layers):
        evicted = scores[layer_idx] < threshold
        evicted[..., n - window :] = False
        assert torch.equal(layer.keep_mask(), ~evicted)


def test_the_extra_forward_leaves_the_press_in_place(llama, tokenizer):
    """The same evictions from precomputed scores give the same logits afterwards: the oracle's forward did not
    change the attention implementation, the cache or the statistics of the press."""
    ids, question = prefill_ids(tokenizer), random_ids(1, 6, seed=3)
    kw = cache_kwarg_name(llama)
    results = []
    for scorer in (KVzipPlusScorer(tokenizer), FixedScorer(direct_scores(llama, tokenizer, ids))):
        press = TopKPress(scorer, target_compression=0.6)
        cache = DynamicCache(config=llama.config)
        with press(llama):
            llama(ids, use_cache=True, **{kw: cache})
            assert llama.config._attn_implementation == ATTENTION_NAME
            positions = torch.arange(ids.shape[1], ids.shape[1] + 6)[None]
            logits = llama(question, position_ids=positions, use_cache=True, **{kw: cache}).logits
        results.append((logits, press.layer_compression_ratios, press.head_compression_ratios))
    for got, expected in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


# --- the model is left as found --------------------------------------------------------------------------------
def test_model_is_left_exactly_as_found(llama, tokenizer):
    before = model_fingerprint(llama)
    press = TopKPress(KVzipPlusScorer(tokenizer), target_compression=0.5)
    with press(llama):
        llama.generate(prefill_ids(tokenizer), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert llama.config._attn_implementation == ATTENTION_NAME
    assert_same(before, model_fingerprint(llama))
    assert press.scorer._scores is None  # the per-sequence scores are dropped with the press


def test_model_is_restored_when_the_body_or_the_oracle_raises(llama, tokenizer):
    before = model_fingerprint(llama)
    press = TopKPress(KVzipPlusScorer(tokenizer), target_compression=0.5)
    with pytest.raises(KeyError, match="boom"), press(llama):
        llama(prefill_ids(tokenizer))
        raise KeyError("boom")
    assert_same(before, model_fingerprint(llama))
    # The oracle's forward fails (a token id outside the vocabulary) inside the press's hook.
    with pytest.raises(IndexError) as raised, press(llama):
        llama(torch.tensor([[5, 6, 500]]))
    assert any(entry.name == "kvzip_plus_scores" for entry in raised.traceback)
    assert_same(before, model_fingerprint(llama))
    ids = random_ids(1, 20)
    torch.testing.assert_close(llama(ids).logits, tiny_model("llama")(ids).logits)


# --- what the oracle cannot do ---------------------------------------------------------------------------------
def test_refusals(llama, tokenizer):
    scorer = KVzipPlusScorer(tokenizer)
    with pytest.raises(ValueError, match="decoding"):
        DMSThresholdPress(scorer, threshold=-4, decoding=True)
    press = DMSThresholdPress(scorer, threshold=-4, sliding_window_size=4)
    with pytest.raises(ValueError, match="decoding"):
        press.decoding = True
    ids = prefill_ids(tokenizer)
    kw = cache_kwarg_name(llama)
    with press(llama):
        with pytest.raises(ValueError, match="inputs_embeds"):
            llama(inputs_embeds=llama.get_input_embeddings()(ids), use_cache=True, **{kw: DynamicCache()})
        with pytest.raises(ValueError, match="chunked prefill"), press.prefilling():
            llama(ids[:, :10], use_cache=True, **{kw: DynamicCache()})
        # Pairs after the first forward have no KVzip score.
        cache = DynamicCache()
        llama(ids[:, :10], use_cache=True, **{kw: cache})
        with pytest.raises(ValueError, match="first forward"), press.prefilling():
            llama(ids[:, 10:], position_ids=torch.arange(10, ids.shape[1])[None], use_cache=True, **{kw: cache})
    with pytest.raises(TypeError, match="tokenizer"):
        KVzipPlusScorer("gpt2")
    with pytest.raises(ValueError, match="chunk_size"):
        KVzipPlusScorer(tokenizer, chunk_size=0)


def test_tokenizer_is_found_next_to_the_model_or_asked_for(tmp_path, tokenizer):
    model = tiny_model("llama")  # named "tiny-llama": no tokenizer to be found
    before = model_fingerprint(model)
    press = TopKPress(KVzipPlusScorer(), target_compression=0.5)
    with pytest.raises(ValueError, match=r"KVzipPlusScorer\(tokenizer="), press(model):
        pass
    assert_same(before, model_fingerprint(model))
    tokenizer.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    ids = prefill_ids(tokenizer)
    prefill(model, press, ids)
    assert press.compression_ratio == pytest.approx(int(ids.shape[1] * 0.5) / ids.shape[1])


# --- through the pipeline --------------------------------------------------------------------------------------
def test_pipeline_with_questions_after_the_context(llama, tokenizer):
    pipe = pipeline("kv-press-text-generation", model=llama, tokenizer=tokenizer)
    context_ids = pipe.preprocess(CONTEXT, [QUESTION], "", None, False)["context_ids"]
    questions = [QUESTION, "Who?"]
    press = TopKPress(KVzipPlusScorer(tokenizer), target_compression=0.5)
    answers = pipe(CONTEXT, questions=questions, press=press, max_new_tokens=6)["answers"]
    n = context_ids.shape[1]
    assert press.compression_ratio == pytest.approx(int(n * 0.5) / n)  # the context only: questions are kept
    reference = TopKPress(FixedScorer(direct_scores(llama, tokenizer, context_ids)), target_compression=0.5)
    assert answers == pipe(CONTEXT, questions=questions, press=reference, max_new_tokens=6)["answers"]
    with pytest.raises(ValueError, match="chunked prefill"):
        pipe(CONTEXT, question=QUESTION, press=press, prefill_chunk_size=16)
    assert llama.config._attn_implementation == "sdpa"


def test_char_tokenizer_without_chat_template_works(llama):
    tokenizer = char_tokenizer(chat_template=False)
    pipe = pipeline("kv-press-text-generation", model=llama, tokenizer=tokenizer)
    press = TopKPress(KVzipPlusScorer(tokenizer), target_compression=0.25)
    assert isinstance(pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=3)["answer"], str)
    assert press.compression_ratio > 0
