"""Calibration finds the threshold that reaches a target compression ratio."""

import pytest
import torch

from kvzap import DMSThresholdPress, KVzapScorer, KVzapSurrogate
from kvzap.calibrate import calibrate, collect_scores, compression_curve
from kvzap.prompts import context_ids
from tests.conftest import char_tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs. " * 8]


def scorer():
    torch.manual_seed(0)
    return KVzapScorer("linear", KVzapSurrogate(64, 2, 2))


@pytest.mark.parametrize("target", [0.1, 0.3, 0.6])
def test_calibrated_threshold_reaches_the_target_through_the_press(llama, target):
    tokenizer = char_tokenizer()
    s = scorer()
    scores = collect_scores(llama, tokenizer, s, TEXTS)
    threshold = calibrate(llama, tokenizer, s, TEXTS, target, sliding_window_size=16, scores=scores)
    ratios = []
    for text in TEXTS:
        press = DMSThresholdPress(s, threshold=threshold, sliding_window_size=16)
        with press(llama):
            llama(torch.tensor([context_ids(tokenizer, text)[0]]))  # the context as calibration reads it
        ratios.append(press.compression_ratio)
    assert sum(ratios) / len(ratios) == pytest.approx(target, abs=0.01)
    assert float(compression_curve(scores, [threshold], 16)[0]) == pytest.approx(sum(ratios) / len(ratios))


def test_curve_is_monotone_and_bad_targets_are_refused(llama):
    tokenizer = char_tokenizer()
    scores = collect_scores(llama, tokenizer, scorer(), TEXTS)
    curve = compression_curve(scores, torch.linspace(-3, 3, 25), 16)
    assert (curve[1:] >= curve[:-1]).all() and curve[0] == 0
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        calibrate(llama, tokenizer, scorer(), TEXTS, 1.2, scores=scores)
    with pytest.raises(ValueError, match="non-empty"):
        collect_scores(llama, tokenizer, scorer(), "just one string")


SLIDING_TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Pack my box with five dozen liquor jugs. " * 7,
    "Sphinx of black quartz, judge my vow! " * 8,
]


def run_calibrate_cli(tmp_path, family: str, *flags: str) -> tuple[int, str, str]:
    """``kvzap calibrate`` in process on a saved tiny model of ``family`` and an untrained linear surrogate."""
    from kvzap import KVzapSurrogate
    from kvzap.cli import main
    from tests.conftest import tiny_model

    model_dir, surrogate_dir = tmp_path / family, tmp_path / f"{family}-surrogate"
    if not model_dir.exists():
        tiny_model(family).save_pretrained(model_dir)
        char_tokenizer().save_pretrained(model_dir)
        torch.manual_seed(0)
        KVzapSurrogate(64, 2, 2).save_pretrained(surrogate_dir)
        for i, text in enumerate(SLIDING_TEXTS):
            (tmp_path / f"text{i}.txt").write_text(text)
    texts = [str(tmp_path / f"text{i}.txt") for i in range(len(SLIDING_TEXTS))]
    args = ["calibrate", "--model", str(model_dir), "--model-type", "linear", "--surrogate", str(surrogate_dir)]
    return main([*args, "--window", "4", "--texts", *texts, *flags]), str(model_dir), str(surrogate_dir)


def printed_rows(out: str) -> dict[float, tuple[float, float]]:
    """target -> (threshold, reached) from the table ``kvzap calibrate`` prints."""
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and all(f.lstrip("-").replace(".", "", 1).isdigit() for f in fields):
            rows[float(fields[0])] = (float(fields[1]), float(fields[2]))
    return rows


@pytest.mark.parametrize("prune_sliding", [False, True])
def test_cli_calibrates_the_layers_a_press_with_the_same_option_prunes(tmp_path, capsys, prune_sliding):
    from kvzap.models import load_model

    flags = ["--prune-sliding-layers"] if prune_sliding else []
    status, model_dir, surrogate_dir = run_calibrate_cli(tmp_path, "gemma3_text", "--target", "0.5", *flags)
    out = capsys.readouterr().out
    assert status == 0
    assert ("all 2, sliding-window layer [0] included" in out) == prune_sliding
    assert ("1 of 2, sliding-window layer [0] left alone" in out) != prune_sliding
    threshold, reached = printed_rows(out)[0.5]

    # The same thresholds as the library's calibration with the same option, and a press built with that option
    # evicts what the command printed, on the same texts.
    model, tokenizer = load_model(model_dir)
    s = KVzapScorer("linear", surrogate_dir)
    expected = calibrate(
        model, tokenizer, s, SLIDING_TEXTS, 0.5, sliding_window_size=4, prune_sliding_layers=prune_sliding
    )
    assert threshold == pytest.approx(expected, abs=5e-4)
    ratios = []
    for text in SLIDING_TEXTS:
        press = DMSThresholdPress(s, threshold=expected, sliding_window_size=4, prune_sliding_layers=prune_sliding)
        with press(model):
            model(torch.tensor([context_ids(tokenizer, text)[0]]), use_cache=True)
        assert press.layer_compression_ratios.shape == ((2,) if prune_sliding else (1,))
        ratios.append(press.compression_ratio)
    assert sum(ratios) / len(ratios) == pytest.approx(reached, abs=5e-4)
    assert reached == pytest.approx(0.5, abs=0.03)


def test_cli_prints_what_given_thresholds_evict(tmp_path, capsys):
    # The other direction of the table: each threshold's share, the same figure as the calibration's for the
    # threshold it found (the README's threshold table is printed this way).
    status, _, _ = run_calibrate_cli(tmp_path, "llama", "--target", "0.5")
    threshold, reached = printed_rows(capsys.readouterr().out)[0.5]
    status, _, _ = run_calibrate_cli(
        tmp_path, "llama", "--target", "0.5", "--thresholds", "-100", str(threshold), "100"
    )
    out = capsys.readouterr().out
    assert status == 0
    curve = {}
    for line in out.split("evicted", 1)[1].splitlines():
        fields = line.split()
        if len(fields) == 2:
            curve[float(fields[0])] = float(fields[1])
    assert list(curve) == [-100.0, threshold, 100.0]
    assert curve[-100.0] == 0.0 and curve[threshold] == pytest.approx(reached, abs=1e-3)
    assert 0.9 < curve[100.0] < 1.0  # everything outside the window of 4


def test_cli_needs_the_flag_on_a_model_of_sliding_layers_only(tmp_path, capsys):
    status, _, _ = run_calibrate_cli(tmp_path, "mistral", "--target", "0.02")
    err = capsys.readouterr().err
    assert status == 1 and "Nothing to calibrate" in err and "--prune-sliding-layers" in err
    # With the flag, every layer is calibrated as a press with prune_sliding_layers=True counts it: only the
    # window's 23 stored positions minus the press's 4 can be evicted, of a few hundred seen.
    status, _, _ = run_calibrate_cli(tmp_path, "mistral", "--target", "0.02", "--prune-sliding-layers")
    out = capsys.readouterr().out
    assert status == 0 and "all 2, sliding-window layers [0, 1] included" in out
    assert printed_rows(out)[0.02][1] == pytest.approx(0.02, abs=0.002)
