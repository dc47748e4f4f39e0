"""Arguments of the ``kv-press-text-generation`` pipeline: an answer, or a TypeError/ValueError naming the argument
before the model or the cache changed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, pipeline

import kvzap  # noqa: F401  (registers the task)
from kvzap._compat import cache_kwarg_name
from tests.adversarial._probe import assert_model_unchanged, model_fingerprint, pruning_press, refused
from tests.conftest import char_tokenizer, random_ids, tiny_model

CONTEXT = "The code is 4921. " + "Lorem ipsum dolor sit amet. " * 4

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.text(max_size=3), max_size=2),
    st.lists(st.integers(), min_size=1, max_size=2),
    st.just(object()),
)
ARGUMENTS = [
    "question",
    "questions",
    "answer_prefix",
    "max_new_tokens",
    "max_context_length",
    "enable_thinking",
    "prefill_chunk_size",
    "press",
    "cache",
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def pipe(model):
    return pipeline("kv-press-text-generation", model=model, tokenizer=char_tokenizer())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(ARGUMENTS), value=VALUES)
def test_any_argument_value_answers_or_is_refused_naming_it(pipe, model, name, value):
    kwargs = {"max_new_tokens": 2, "press": pruning_press(), name: value}
    before = model_fingerprint(model)
    try:
        out = pipe(CONTEXT, **kwargs)
    except (TypeError, ValueError) as error:
        assert_model_unchanged(before, model)
        # The message names the argument ("question" errors may name "questions", its alternative).
        assert name in str(error) or (name == "question" and "questions" in str(error))
        return
    answers = out["answers"] if "answers" in out else [out["answer"]]
    assert answers and all(isinstance(a, str) for a in answers)


def test_a_non_empty_cache_is_refused_before_any_change(pipe, model):
    """Issue 12 item 5: the context used to be appended after the old tokens, positions restarting at 0."""
    cache = DynamicCache(config=model.config)
    model(random_ids(1, 5), **{cache_kwarg_name(model): cache})
    with refused(model, ValueError, "cache must be empty", cache=cache):
        pipe(CONTEXT, question="Code?", press=pruning_press(), cache=cache)


def test_an_empty_cache_is_filled_and_gives_the_answer_without_one(pipe, model):
    cache = DynamicCache(config=model.config)
    press = pruning_press(decoding=False)
    with_cache = pipe(CONTEXT, question="Code?", press=press, cache=cache, max_new_tokens=4)["answer"]
    without = pipe(CONTEXT, question="Code?", press=pruning_press(decoding=False), max_new_tokens=4)["answer"]
    assert with_cache == without
    assert cache.layers[0].seen > len(CONTEXT)  # the context and the answer went into the given cache


@pytest.mark.parametrize("context", [123, None, [1], b"bytes"])
def test_the_context_must_be_a_string(pipe, model, context):
    # A list is a batch of contexts: then each of them must be a string.
    with refused(model, TypeError, "context must be a string|contexts must be strings"):
        pipe(context, question="?", press=pruning_press())


def test_a_list_of_contexts_is_a_list_of_answers(pipe):
    # transformers pipelines map a list of inputs to a list of outputs: each equals its own call.
    out = pipe([CONTEXT, CONTEXT[:30]], question="Code?", press=pruning_press(), max_new_tokens=3)
    for context, result in zip([CONTEXT, CONTEXT[:30]], out, strict=True):
        assert result == pipe(context, question="Code?", press=pruning_press(), max_new_tokens=3)


def test_an_empty_context_is_answered(pipe):
    assert isinstance(pipe("", question="Code?", press=pruning_press(), max_new_tokens=2)["answer"], str)


def test_numpy_and_python_numbers_give_the_same_answer(pipe):
    import numpy as np

    a = pipe(CONTEXT, question="?", press=pruning_press(), max_new_tokens=np.int64(3))["answer"]
    b = pipe(CONTEXT, question="?", press=pruning_press(), max_new_tokens=3)["answer"]
    assert a == b
    assert torch.is_grad_enabled()
