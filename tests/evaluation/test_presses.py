"""The registry of press factories."""

from pathlib import Path

import pytest
from transformers import DynamicCache, pipeline

from evaluation.presses import (
    PRESSES,
    CacheMethod,
    PressFactory,
    PressNotAvailableError,
    make_press,
)
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
        "static_cache": None,
        "quanto_int4": None,
        "quanto_int2": None,
        "hqq_int4": None,
        "hqq_int2": None,
        "kvzap_mlp_kv8": "threshold",
        "kvzap_mlp_kv4": "threshold",
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


# --- transformers' static and quantized caches, run as the evaluation's "presses" --------------------------------


def test_cache_entries_build_cache_methods():
    from transformers import QuantizedCache, StaticCache

    model = tiny_model("llama")
    static = make_press("static_cache")
    assert static == CacheMethod("static_cache", "static")
    cache = static.new_cache(model, 50)
    assert isinstance(cache, StaticCache) and cache.layers[0].max_cache_len == 50
    for name, backend, nbits in (("quanto_int4", "quanto", 4), ("quanto_int2", "quanto", 2), ("hqq_int2", "hqq", 2)):
        method = make_press(name)
        assert (method.kind, method.backend, method.nbits) == ("quantized", backend, nbits)
        cache = method.new_cache(model, 50)
        assert isinstance(cache, QuantizedCache) and cache.layers[0].nbits == nbits


def test_a_missing_backend_is_refused_with_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    with pytest.raises(PressNotAvailableError, match="pip install hqq"):
        make_press("hqq_int4")
    assert isinstance(make_press("quanto_int4"), CacheMethod)


def test_kvzap_with_quantized_storage_follows_the_press():
    press = make_press("kvzap_mlp_kv8", -4, sliding_window_size=16)
    assert isinstance(press, DMSThresholdPress) and press.kv_bits == 8 and press.threshold == -4.0
    # 4 bits, which presses refuse, stays measurable: the press's storage layers hold 4-bit codes.
    press = make_press("kvzap_mlp_kv4", -4, sliding_window_size=16)
    assert isinstance(press, DMSThresholdPress) and press.kv_bits is None and press.threshold == -4.0
    assert press._storage_layer(DynamicCache(config=tiny_model("llama").config).layers[0]).kv_bits == 4
    assert make_press("kvzap_mlp", -4).kv_bits is None


def test_the_runner_answers_with_each_cache(tmp_path, monkeypatch):
    """A sweep of the caches: each sample gets a fresh cache of its kind (quantized states filled, the static
    cache's room covering the prompt and the answer), nothing is evicted, and the static cache answers as the
    dynamic one does (same arithmetic, preallocated)."""
    from evaluation.runner import load_config, run_evaluation

    made = []
    new_cache = CacheMethod.new_cache

    def recording(self, model, max_len):
        made.append((self.name, new_cache(self, model, max_len)))
        return made[-1][1]

    monkeypatch.setattr(CacheMethod, "new_cache", recording)
    config = load_config(
        output_dir=str(tmp_path),
        presses=["no_press", "static_cache", "quanto_int4", "hqq_int2"],
        tasks=["niah_single"],
        lengths=[300],
        n_samples=2,
        max_new_tokens=4,
        batch_size=2,
    )
    # Head size 64, as on SmolLM2: quanto groups 64 values along the flattened (head, token, channel) axis, which a
    # smaller head size would not always fill (an odd prompt length at head size 16).
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    results = run_evaluation(config, model, char_tokenizer())
    assert [r["press"] for r in results] == ["no_press", "static_cache", "quanto_int4", "hqq_int2"]
    assert [name for name, _ in made] == ["static_cache"] * 2 + ["quanto_int4"] * 2 + ["hqq_int2"] * 2
    for name, cache in made:
        length = cache.get_seq_length()
        assert length > 200  # the prompt went into it, then the question and the answer
        if name == "static_cache":
            assert cache.layers[0].max_cache_len >= length
        else:
            assert all(layer._quantized_keys is not None for layer in cache.layers)
    by_press = {r["press"]: r for r in results}
    for r in results:
        assert r["metrics"]["n_predictions"] == 2
        if r["press"] != "no_press":
            assert r["metrics"]["compression_ratio"] == 0.0

    def predictions(press):
        return (Path(by_press[press]["run_dir"]) / "predictions.csv").read_text()

    assert predictions("static_cache") == predictions("no_press")


def test_a_cache_is_refused_on_a_sampled_dataset(tmp_path):
    from evaluation.runner import load_config, run_evaluation

    config = load_config(output_dir=str(tmp_path), dataset="aime25", presses=["quanto_int4"])
    with pytest.raises(ValueError, match="is a cache, not a press"):
        run_evaluation(config, tiny_model("llama"), char_tokenizer())
    assert not any(tmp_path.iterdir())
