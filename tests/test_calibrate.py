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
