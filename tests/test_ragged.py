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
