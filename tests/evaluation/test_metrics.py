"""RULER's string-match metrics on hand-made cases."""

import pytest

from evaluation.metrics import sample_score, string_match_all, string_match_part


def test_string_match_all():
    predictions = ["The numbers are 123 and 456.", "nothing here", "ABC"]
    references = [["123", "456"], ["7"], ["abc", "def"]]
    # (1 + 0 + 0.5) / 3, in percent; matching ignores case.
    assert string_match_all(predictions, references) == pytest.approx(50.0)


def test_string_match_part():
    predictions = ["Paris is the answer", "no", "London or Rome"]
    references = [["paris", "france"], ["yes"], ["Rome", "Milan"]]
    assert string_match_part(predictions, references) == pytest.approx(200 / 3)


def test_empty_and_bad_input():
    assert string_match_all([], []) == 0.0
    with pytest.raises(ValueError, match="predictions"):
        string_match_all(["a"], [])
    with pytest.raises(ValueError, match="non-empty"):
        string_match_part(["a"], [[]])
    with pytest.raises(TypeError):
        string_match_all("abc", [["a"]])


def test_sample_score_uses_the_task_metric():
    assert sample_score("niah_multivalue", "1 and 2", ["1", "2", "3", "4"]) == pytest.approx(50.0)
    assert sample_score("qa", "it is blue", ["blue", "green"]) == 100.0
    with pytest.raises(ValueError, match="Unknown task"):
        sample_score("nope", "", ["a"])
