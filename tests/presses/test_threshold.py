"""DMSThresholdPress: the eviction rule against a naive reference, logits, ratios and bad input."""

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvzap import DMSPress, DMSThresholdPress, RandomScorer, Scorer
from kvzap._compat import cache_kwarg_name
from kvzap.presses.baseline_scorers import ConstantScorer, KeyNormScorer
from kvzap.presses.threshold import SINK_SIZE
from tests.conftest import FAMILIES, random_ids, tiny_model


class RecordingScorer(RandomScorer):
    """Random scores, remembered per layer with the absolute positions they were given for."""

    def setup(self, model):
        super().setup(model)
        self.history = {}

    def score(self, module, hidden_states, keys, values, positions):
        scores = super().score(module, hidden_states, keys, values, positions)
        self.history.setdefault(module.layer_idx, []).append((positions.tolist(), scores))
        return scores


class PrefillOnlyScorer(RandomScorer):
    supports_decoding = False


def naive_dms(history, n_total, n_prefill, window, threshold, decoding, shape, last_step=1):
    """The DMS rule written out token by token: evicted iff scored, outside the final window, below tau.

    A decoding step of several tokens may still be cropped (speculative decoding rejects its drafts): its tokens
    after the first do not push older tokens out of the window until the next forward (``last_step``: the size
    of the last decoding step).
    """
    bsz, heads = shape
    evicted = torch.zeros(bsz, heads, n_total, dtype=torch.bool)
    # the window is counted over the tokens committed by the last forward that applied the rule
    horizon = n_total - (last_step - 1) if decoding else n_prefill
    for positions, scores in history:
        for j, p in enumerate(positions):
            if p >= horizon - window:
                continue
            for b in range(bsz):
                for h in range(heads):
                    if scores[b, h, j] < threshold:
                        evicted[b, h, p] = True
    return evicted


def run(model, press, ids, chunks):
    cache = DynamicCache(config=model.config)
    kw = cache_kwarg_name(model)
    logits = []
    with press(model):
        start = 0
        for size in chunks:
            logits.append(model(ids[:, start : start + size], **{kw: cache}).logits)
            start += size
    return cache, torch.cat(logits, dim=1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    window=st.integers(0, 12),
    n_prefill=st.integers(1, 30),
    steps=st.lists(st.integers(1, 4), max_size=5),
    threshold=st.floats(-1.5, 1.5),
    decoding=st.booleans(),
    storage=st.sampled_from(["compact", "masked"]),
)
def test_evicted_set_matches_naive_rule(llama, seed, window, n_prefill, steps, threshold, decoding, storage):
    scorer = RecordingScorer(seed)
    press = DMSThresholdPress(
        scorer, threshold=threshold, sliding_window_size=window, decoding=decoding, storage=storage
    )
    chunks = [n_prefill, *steps]
    ids = random_ids(2, sum(chunks), seed=seed)
    cache, _ = run(llama, press, ids, chunks)
    n_total = sum(chunks)
    last_step = steps[-1] if steps else 1
    for layer_idx, layer in enumerate(cache.layers):
        expected = naive_dms(
            scorer.history[layer_idx], n_total, n_prefill, window, threshold, decoding, (2, 2), last_step
        )
        assert torch.equal(~layer.keep_mask(), expected)
        assert layer.keep_mask()[..., max(n_total - window, 0) :].all()  # the window is never evicted
        assert torch.equal(layer.n_evicted, expected.sum(-1))
    shares = [float((~layer.keep_mask()).float().mean()) for layer in cache.layers]
    if decoding or not steps:
        assert press.compression_ratio == pytest.approx(sum(shares) / len(shares))


