"""Left-padded (ragged) batches: each row is pruned exactly as when it runs alone.

A batch of 4 prompts of different lengths, left padded as ``generate`` pads decoder-only models, under a
threshold press with a per-pair scorer (KeyNormScorer: the score of a pair depends on that pair only). For every
family, both storages, prefill-only and ``decoding=True``: each row's logits equal those of the row run alone,
its evicted (layer, head, position within the row) set is the same, its tokens are the same, and so is its
``sample_compression_ratios`` entry. Sampling draws the batch's rows from one random stream, so a row's sampled
tokens cannot be those of a lone run; there the lone row is fed the tokens the batch sampled (teacher forcing)
and its logits and evictions are compared.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvzap import DMSThresholdPress
from kvzap._compat import cache_kwarg_name
from kvzap.presses.baseline_scorers import KeyNormScorer, RandomScorer
from kvzap.presses.topk import TopKPress
from tests.conftest import FAMILIES, random_ids, tiny_model

LENGTHS = (40, 25, 33, 12)  # row 3 is shorter than the window plus a few tokens
NEW_TOKENS = 10
WINDOW = 8
THRESHOLD = -0.7  # about a fifth to four fifths evicted on the tiny models


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def evicted_sets(cache, row: int, pad: int) -> list[torch.Tensor]:
    """Per layer, ``(H, n)`` True where the row's pair is not stored, over the row's own columns (right aligned:
    a sliding-window layer keeps only its last columns)."""
    out = []
    for layer in cache.layers:
        keep = layer.keep_mask()[row]  # (H, stored columns)
        real = keep.shape[-1] - max(0, pad - (layer.seen - keep.shape[-1]))
        out.append(~keep[:, keep.shape[-1] - real :])
    return out


def same_evictions(batch: list[torch.Tensor], alone: list[torch.Tensor]) -> None:
    for layer_idx, (b, a) in enumerate(zip(batch, alone, strict=True)):
        n = min(b.shape[-1], a.shape[-1])
        assert torch.equal(b[:, -n:], a[:, -n:]), f"layer {layer_idx}: evicted sets differ"


def run_forced(model, press, prompt: torch.Tensor, tokens: torch.Tensor):
    """The lone row: prefill ``prompt`` then feed ``tokens`` one at a time; logits of every step, the cache."""
    cache, logits = DynamicCache(config=model.config), []
    with press(model):
        out = model(prompt[None], past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        for tok in tokens[:-1]:
            out = model(tok.view(1, 1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
        ratio = press.sample_compression_ratios[0]
    return torch.stack(logits), cache, ratio


def _cases():
    """Every family x storage x prefill/decoding x greedy/sampling; the default run keeps llama's full matrix and
    every family's greedy decoding (the others are marked slow: the whole matrix takes about two minutes)."""
    for family in sorted(FAMILIES):
        for storage in ("compact", "masked"):
            for decoding in (False, True):
                for sampling in (False, True):
                    fast = family == "llama" or (decoding and not sampling)
                    name = f"{family}-{storage}-{'decoding' if decoding else 'prefill'}-"
                    name += "sampling" if sampling else "greedy"
                    marks = () if fast else (pytest.mark.slow,)
                    yield pytest.param(family, storage, decoding, sampling, id=name, marks=marks)


