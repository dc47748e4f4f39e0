"""``python -m evaluation errors``: the outcome of every asked needle number of a run."""

import json

import pytest

from evaluation import ruler
from evaluation.cli import main as evaluation_main
from evaluation.errors import classify_answer, format_errors, needle_errors
from evaluation.runner import PARTIAL, _write_predictions
from tests.conftest import char_tokenizer

LENGTH = 1200  # characters = tokens with the char tokenizer
SEED = 3


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _garble(number: str, needles: list[str]) -> str:
    """``number`` with its last digit changed, never another needle's number."""
    for digit in "0123456789":
        garbled = number[:-1] + digit
        if garbled != number and garbled not in needles:
            return garbled
    raise AssertionError("unreachable")


def _write_run(path, rows, *, seed=SEED, dataset="ruler_offline", finished=True):
    path.mkdir(parents=True)
    config = {
        "model": "char",
        "dataset": dataset,
        "press": "kvzap_mlp",
        "value": -3.0,
        "length": LENGTH,
        "seed": seed,
        "sweep": {"model": None, "haystack_file": None},
    }
    (path / "config.json").write_text(json.dumps(config))
    if finished:
        _write_predictions(path / "predictions.csv", rows)
    else:
        (path / PARTIAL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def samples(tokenizer):
    return {
        task: ruler.generate_task(task, tokenizer, LENGTH, 4, SEED) for task in ("niah_multikey", "niah_multiquery")
    }


def _rows(samples):
    """Multikey: found, other needle, garbled, lost; multiquery: two of four found, one garbled, one lost."""
    mk = samples["niah_multikey"]
    rows = []
    for sample, kind in zip(mk, ("found", "other", "garbled", "lost"), strict=True):
        needles = ruler.needle_values(sample["context"])
        (answer,) = sample["answers"]
        distractor = next(n for n in needles if n != answer)
        prediction = {
            "found": f" {answer}.",
            "other": f" {distractor}.",
            "garbled": f" {_garble(answer, needles)}.",
            "lost": " I do not know.",
        }[kind]
        rows.append({"task": "niah_multikey", "id": sample["id"], "prediction": prediction, "answers": [answer]})
    sample = samples["niah_multiquery"][1]
    a = sample["answers"]
    prediction = f" {a[0]}, {a[1]}, {_garble(a[2], ruler.needle_values(sample['context']))} and 12."
    rows.append({"task": "niah_multiquery", "id": sample["id"], "prediction": prediction, "answers": a})
    for row in rows:
        row.update(score=0.0, compression_ratio=0.5, n_tokens=LENGTH)
    return rows


def test_needle_values_are_those_written(samples):
    for sample in samples["niah_multikey"]:
        values = ruler.needle_values(sample["context"])
        assert len(values) == 4 and sample["answers"][0] in values
    for sample in samples["niah_multiquery"]:
        assert sorted(ruler.needle_values(sample["context"])) == sorted(sample["answers"])


def test_classify_answer():
    needles = ["1234567", "7654321"]
    assert classify_answer(" 1234567.", "1234567", ["1234567"], needles) == "found"
    assert classify_answer(" 7654321.", "1234567", ["1234567"], needles) == "other needle"
    assert classify_answer(" 1234568.", "1234567", ["1234567"], needles) == "garbled"
    assert classify_answer(" 123567.", "1234567", ["1234567"], needles) == "garbled"  # a digit dropped
    assert classify_answer(" 1299997.", "1234567", ["1234567"], needles) == "lost"  # four digits off
    assert classify_answer(" none", "1234567", ["1234567"], needles) == "lost"
    # Multi-query: another asked number is not a distractor.
    assert classify_answer(" 7654321.", "1234567", needles, needles) == "lost"


@pytest.mark.parametrize("finished", [True, False])
def test_needle_errors_counts_each_outcome(tmp_path, tokenizer, samples, finished):
    run = _write_run(tmp_path / "run", _rows(samples), finished=finished)
    result = needle_errors(run, tokenizer)
    assert result["finished"] is finished
    assert result["compression"] == pytest.approx(0.5)
    mk = result["tasks"]["niah_multikey"]
    assert mk["samples"] == 4 and mk["answers"] == 4
    assert mk["outcomes"] == {"found": 1, "other needle": 1, "garbled": 1, "lost": 1}
    mq = result["tasks"]["niah_multiquery"]
    assert mq["samples"] == 1 and mq["answers"] == 4
    assert mq["outcomes"] == {"found": 2, "other needle": 0, "garbled": 1, "lost": 1}
    table = format_errors([result])
    assert "| niah_multikey | 4 | 25.0 | 25.0 | 25.0 | 25.0 |" in table
    assert "| niah_multiquery | 4 | 50.0 | 0.0 | 25.0 | 25.0 |" in table


def test_refuses_samples_that_do_not_match(tmp_path, tokenizer, samples):
    run = _write_run(tmp_path / "run", _rows(samples), seed=SEED + 1)
    with pytest.raises(ValueError, match="pass the tokenizer of the run's model"):
        needle_errors(run, tokenizer)


def test_refuses_other_datasets_and_non_runs(tmp_path, tokenizer, samples):
    run = _write_run(tmp_path / "run", _rows(samples), dataset="longbench")
    with pytest.raises(ValueError, match="offline RULER-style suite"):
        needle_errors(run, tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        needle_errors(tmp_path / "empty", tokenizer)


def test_cli(tmp_path, tokenizer, samples, capsys):
    tokenizer.save_pretrained(tmp_path / "tok")
    run = _write_run(tmp_path / "run", _rows(samples))
    assert evaluation_main(["errors", str(run), "--tokenizer", str(tmp_path / "tok")]) == 0
    out = capsys.readouterr().out
    assert "| run | press | value | evicted | task | asked numbers | found | other needle | garbled | lost |" in out
    assert "| niah_multikey | 4 | 25.0 | 25.0 | 25.0 | 25.0 |" in out
    assert evaluation_main(["errors", str(run), "--tokenizer", str(tmp_path / "tok"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["tasks"]["niah_multikey"]["answers"] == 4
    assert evaluation_main(["errors", str(tmp_path / "missing")]) == 1
    assert "config.json" in capsys.readouterr().err


def test_outcomes_by_needle_position(tmp_path, tokenizer, samples):
    """Each asked number is counted in the bin of its needle's position (with the char tokenizer, its character
    offset in the context), and the bins add up to the task's outcomes."""
    run = _write_run(tmp_path / "run", _rows(samples))
    bins = 100
    result = needle_errors(run, tokenizer, bin_tokens=bins)
    assert result["bin_tokens"] == bins
    expected: dict[int, dict[str, int]] = {}
    for sample, outcome in zip(samples["niah_multikey"], ("found", "other needle", "garbled", "lost"), strict=True):
        (answer,) = sample["answers"]
        match = next(m for m in ruler.NEEDLE_PATTERN.finditer(sample["context"]) if m.group(2) == answer)
        start = match.start() // bins * bins
        expected.setdefault(start, dict.fromkeys(("found", "other needle", "garbled", "lost"), 0))[outcome] += 1
    mk = result["tasks"]["niah_multikey"]
    assert mk["by_position"] == dict(sorted(expected.items()))
    for entry in result["tasks"].values():
        totals = {o: sum(counts[o] for counts in entry["by_position"].values()) for o in entry["outcomes"]}
        assert totals == entry["outcomes"]
    table = format_errors([result])
    first = next(iter(mk["by_position"]))
    assert "| niah_multikey | all | 4 | 25.0 | 25.0 | 25.0 | 25.0 |" in table
    assert f"| niah_multikey | {first}-{first + bins - 1} |" in table
    # Without bins, no position is counted.
    assert "by_position" not in needle_errors(run, tokenizer)["tasks"]["niah_multikey"]


def test_refuses_bad_bins(tmp_path, tokenizer, samples, capsys):
    run = _write_run(tmp_path / "run", _rows(samples))
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bin_tokens must be a positive int"):
            needle_errors(run, tokenizer, bin_tokens=bad)
    tokenizer.save_pretrained(tmp_path / "tok")
    with pytest.raises(SystemExit):
        evaluation_main(["errors", str(run), "--tokenizer", str(tmp_path / "tok"), "--by-position", "0"])
    assert "--by-position takes a positive number of tokens" in capsys.readouterr().err
    assert evaluation_main(["errors", str(run), "--tokenizer", str(tmp_path / "tok"), "--by-position", "400"]) == 0
    assert "| needle at tokens |" in capsys.readouterr().out