@pytest.mark.parametrize("storage", ["compact", "masked"])
@pytest.mark.parametrize("decoding", [False, True])
def test_threshold_minus_inf_gives_identical_logits(family, decoding, storage):
    model = tiny_model(family)
    ids = random_ids(2, 40)
    chunks = [30, 4, 1, 1, 1, 1, 1, 1]  # prefill, a question, then token by token (crosses sliding windows)
    cache = DynamicCache(config=model.config)
    kw = cache_kwarg_name(model)
    reference, start = [], 0
    for size in chunks:
        reference.append(model(ids[:, start : start + size], **{kw: cache}).logits)
        start += size
    scorer = RecordingScorer(0)
    press = DMSThresholdPress(
        scorer,
        threshold=-math.inf,
        sliding_window_size=4,
        decoding=decoding,
        storage=storage,
        prune_sliding_layers=True,  # the sliding layers (Mistral, Gemma3) go through kvzap's storage too
    )
    _, logits = run(model, press, ids, chunks)
    assert scorer.history == {}  # no score can be below -inf: nothing is scored
    if storage == "masked":  # transformers' own sdpa on the same tensors, bit for bit
        assert torch.equal(logits, torch.cat(reference, dim=1))
    else:  # after the prefill, compact layers attend per KV head over their own buffers: float precision
        assert torch.equal(logits[:, :30], reference[0])
        torch.testing.assert_close(logits, torch.cat(reference, dim=1), rtol=1e-5, atol=1e-5)
    assert press.compression_ratio == 0.0


class SharedHeadsScorer(Scorer):
    """The same random score for every head, so evictions can be reproduced by slicing a plain cache."""

    def __init__(self, seed=0):
        self.generator = torch.Generator().manual_seed(seed)

    def score(self, module, hidden_states, keys, values, positions):
        bsz, heads, q_len, _ = keys.shape
        return torch.randn(bsz, 1, q_len, generator=self.generator).expand(bsz, heads, q_len)


@pytest.mark.parametrize("storage", ["compact", "masked"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3"])
def test_eviction_equals_physically_deleting_pairs(name, storage):
    model = tiny_model(name)
    ids = random_ids(1, 36, seed=1)
    kw = cache_kwarg_name(model)
    press = DMSThresholdPress(SharedHeadsScorer(3), threshold=0.0, sliding_window_size=6, storage=storage)
    cache = DynamicCache(config=model.config)
    with press(model):
        model(ids[:, :30], **{kw: cache})
        keep = [layer.keep_mask()[0, 0].clone() for layer in cache.layers]
        assert not keep[0].all()
        masked = [model(ids[:, 30:33], **{kw: cache}).logits]
        masked += [model(ids[:, t : t + 1], **{kw: cache}).logits for t in range(33, 36)]

    # Reference: a plain cache from which the evicted pairs are removed, with true positions passed explicitly.
    plain = DynamicCache(config=model.config)
    model(ids[:, :30], **{kw: plain})
    for layer, k in zip(plain.layers, keep, strict=True):
        layer.keys, layer.values = layer.keys[:, :, k], layer.values[:, :, k]
    pos = torch.arange(30, 33)[None]
    reference = [model(ids[:, 30:33], position_ids=pos, **{kw: plain}).logits]
    reference += [
        model(ids[:, t : t + 1], position_ids=torch.tensor([[t]]), **{kw: plain}).logits for t in range(33, 36)
    ]
    torch.testing.assert_close(torch.cat(masked, 1), torch.cat(reference, 1), atol=1e-5, rtol=1e-5)


def test_seed_names_are_the_same_classes():
    from kvzap import KVzapPress, KVzapScorer

    assert DMSPress is DMSThresholdPress and KVzapPress is KVzapScorer


def test_press_is_reusable_across_sequences(llama):
    press = DMSThresholdPress(RandomScorer(5), threshold=0.0, sliding_window_size=4, decoding=True)
    ids = random_ids(1, 20)
    first, logits_a = run(llama, press, ids, [12, 1, 1])
    ratio_a = press.compression_ratio
    second, logits_b = run(llama, press, ids, [12, 1, 1])
    assert torch.equal(logits_a, logits_b) and press.compression_ratio == ratio_a
    assert all(torch.equal(a.keep_mask(), b.keep_mask()) for a, b in zip(first.layers, second.layers, strict=True))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({}, ValueError, "threshold is required"),
        ({"threshold": float("nan")}, ValueError, "NaN"),
        ({"threshold": "high"}, TypeError, "number"),
        ({"threshold": True}, TypeError, "number"),
        ({"threshold": -4, "sliding_window_size": -1}, ValueError, ">= 0"),
        ({"threshold": -4, "sliding_window_size": 2.5}, TypeError, "int"),
    ],
)
def test_bad_parameters_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        DMSThresholdPress(RandomScorer(), **kwargs)