@pytest.mark.parametrize(("family", "storage", "decoding", "sampling"), list(_cases()))
def test_each_row_of_a_padded_batch_equals_the_row_alone(family, storage, decoding, sampling):
    model = tiny_model(family)
    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    width = ids.shape[1]
    # Sliding-window layers pruned too, so that Mistral's and Gemma 3's sliding cache layers are exercised.
    press = DMSThresholdPress(
        KeyNormScorer(),
        threshold=THRESHOLD,
        sliding_window_size=WINDOW,
        decoding=decoding,
        storage=storage,
        prune_sliding_layers=True,
    )
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
    gen |= dict(pad_token_id=0, do_sample=sampling, top_k=0, temperature=1.0) if sampling else dict(pad_token_id=0)
    torch.manual_seed(0)
    with press(model):
        batch = model.generate(ids, attention_mask=mask, **gen)
        ratios = press.sample_compression_ratios
    batch_logits = torch.stack(batch.logits, dim=1)  # (B, steps, vocab)
    assert float(ratios.min()) > 0.0, "the test needs evictions in every row"
    for i, row in enumerate(rows):
        tokens = batch.sequences[i, width:]
        logits, cache, ratio = run_forced(model, press, row, tokens)
        torch.testing.assert_close(batch_logits[i], logits, atol=1e-5, rtol=0)
        if not sampling:  # greedy: generate on the row alone gives the same tokens
            with press(model):
                alone = model.generate(row[None], **gen)
            assert torch.equal(tokens, alone.sequences[0, len(row) :])
        # generate never feeds its last token: both caches hold the prompt and the tokens before the last.
        same_evictions(evicted_sets(batch.past_key_values, i, width - len(row)), evicted_sets(cache, 0, 0))
        if not decoding:
            assert float(ratios[i]) == pytest.approx(float(ratio), abs=1e-6)


def test_statistics_count_real_tokens_only(llama):
    """compression_ratio is over all real pairs; padding never counts as evicted."""
    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    press = DMSThresholdPress(KeyNormScorer(), threshold=-1e9, sliding_window_size=WINDOW)
    with press(llama):
        llama(ids, attention_mask=mask)
        assert press.compression_ratio == 0.0
        assert torch.equal(press.sample_compression_ratios, torch.zeros(len(rows)))
    press = DMSThresholdPress(KeyNormScorer(), threshold=THRESHOLD, sliding_window_size=WINDOW)
    with press(llama):
        out = llama(ids, attention_mask=mask)
        evicted = sum(int(layer.n_evicted.sum()) for layer in out.past_key_values.layers)
        ratio = press.compression_ratio
    heads = out.past_key_values.layers[0].n_evicted.shape[1]
    pad_pairs = sum(ids.shape[1] - n for n in LENGTHS) * heads * len(out.past_key_values.layers)
    real_pairs = sum(LENGTHS) * heads * len(out.past_key_values.layers)
    assert ratio == pytest.approx((evicted - pad_pairs) / real_pairs, abs=1e-6)


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_padding_is_never_stored(llama, storage):
    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    press = DMSThresholdPress(RandomScorer(), threshold=-1e9, sliding_window_size=WINDOW, storage=storage)
    with press(llama):
        cache = llama(ids, attention_mask=mask).past_key_values
    for layer in cache.layers:
        kept = layer.kept_counts()  # (B, H)
        assert torch.equal(kept, torch.tensor(LENGTHS)[:, None].expand_as(kept))


@pytest.mark.parametrize(
    "press",
    [
        DMSThresholdPress(RandomScorer(), threshold=0.0),
        TopKPress(KeyNormScorer(), target_compression=0.5),
    ],
    ids=["right-padded", "topk"],
)
def test_what_cannot_be_served_is_refused(llama, press):
    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    if isinstance(press, DMSThresholdPress):
        ids, mask = ids.flip(-1), mask.flip(-1)
        match = "left-padded batches only"
    else:
        match = "TopKPress cannot prune a padded batch"
    with pytest.raises(ValueError, match=match), press(llama):
        llama(ids, attention_mask=mask)


# The memory of a ragged batch, by the outside measure (benchmarks/outside.py): 8 prompts of the 1k-4k
# tokens, on a model with SmolLM2's head size. Not scaled down: at a quarter of these lengths the partly filled
# last block of each (row, head) weighs ~0.08 of the full cache, for rows run alone as much as in a batch, and
# the bound would measure block rounding instead of padding. About 20 s and 1.5 GB on a CPU: marked slow.
MEMORY_LENGTHS = (1024, 4096, 1536, 3584, 2048, 3072, 2560, 1280)


