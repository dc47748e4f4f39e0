"""The registry of press factories."""

import pytest
from transformers import pipeline

from evaluation.presses import PRESSES, PressFactory, PressNotAvailableError, make_press
from kvzap import (
    DMSThresholdPress,
    FastKVzipScorer,
    KeyNormScorer,
    KVzapScorer,
    KVzipPlusScorer,
    RandomScorer,
    RecencyScorer,
    TopKPress,
)
from tests.conftest import char_tokenizer, tiny_model


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
        "kvzip_plus": "compression_ratio",
        "kvzip_plus_threshold": "threshold",
        "fastkvzip": "threshold",
    }
    assert isinstance(make_press("fastkvzip", -3, surrogate="/gates").scorer, FastKVzipScorer)
    with pytest.raises(ValueError, match="decoding"):  # the oracle scores the context only
        make_press("kvzip_plus_threshold", -4, decoding=True)


def test_declared_but_unavailable_press_is_refused(monkeypatch):
    monkeypatch.setitem(PRESSES, "future", PressFactory("future", "threshold", None, "a press to come"))
    assert not PRESSES["future"].available
    with pytest.raises(PressNotAvailableError, match="not available yet"):
        make_press("future", 0.5)
    with pytest.raises(ValueError, match="Unknown press"):
        make_press("nope")
    with pytest.raises(ValueError, match="threshold"):
        make_press("kvzap_mlp")


@pytest.mark.parametrize(("name", "value"), [("kvzip_plus", 0.5), ("kvzip_plus_threshold", -4.0)])
def test_kvzip_plus_presses_run(tmp_path, name, value):
    """The oracle finds the model's tokenizer by the model's path, as in an evaluation run."""
    press = make_press(name, value, sliding_window_size=8)
    assert isinstance(press.scorer, KVzipPlusScorer)
    if name == "kvzip_plus":
        assert isinstance(press, TopKPress) and press.target_compression == 0.5
    else:
        assert isinstance(press, DMSThresholdPress) and press.threshold == -4.0 and press.sliding_window_size == 8
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe("The secret code is 4921. " * 4, question="What is the code?", press=press, max_new_tokens=3)
    assert isinstance(answer["answer"], str) and 0 < press.compression_ratio < 1
