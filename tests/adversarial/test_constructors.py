"""Constructor arguments of every press and scorer: accepted values work, anything else is a TypeError or a
ValueError naming the argument (never another exception, never a silently wrong object)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzap import (
    DMSThresholdPress,
    FastKVzipScorer,
    KeyNormScorer,
    KVzapScorer,
    KVzipPlusScorer,
    RandomScorer,
    TopKPress,
)

ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.builds(np.float32, st.floats(width=32)),
    st.builds(np.int64, st.integers(-(2**40), 2**40)),
    st.builds(np.bool_, st.booleans()),
    st.just(object()),
)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@settings(max_examples=150, deadline=None)
@given(threshold=ANYTHING)
def test_threshold(threshold):
    try:
        press = DMSThresholdPress(KeyNormScorer(), threshold=threshold)
    except (TypeError, ValueError) as error:
        assert "threshold" in str(error)
        assert not (_is_real(threshold) and not math.isnan(float(threshold)))
        return
    assert _is_real(threshold) and not math.isnan(float(threshold))
    assert press.threshold == threshold


@settings(max_examples=150, deadline=None)
@given(window=ANYTHING)
def test_sliding_window_size(window):
    try:
        press = DMSThresholdPress(KeyNormScorer(), threshold=0.0, sliding_window_size=window)
    except (TypeError, ValueError) as error:
        assert "sliding_window_size" in str(error)
        assert not (_is_int(window) and window >= 0)
        return
    assert _is_int(window) and window >= 0 and press.sliding_window_size == window


@settings(max_examples=100, deadline=None)
@given(decoding=ANYTHING)
def test_decoding(decoding):
    try:
        press = DMSThresholdPress(KeyNormScorer(), threshold=0.0, decoding=decoding)
    except (TypeError, ValueError) as error:
        assert "decoding" in str(error)
        assert not isinstance(decoding, (bool, np.bool_))
        return
    assert isinstance(decoding, (bool, np.bool_)) and press.prunes_during_decoding == bool(decoding)


@settings(max_examples=100, deadline=None)
@given(storage=st.one_of(ANYTHING, st.sampled_from(["compact", "masked", "Compact", " masked", "dense"])))
def test_storage(storage):
    try:
        press = DMSThresholdPress(KeyNormScorer(), threshold=0.0, storage=storage)
    except (TypeError, ValueError) as error:
        assert "storage" in str(error)
        return
    assert press.storage in ("compact", "masked")


@settings(max_examples=150, deadline=None)
@given(ratio=ANYTHING)
def test_target_compression(ratio):
    try:
        press = TopKPress(KeyNormScorer(), target_compression=ratio)
    except (TypeError, ValueError) as error:
        assert "target_compression" in str(error)
        assert not (_is_real(ratio) and 0 <= float(ratio) < 1)
        return
    assert _is_real(ratio) and 0 <= float(ratio) < 1
    assert type(press.target_compression) in (int, float)  # numpy scalars are normalised


@settings(max_examples=60, deadline=None)
@given(scorer=ANYTHING)
def test_scorer_must_be_a_scorer(scorer):
    for make in (lambda: DMSThresholdPress(scorer, threshold=0.0), lambda: TopKPress(scorer, target_compression=0.5)):
        with pytest.raises(TypeError, match="scorer"):
            make()


def test_decoding_set_after_construction_is_checked_too():
    press = DMSThresholdPress(KeyNormScorer(), threshold=0.0)
    with pytest.raises(TypeError, match="decoding"):
        press.decoding = "yes"
    with pytest.raises(ValueError, match="threshold"):
        press.threshold = float("nan")  # refused at once: inside `with press(model):` nothing validates again
    assert press.threshold == 0.0


@settings(max_examples=100, deadline=None)
@given(model_type=ANYTHING, surrogate=st.one_of(ANYTHING, st.just("some/dir")))
def test_kvzap_scorer(model_type, surrogate):
    try:
        scorer = KVzapScorer(model_type=model_type, surrogate=surrogate)
    except (TypeError, ValueError) as error:
        assert "model_type" in str(error) or "surrogate" in str(error)
        return
    assert scorer.model_type in ("linear", "mlp")
    assert surrogate is None or isinstance(surrogate, str)


@settings(max_examples=60, deadline=None)
@given(surrogate=ANYTHING)
def test_fastkvzip_scorer(surrogate):
    try:
        FastKVzipScorer(surrogate=surrogate)
    except (TypeError, ValueError) as error:
        assert "surrogate" in str(error)
        return
    assert surrogate is None or isinstance(surrogate, str)


@settings(max_examples=100, deadline=None)
@given(seed=ANYTHING)
def test_random_scorer_seed(seed):
    try:
        scorer = RandomScorer(seed)
    except (TypeError, ValueError) as error:
        assert "seed" in str(error)
        assert not (_is_int(seed) and 0 <= seed < 2**63)
        return
    assert _is_int(seed) and type(scorer.seed) is int


@settings(max_examples=60, deadline=None)
@given(chunk_size=ANYTHING, tokenizer=st.one_of(st.none(), st.just(object()), st.text(max_size=4)))
def test_kvzip_plus_scorer(chunk_size, tokenizer):
    try:
        KVzipPlusScorer(tokenizer, chunk_size=chunk_size)
    except (TypeError, ValueError) as error:
        assert "chunk_size" in str(error) or "tokenizer" in str(error)
        return
    assert _is_int(chunk_size) and chunk_size > 0