@pytest.mark.slow
@torch.no_grad()
def test_a_ragged_batch_holds_its_kept_share_of_its_rows_own_lengths():
    """At most the kept share + 0.05 of the batch's full cache, counted over each row's own length (not padded)."""
    from benchmarks.outside import full_cache_bytes, model_storage_keys, reachable_bytes
    from tests.test_outside_memory import SLACK, THRESHOLD, wide_llama

    model = wide_llama()
    weights = model_storage_keys(model)
    rows = [random_ids(1, n, seed=i, vocab=model.config.vocab_size)[0] for i, n in enumerate(MEMORY_LENGTHS)]
    ids, mask = left_padded(rows)
    press = DMSThresholdPress(RandomScorer(seed=0), threshold=THRESHOLD, decoding=True, storage="compact")
    with press(model):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False, return_dict_in_generate=True)
        kept = 1 - press.compression_ratio
    assert 0.3 < kept < 0.45, kept  # about 2/3 of the pairs leaving the window are evicted
    real_tokens = sum(MEMORY_LENGTHS) + len(rows) * 16  # generate never feeds its last token
    full = full_cache_bytes(model.config, real_tokens)
    held = reachable_bytes(out.past_key_values, weights).total
    assert held <= (kept + SLACK) * full, (held / full, kept)
    # The padded batch would hold (width x rows) columns: the bound above is well below that.
    assert full < 0.7 * full_cache_bytes(model.config, ids.shape[1] * len(rows))


# 4-D masks. transformers builds a 4-D mask (batch, 1, new tokens, cached + new tokens) from the 2-D mask of a
# left-padded batch, and takes one passed directly as it is. The press honours a 4-D mask with exactly that pattern
# (bool, or additive float) like its 2-D mask, and refuses any other pattern before anything changes.
def causal_4d(
    mask_2d: torch.Tensor, new: int, dtype: torch.dtype = torch.bool, unmask_padding: bool = False
) -> torch.Tensor:
    """The causal 4-D mask of the last ``new`` tokens of a left-padded batch whose 2-D mask is ``mask_2d``: the
    query at position p of row b may attend to the keys j with pad_b <= j <= p. A padding query attends to
    nothing, or with ``unmask_padding`` to everything (as legacy sdpa masks did)."""
    total = mask_2d.shape[1]
    pads = (mask_2d == 0).sum(-1)
    keys = torch.arange(total)
    queries = torch.arange(total - new, total)
    allowed = (keys[None, None, :] >= pads[:, None, None]) & (keys[None, None, :] <= queries[None, :, None])
    if unmask_padding:
        allowed |= (queries[None, :] < pads[:, None])[:, :, None]
    if dtype == torch.bool:
        return allowed[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


NON_SLIDING = sorted(f for f in FAMILIES if f not in ("mistral", "gemma3_text"))


def _run_steps(model, press, ids, mask_2d, tokens, four_d: str | None):
    """Prefill ``ids`` then feed ``tokens`` (B, steps) one column at a time, each forward given the 2-D mask so far
    (``four_d`` None) or the equivalent 4-D mask of that kind; last-position logits of every forward, cache,
    sample_compression_ratios."""
    cache = DynamicCache(config=model.config)
    logits = []
    with press(model):
        for step in range(tokens.shape[1] + 1):
            new = ids if step == 0 else tokens[:, step - 1 : step]
            if step > 0:
                mask_2d = torch.cat([mask_2d, torch.ones_like(mask_2d[:, :1])], dim=1)
            if four_d is None:
                mask = mask_2d
            else:
                dtype = torch.float32 if four_d == "additive" else torch.bool
                mask = causal_4d(mask_2d, new.shape[1], dtype, unmask_padding=four_d == "bool-unmasked-padding")
            out = model(new, attention_mask=mask, use_cache=True, **{cache_kwarg_name(model): cache})
            logits.append(out.logits[:, -1])
        ratios = press.sample_compression_ratios
    return torch.stack(logits, dim=1), cache, ratios


@pytest.mark.parametrize("four_d", ["bool", "additive", "bool-unmasked-padding"])
@pytest.mark.parametrize("storage", ["compact", "masked"])
@pytest.mark.parametrize("family", NON_SLIDING)
def test_a_4d_causal_mask_of_a_padded_batch_acts_as_its_2d_mask(family, storage, four_d):
    model = tiny_model(family)
    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    tokens = random_ids(len(rows), 5, seed=9)
    press = DMSThresholdPress(
        KeyNormScorer(), threshold=THRESHOLD, sliding_window_size=WINDOW, decoding=True, storage=storage
    )
    ref_logits, ref_cache, ref_ratios = _run_steps(model, press, ids, mask, tokens, None)
    logits, cache, ratios = _run_steps(model, press, ids, mask, tokens, four_d)
    assert float(ref_ratios.min()) > 0.0, "the test needs evictions in every row"
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ratios, ref_ratios, atol=1e-6, rtol=0)
    for i, row in enumerate(rows):
        pad = ids.shape[1] - len(row)
        same_evictions(evicted_sets(cache, i, pad), evicted_sets(ref_cache, i, pad))


