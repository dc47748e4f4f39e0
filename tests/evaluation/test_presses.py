"""The registry of press factories."""

import pytest

from evaluation.presses import PRESSES, PressNotAvailableError, make_press
from kvzap import DMSThresholdPress, FastKVzipScorer, KeyNormScorer, KVzapScorer, RandomScorer, RecencyScorer, TopKPress


def test_factories_build_the_right_press():
    assert make_press("no_press") is None
    press = make_press("kvzap_mlp", -4, surrogate="/some/dir", sliding_window_size=16)
    assert isinstance(press, DMSThresholdPress) and press.threshold == -4.0 and press.sliding_window_size == 16
    assert isinstance(press.scorer, KVzapScorer) and press.scorer.model_type == "mlp"
    assert press.scorer.surrogate == "/some/dir"
    assert make_press("kvzap_linear", -7).scorer.model_type == "linear"
    for name, scorer in (("random", RandomScorer), ("key_norm", KeyNormScorer), ("recency", RecencyScorer)):
        press = make_press(name, 0.5)
        assert isinstance(press, TopKPress) and isinstance(press.scorer, scorer) and press.target_compression == 0.5


def test_knobs_and_errors():
    assert {n: f.knob for n, f in PRESSES.items() if f.available} == {
        "no_press": None,
        "kvzap_mlp": "threshold",
        "kvzap_linear": "threshold",
        "random": "compression_ratio",
        "key_norm": "compression_ratio",
        "recency": "compression_ratio",
        "fastkvzip": "threshold",
    }
    assert isinstance(make_press("fastkvzip", -3, surrogate="/gates").scorer, FastKVzipScorer)
    for name in ("kvzip_plus",):
        assert not PRESSES[name].available
        with pytest.raises(PressNotAvailableError, match="not available yet"):
            make_press(name, 0.5)
    with pytest.raises(ValueError, match="Unknown press"):
        make_press("nope")
    with pytest.raises(ValueError, match="threshold"):
        make_press("kvzap_mlp")
