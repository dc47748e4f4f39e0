"""Collection and fitting leave sliding-window layers out; the checkpoint maps its modules to model layers."""

from __future__ import annotations

import json

import pytest
import torch

from kvzap import DMSThresholdPress, KVzapScorer
from kvzap.kvzip import kvzip_plus_scores
from kvzap.surrogates import KVzapSurrogate
from tests.conftest import char_tokenizer, random_ids, tiny_model
from tests.train import write_word_corpus
from train.collect import collect, load_collection
from train.fit import fit_and_save

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 2, "Pack my box with five dozen liquor jugs. " * 2]


def prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def test_scoring_a_subset_of_layers_gives_the_same_scores():
    gemma, tokenizer = tiny_model("gemma3_text"), char_tokenizer()
    ids = prompts(tokenizer)[0]
    every = kvzip_plus_scores(gemma, tokenizer, ids, return_hidden_states=True)
    only = kvzip_plus_scores(gemma, tokenizer, ids, return_hidden_states=True, layers=[1])
    assert every.layers == (0, 1) and only.layers == (1,)
    torch.testing.assert_close(only.log_scores, every.log_scores[1:], rtol=0, atol=0)
    torch.testing.assert_close(only.hidden_states, every.hidden_states[1:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        kvzip_plus_scores(gemma, tokenizer, ids, layers=[])


def test_collection_stores_prunable_layers_only(tmp_path):
    gemma, tokenizer = tiny_model("gemma3_text"), char_tokenizer()
    manifest = collect(gemma, tokenizer, prompts(tokenizer), tmp_path / "default", n_tokens=8, shard_size=2)
    assert manifest["layers"] == [1] and manifest["n_layers"] == 2
    X, y, _ = load_collection(tmp_path / "default")
    assert X.shape[1:] == (1, 64) and y.shape[1:] == (1, 2)
    floor = torch.tensor(torch.finfo(torch.float32).tiny).log()  # -87.3: the target of a pair no row sees
    assert bool((y > floor).all())

    everything = collect(
        gemma, tokenizer, prompts(tokenizer), tmp_path / "all", n_tokens=8, shard_size=2, prune_sliding_layers=True
    )
    assert "layers" not in everything  # every layer: the format of collections made before the field existed
    X_all, y_all, _ = load_collection(tmp_path / "all")
    assert X_all.shape[1:] == (2, 64)
    assert bool((y_all[:, 0] <= floor).any())  # the sliding layer's window hides pairs from the repeated copy

    with pytest.raises(ValueError, match="prune_sliding_layers=True"):
        collect(tiny_model("mistral"), tokenizer, prompts(tokenizer), tmp_path / "mistral", n_tokens=8)


def test_fitted_checkpoint_maps_modules_to_model_layers(tmp_path):
    gemma, tokenizer = tiny_model("gemma3_text"), char_tokenizer()
    collect(gemma, tokenizer, prompts(tokenizer), tmp_path / "c", n_tokens=8, shard_size=2)
    fit_and_save(tmp_path / "c", tmp_path / "s", model_types=("linear",))
    config = json.loads((tmp_path / "s" / "linear" / "config.json").read_text())
    assert config["n_modules"] == 2 and config["prunable_layers"] == [1]  # one module per model layer

    surrogate = KVzapSurrogate.from_pretrained(tmp_path / "s" / "linear")
    assert surrogate.prunable_layers == (1,) and surrogate.trained_layers == (1,)
    assert not surrogate.layers[0].weight.any() and surrogate.layers[1].weight.any()  # layer 0 untrained
    with pytest.raises(ValueError, match="layer 0 was not trained"):
        surrogate(torch.zeros(3, 64), 0)

    ids = random_ids(1, 60)
    scorer = KVzapScorer("linear", surrogate)
    press = DMSThresholdPress(scorer, threshold=1e9, sliding_window_size=4)
    with press(gemma):
        gemma(ids, use_cache=True)
    assert press.compression_ratio == pytest.approx((60 - 4) / 60)
    sliding_too = DMSThresholdPress(scorer, threshold=1e9, sliding_window_size=4, prune_sliding_layers=True)
    with pytest.raises(ValueError, match="prune_sliding_layers=True"), sliding_too(gemma):
        gemma(ids, use_cache=True)


def test_checkpoints_without_the_field_load_as_published(tmp_path):
    torch.manual_seed(0)
    published = KVzapSurrogate(64, 1, 2)
    published.save_pretrained(tmp_path / "p")
    assert "prunable_layers" not in json.loads((tmp_path / "p" / "config.json").read_text())
    loaded = KVzapSurrogate.from_pretrained(tmp_path / "p")
    assert loaded.prunable_layers is None and loaded.trained_layers == (0, 1)
    assert loaded.forward_all(torch.zeros(3, 2, 64)).shape == (3, 2, 1)

    config = json.loads((tmp_path / "p" / "config.json").read_text())
    for bad in ([2], [1, 0], "1"):
        (tmp_path / "p" / "config.json").write_text(json.dumps({**config, "prunable_layers": bad}))
        with pytest.raises(ValueError, match="prunable_layers"):
            KVzapSurrogate.from_pretrained(tmp_path / "p")


def test_collect_command_takes_the_option_and_the_press_with_it_agrees(tmp_path, capsys):
    """``python -m train collect`` / ``kvzap train collect`` (same parser) and ``all`` with and without
    ``--prune-sliding-layers``: the surrogates fitted serve a press built with the same option."""

    from train.__main__ import build_parser, main

    for command in ("collect", "all"):
        assert build_parser().parse_args([command, "--prune-sliding-layers"]).prune_sliding_layers
        assert not build_parser().parse_args([command]).prune_sliding_layers

    gemma = tiny_model("gemma3_text")
    gemma.save_pretrained(tmp_path / "gemma")
    char_tokenizer().save_pretrained(tmp_path / "gemma")
    write_word_corpus(tmp_path / "data.jsonl", n_docs=4, n_words=20)
    data = ["--model", str(tmp_path / "gemma"), "--data", str(tmp_path / "data.jsonl"), "--train-per-subset", "2"]
    data += ["--test-per-subset", "0", "--min-tokens", "30", "--max-tokens", "60", "--n-tokens", "8"]
    data += ["--splits", "train"]
    ids = random_ids(1, 60)
    for flags, layers in (([], [1]), (["--prune-sliding-layers"], None)):
        out = tmp_path / ("all" if flags else "default")
        assert main(["--threads", "1", "collect", "--out", str(out / "collect"), *data, *flags]) == 0
        settings = json.loads((out / "collect" / "train" / "settings.json").read_text())
        assert settings.get("layers") == layers  # absent: every layer
        assert main(["fit", "--collection", str(out / "collect"), "--out", str(out / "s"), "--types", "linear"]) == 0
        surrogate = KVzapSurrogate.from_pretrained(out / "s" / "linear")
        scorer = KVzapScorer("linear", surrogate)
        press = DMSThresholdPress(scorer, threshold=1e9, sliding_window_size=4, prune_sliding_layers=bool(flags))
        with press(gemma):
            gemma(ids, use_cache=True)
        assert press.layer_compression_ratios.shape == ((2,) if flags else (1,))
    capsys.readouterr()

    # Resuming a collection with the other option is refused: its targets cover other layers.
    with pytest.raises(ValueError, match="layers"):
        main(["collect", "--out", str(tmp_path / "default" / "collect"), *data, "--prune-sliding-layers"])
    # A model of sliding layers only needs the option, and the error names the flag.
    tiny_model("mistral").save_pretrained(tmp_path / "mistral")
    char_tokenizer().save_pretrained(tmp_path / "mistral")
    data[1] = str(tmp_path / "mistral")
    with pytest.raises(ValueError, match="--prune-sliding-layers"):
        main(["collect", "--out", str(tmp_path / "mistral-collect"), *data])