def test_scorer_must_be_a_scorer():
    with pytest.raises(TypeError, match="Scorer"):
        DMSThresholdPress(lambda *a: None, threshold=-4)


def test_decoding_needs_a_scorer_that_can_decode():
    with pytest.raises(ValueError, match="cannot prune during decoding"):
        DMSThresholdPress(PrefillOnlyScorer(), threshold=0, decoding=True)
    press = DMSThresholdPress(PrefillOnlyScorer(), threshold=0)
    with pytest.raises(ValueError, match="cannot prune during decoding"):
        press.decoding = True
    assert press.decoding is False


def test_compression_ratio_before_any_forward_is_a_clear_error():
    press = DMSThresholdPress(RandomScorer(), threshold=0)
    with pytest.raises(RuntimeError, match="run a forward pass"):
        _ = press.compression_ratio
    with pytest.raises(AttributeError):
        press.compression_ratio = 0.5


def test_all_families_are_covered():
    assert set(FAMILIES) == {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text"}


@pytest.mark.parametrize("window", [0, 3, 8])
def test_chunked_prefill_prunes_each_chunk_like_a_continuing_sequence(llama, window):
    ids = random_ids(2, 31, seed=window)
    # The last token makes the decoding-time reference take the decisions its last 10-token step deferred.
    chunks = [10, 10, 10, 1]
    # decoding=False; no sinks, which the decoding-time reference (a prefill in one forward) does not keep either.
    chunked = DMSThresholdPress(RandomScorer(4), threshold=0.0, sliding_window_size=window, sink_size=0)
    cache = DynamicCache(config=llama.config)
    kw = cache_kwarg_name(llama)
    with chunked(llama), chunked.prefilling():
        start = 0
        for size in chunks:
            llama(ids[:, start : start + size], **{kw: cache})
            start += size
    # The same token stream with decoding-time pruning gives the same evictions.
    reference, _ = run(
        llama, DMSThresholdPress(RandomScorer(4), threshold=0.0, sliding_window_size=window, decoding=True), ids, chunks
    )
    for ours, theirs in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(ours.keep_mask()[..., :30], theirs.keep_mask()[..., :30])
    assert chunked.compression_ratio > 0


def _prefill(model, press, ids, chunks, mask=None):
    """Prefill ``ids`` in forwards of ``chunks`` tokens (inside ``press.prefilling()`` when several); the cache."""
    cache = DynamicCache(config=model.config)
    kw = cache_kwarg_name(model)
    mask = torch.ones_like(ids) if mask is None else mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with press(model), press.prefilling() if len(chunks) > 1 else contextlib.nullcontext():
        start = 0
        for size in chunks:
            end = start + size
            model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end], **{kw: cache})
            start = end
    return cache


