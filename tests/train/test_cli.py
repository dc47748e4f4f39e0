"""`python -m train` end to end on a tiny model, in process."""

from __future__ import annotations

import json

import pytest

from kvzap.surrogates import KVzapSurrogate
from tests.train import make_tiny_llama, write_word_corpus
from train.__main__ import build_parser, main


def test_help_lists_subcommands():
    text = build_parser().format_help()
    for command in ("build-corpus", "collect", "fit", "all"):
        assert command in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["collect", "--feature-dtype", "int8"])


def test_prompt_counts_say_they_are_per_subset(capsys):
    args = build_parser().parse_args(["collect", "--train-per-subset", "20", "--test-per-subset", "3"])
    assert (args.train_per_subset, args.test_per_subset) == (20, 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["collect", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Training prompts taken from EACH subset of --data" in help_text and "--n-train" not in help_text
    # The old names still run recorded commands (same meaning), with a warning that says what they count.
    args = build_parser().parse_args(["collect", "--n-train", "20", "--n-test", "3"])
    assert (args.train_per_subset, args.test_per_subset) == (20, 3)
    err = capsys.readouterr().err
    assert "--n-train is deprecated: it counts prompts per subset" in err and "use --train-per-subset 20" in err
    assert "use --test-per-subset 3" in err


def test_all_then_fit_again(tmp_path, tiny_tokenizer, capsys):
    make_tiny_llama().save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    write_word_corpus(tmp_path / "data.jsonl", n_docs=8, n_words=25)
    data = ["--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "data.jsonl"), "--train-per-subset", "2"]
    data += ["--test-per-subset", "1", "--min-tokens", "30", "--max-tokens", "60", "--n-tokens", "12"]
    fit = ["--epochs", "2", "--batch-size", "8", "--hidden-dim", "4"]
    assert main(["--threads", "1", "all", "--out", str(tmp_path / "run"), *data, *fit]) == 0
    out = capsys.readouterr().out
    assert "train: 4 prompts (up to 2 from each of 2 subsets), 48 pairs" in out and "held-out mean R^2" in out
    report = json.loads((tmp_path / "run" / "surrogates" / "r2.json").read_text())
    assert report["n_test_pairs"] == 24 and set(report["surrogates"]) == {"linear", "mlp"}
    assert KVzapSurrogate.from_pretrained(tmp_path / "run" / "surrogates" / "mlp").hidden_dim == 4

    # A second training collection (another seed) is added with --extra-train.
    assert main(["collect", "--out", str(tmp_path / "more"), "--splits", "train", *data]) == 0
    args = ["fit", "--collection", str(tmp_path / "run" / "collect"), "--out", str(tmp_path / "fit2"), *fit]
    assert main([*args, "--types", "linear", "--extra-train", str(tmp_path / "more" / "train")]) == 0
    report = json.loads((tmp_path / "fit2" / "r2.json").read_text())
    assert report["n_train_pairs"] == 96 and list(report["surrogates"]) == ["linear"]

    # One layer at a time (collections larger than memory): the same fit, recorded in the report.
    one = ["fit", "--collection", str(tmp_path / "run" / "collect"), "--out", str(tmp_path / "fit3"), *fit]
    assert main([*one, "--types", "linear", "--layers-at-once", "1"]) == 0
    grouped = json.loads((tmp_path / "fit3" / "r2.json").read_text())
    whole = json.loads((tmp_path / "run" / "surrogates" / "r2.json").read_text())
    assert grouped["layers_at_once"] == 1
    assert grouped["surrogates"]["linear"]["mean_r2"] == pytest.approx(whole["surrogates"]["linear"]["mean_r2"])
    with pytest.raises(SystemExit, match="--layers-at-once must be a positive number of layers, got 0"):
        main([*one, "--layers-at-once", "0"])
    with pytest.raises(SystemExit, match="--layers-at-once applies to one fit; --leave-kinds-out"):
        main([*one, "--layers-at-once", "2", "--leave-kinds-out"])
