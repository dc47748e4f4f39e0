"""Inputs: empty, one token, shorter than the window, batches, padded masks of every shape (left padding and 4-D
causal masks served, right padding and other 4-D patterns refused), embeddings."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvzap._compat import cache_kwarg_name
from tests.adversarial._probe import evicted_sets, inf_press, pruning_press, refused
from tests.conftest import random_ids, tiny_model

STORAGES = ["compact", "masked"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def logits_under(model, press, **inputs):
    cache = DynamicCache(config=model.config)
    with press(model):
        return model(**inputs, **{cache_kwarg_name(model): cache}).logits, cache


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 4, 5])
def test_inputs_up_to_the_window_size_are_never_pruned(model, storage, n_tokens):
    ids = random_ids(1, n_tokens, seed=n_tokens)
    logits, cache = logits_under(model, pruning_press(storage, window=4), input_ids=ids)
    assert torch.equal(logits, model(ids).logits)
    for evicted in evicted_sets(cache):
        assert not evicted[..., max(n_tokens - 4, 0) :].any()  # the window (here: everything up to 4 tokens)


@pytest.mark.parametrize("storage", STORAGES)
def test_a_batch_equals_its_rows_run_alone(model, storage):
    ids = random_ids(3, 24, seed=1)
    batch_logits, batch_cache = logits_under(model, pruning_press(storage), input_ids=ids)
    for row in range(3):
        logits, cache = logits_under(model, pruning_press(storage), input_ids=ids[row : row + 1])
        assert torch.allclose(batch_logits[row], logits[0], atol=1e-5)
        for ours, theirs in zip(evicted_sets(batch_cache), evicted_sets(cache), strict=True):
            assert torch.equal(ours[row], theirs[0])


def test_an_empty_input_is_refused_clearly(model):
    cache = DynamicCache(config=model.config)
    with refused(model, ValueError, "holds no token", cache=cache), inf_press()(model):
        model(random_ids(1, 0), **{cache_kwarg_name(model): cache})


def _masks(batch: int, n: int) -> dict:
    padded = torch.ones(batch, n, dtype=torch.long)
    padded[0, :3] = 0  # left padding of the first row
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None].expand(batch, 1, n, n)
    return {
        "2d_long_padded": padded,
        "2d_bool_padded": padded.bool(),
        "2d_float_padded": padded.float(),
        "2d_right_padded": padded.flip(-1),
        "4d_bool_causal": causal,
        "4d_float_causal": torch.zeros(batch, 1, n, n).masked_fill(~causal, float("-inf")),
        "4d_bool_bidirectional": torch.ones(batch, 1, n, n, dtype=torch.bool),
    }


_REFUSED = ("2d_right_padded", "4d_bool_bidirectional")
_CAUSAL_4D = ("4d_bool_causal", "4d_float_causal")
_LEFT_PADDED = ("2d_long_padded", "2d_bool_padded", "2d_float_padded")


@pytest.mark.parametrize("kind", _REFUSED)
@pytest.mark.parametrize("embeds", [False, True])
def test_right_padded_and_custom_masks_are_refused_before_any_change(model, kind, embeds):
    ids = random_ids(2, 8, seed=2)
    mask = _masks(2, 8)[kind]
    cache = DynamicCache(config=model.config)
    inputs = {"inputs_embeds": model.get_input_embeddings()(ids)} if embeds else {"input_ids": ids}
    match = "left-padded batches only" if kind.startswith("2d") else "not the causal mask of a left-padded batch"
    with refused(model, ValueError, match, cache=cache), pruning_press()(model):
        model(**inputs, attention_mask=mask, **{cache_kwarg_name(model): cache})


@pytest.mark.parametrize("kind", _LEFT_PADDED)
@pytest.mark.parametrize("embeds", [False, True])
@pytest.mark.parametrize("storage", STORAGES)
def test_left_padded_masks_of_every_dtype_give_each_row_alone(model, kind, embeds, storage):
    ids = random_ids(2, 8, seed=2)
    mask = _masks(2, 8)[kind]  # row 0 has 3 padding tokens
    inputs = {"inputs_embeds": model.get_input_embeddings()(ids).detach()} if embeds else {"input_ids": ids}
    batch, _ = logits_under(model, pruning_press(storage), **inputs, attention_mask=mask)
    for row, pad in ((0, 3), (1, 0)):
        alone_inputs = {name: value[row : row + 1, pad:] for name, value in inputs.items()}
        alone, _ = logits_under(model, pruning_press(storage), **alone_inputs)
        torch.testing.assert_close(batch[row, pad:], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [2, 1], ids=["per-row", "broadcast"])
@pytest.mark.parametrize("kind", _CAUSAL_4D)
@pytest.mark.parametrize("storage", STORAGES)
def test_a_4d_causal_mask_gives_the_reference(model, kind, storage, rows):
    ids = random_ids(2, 20, seed=6)
    mask = _masks(2, 20)[kind][:rows]
    reference, ref_cache = logits_under(model, pruning_press(storage), input_ids=ids)
    logits, cache = logits_under(model, pruning_press(storage), input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    for ours, theirs in zip(evicted_sets(cache), evicted_sets(ref_cache), strict=True):
        assert torch.equal(ours, theirs)


def test_generate_with_a_right_padded_batch_is_refused(model):
    ids = random_ids(2, 8, seed=3)
    with refused(model, ValueError, "left-padded batches only"), pruning_press()(model):
        model.generate(ids, attention_mask=_masks(2, 8)["2d_right_padded"], max_new_tokens=2, pad_token_id=0)


@pytest.mark.parametrize("storage", STORAGES)
def test_a_mask_of_ones_and_embeddings_give_the_reference(model, storage):
    ids = random_ids(2, 20, seed=4)
    embeds = model.get_input_embeddings()(ids).detach()
    ones = torch.ones(2, 20, dtype=torch.long)
    reference, ref_cache = logits_under(model, pruning_press(storage), input_ids=ids)
    for inputs in ({"input_ids": ids, "attention_mask": ones}, {"inputs_embeds": embeds}):
        logits, cache = logits_under(model, pruning_press(storage), **inputs)
        assert torch.equal(logits, reference)
        for ours, theirs in zip(evicted_sets(cache), evicted_sets(ref_cache), strict=True):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("storage", STORAGES)
def test_generate_from_embeddings_gives_the_tokens_without_press(model, storage):
    ids = random_ids(1, 12, seed=5)
    embeds = model.get_input_embeddings()(ids).detach()
    reference = model.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with inf_press(storage, decoding=True)(model):
        out = model.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference)