@pytest.mark.parametrize(
    ("sink_size", "chunked", "kept"),
    [(None, True, SINK_SIZE), (None, False, 0), (0, True, 0), (2, False, 2), (6, True, 6)],
)
def test_the_first_tokens_are_kept_as_sinks_in_a_chunked_prefill_or_when_asked(llama, sink_size, chunked, kept):
    # Every score is below the threshold: all but the window and the sinks goes.
    press = DMSThresholdPress(ConstantScorer(-1.0), threshold=0.0, sliding_window_size=4, sink_size=sink_size)
    ids = random_ids(2, 24, seed=3)
    cache = _prefill(llama, press, ids, [8, 8, 8] if chunked else [24])
    for layer in cache.layers:
        expected = torch.zeros(2, layer.keep_mask().shape[1], 24, dtype=torch.bool)
        expected[..., :kept] = True
        expected[..., -4:] = True
        assert torch.equal(layer.keep_mask(), expected)
    assert press.effective_sink_size == (sink_size if sink_size is not None else 0)  # outside the prefill


def test_the_sinks_of_a_padded_row_are_its_first_real_tokens(llama):
    press = DMSThresholdPress(ConstantScorer(-1.0), threshold=0.0, sliding_window_size=4)
    ids = random_ids(2, 24, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1: five padding columns on the left
    cache = _prefill(llama, press, ids, [12, 6, 6], mask)
    for layer in cache.layers:
        keep = layer.keep_mask()
        assert keep[0, :, :SINK_SIZE].all() and not keep[0, :, SINK_SIZE:-4].any()
        assert not keep[1, :, :5].any() and keep[1, :, 5 : 5 + SINK_SIZE].all()
        assert not keep[1, :, 5 + SINK_SIZE : -4].any() and keep[:, :, -4:].all()


@pytest.mark.parametrize("bad", [-1, 1.5, "4", float("nan")])
def test_a_bad_sink_size_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match="sink_size"):
        DMSThresholdPress(ConstantScorer(), threshold=0.0, sink_size=bad)
    press = DMSThresholdPress(ConstantScorer(), threshold=0.0)
    with pytest.raises((TypeError, ValueError), match="sink_size"):
        press.sink_size = bad
    assert press.sink_size is None


class CountingKeyNormScorer(KeyNormScorer):
    """A per-pair function of the key (so batching its calls changes no score), counting calls per layer."""

    def setup(self, model):
        self.calls, self.positions = {}, {}

    def score(self, module, hidden_states, keys, values, positions):
        self.calls[module.layer_idx] = self.calls.get(module.layer_idx, 0) + 1
        self.positions.setdefault(module.layer_idx, []).extend(positions.tolist())
        return super().score(module, hidden_states, keys, values, positions)


@pytest.mark.parametrize("window", [0, 3, 20])
def test_decoded_tokens_are_scored_in_batches_with_the_same_decisions(llama, window, monkeypatch):
    chunks = [12, 3] + [1] * 40  # prefill, a question, 40 decoded tokens
    ids = random_ids(2, sum(chunks), seed=window)
    runs = {}
    for batch in (1, 16):
        monkeypatch.setattr("kvzap.presses.threshold._DECODE_SCORE_BATCH", batch)
        scorer = CountingKeyNormScorer()
        press = DMSThresholdPress(scorer, threshold=-0.62, sliding_window_size=window, decoding=True)
        cache, logits = run(llama, press, ids, chunks)
        runs[batch] = (cache, logits, scorer)
    (one_cache, one_logits, one), (many_cache, many_logits, many) = runs[1], runs[16]
    for a, b in zip(one_cache.layers, many_cache.layers, strict=True):
        assert torch.equal(a.keep_mask(), b.keep_mask()) and torch.equal(a.n_evicted, b.n_evicted)
    assert 0 < float((~many_cache.layers[0].keep_mask()).float().mean()) < 1
    torch.testing.assert_close(many_logits, one_logits, rtol=0, atol=0)
    assert one.calls[0] == len(chunks)
    # Each position is scored once, in order; the tokens not scored yet are all inside the window.
    for positions in many.positions.values():
        assert positions == list(range(len(positions)))
        assert sum(chunks) - len(positions) <= max(window, 0)
    if window == 0:
        assert many.calls[0] == len(chunks)  # every token leaves the window at once: scored at once
    else:
        assert many.calls[0] < len(chunks) // 2