def _custom_4d(kind: str, mask_2d: torch.Tensor) -> torch.Tensor:
    """4-D masks that are not the causal mask of a left-padded batch (or not of this forward's shape)."""
    causal = causal_4d(mask_2d, mask_2d.shape[1])
    n = mask_2d.shape[1]
    if kind == "packed":  # two documents packed in each row: the second may not see the first
        packed = causal.clone()
        packed[:, :, n // 2 :, : n // 2] = False
        return packed
    if kind == "prefix_lm":  # the first tokens see each other both ways
        prefix = causal.clone()
        prefix[:, :, : n // 2, : n // 2] |= causal[:, :, n // 2 : n // 2 + 1, : n // 2].expand(-1, -1, n // 2, -1)
        return prefix
    if kind == "window":  # a sliding window drawn into the mask
        band = torch.ones(n, n, dtype=torch.bool).triu(-4)
        return causal & band
    if kind == "heads":  # one mask per head
        return causal.expand(-1, 2, -1, -1)
    if kind == "wider":  # more keys than the forward has
        return torch.cat([torch.zeros_like(causal[..., :1]), causal], dim=-1)
    if kind == "batch":  # fewer rows than the input
        return causal[:-1]
    if kind == "int":
        return causal.long()
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("packed", ValueError, "not the causal mask of a left-padded batch"),
        ("prefix_lm", ValueError, "not the causal mask of a left-padded batch"),
        ("window", ValueError, "not the causal mask of a left-padded batch"),
        ("heads", ValueError, r"must have shape \(batch, 1, new tokens"),
        ("wider", ValueError, r"must have shape \(batch, 1, new tokens"),
        ("batch", ValueError, r"must have shape \(batch, 1, new tokens"),
        ("int", TypeError, "must be bool"),
    ],
)
def test_other_4d_masks_are_refused_before_any_change(llama, kind, error, match):
    from tests.adversarial._probe import refused

    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    cache = DynamicCache(config=llama.config)
    press = DMSThresholdPress(KeyNormScorer(), threshold=THRESHOLD, sliding_window_size=WINDOW)
    with refused(llama, error, match, cache=cache), press(llama):
        llama(ids, attention_mask=_custom_4d(kind, mask), use_cache=True, **{cache_kwarg_name(llama): cache})


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_4d_mask_is_refused_on_models_with_sliding_window_layers(family):
    from tests.adversarial._probe import refused

    model = tiny_model(family)
    rows = [random_ids(1, n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    cache = DynamicCache(config=model.config)
    press = DMSThresholdPress(KeyNormScorer(), threshold=THRESHOLD, sliding_window_size=WINDOW)
    with refused(model, ValueError, "sliding window", cache=cache), press(model):
        model(ids, attention_mask=causal_4d(mask, ids.shape[1]), use_cache=True, **{cache_kwarg_name(model): cache})
