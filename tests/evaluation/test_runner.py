"""End-to-end sweeps on a tiny model: files written, resume, config layering, CLI and plots."""

import csv
import json

import pytest

from evaluation.metrics import sample_score
from evaluation.plots import summarize
from evaluation.runner import EvalConfig, load_config, main, plan_runs, run_dir, run_evaluation
from tests.conftest import char_tokenizer, tiny_model

SETTINGS = dict(
    presses=["no_press", "random"],
    compression_ratios=[0.5],
    tasks=["niah_single", "cwe"],
    lengths=[400],
    n_samples=2,
    max_new_tokens=6,
)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One small sweep, shared by the tests that only read its files."""
    config = load_config(output_dir=str(tmp_path_factory.mktemp("eval")), **SETTINGS)
    results = run_evaluation(config, tiny_model("llama"), char_tokenizer())
    return config, results


def test_writes_every_file(finished):
    config, results = finished
    assert [(r["press"], r["value"], r["skipped"]) for r in results] == [
        ("no_press", None, False),
        ("random", 0.5, False),
    ]
    for result in results:
        directory = run_dir(config, plan_runs(config)[results.index(result)], "tiny-llama")
        assert str(directory) == result["run_dir"]
        metrics = json.loads((directory / "metrics.json").read_text())
        assert set(metrics["tasks"]) == {"niah_single", "cwe"} and metrics["n_predictions"] == 4
        assert metrics["score"] == pytest.approx(sum(metrics["tasks"].values()) / 2)
        resolved = json.loads((directory / "config.json").read_text())
        assert resolved["press"] == result["press"] and resolved["length"] == 400 and resolved["model"] == "tiny-llama"
        with (directory / "predictions.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        assert [r["task"] for r in rows] == ["niah_single", "niah_single", "cwe", "cwe"]
        for row in rows:
            answers = json.loads(row["answers"])
            assert float(row["score"]) == sample_score(row["task"], row["prediction"], answers)
        ratios = [float(r["compression_ratio"]) for r in rows]
        assert metrics["compression_ratio"] == pytest.approx(sum(ratios) / len(ratios))
        if result["press"] == "no_press":
            assert ratios == [0.0] * 4
        else:
            assert all(0.45 < r < 0.55 for r in ratios)


def test_resume_skips_finished_runs(finished, monkeypatch):
    config, results = finished

    def fail(*args, **kwargs):
        raise AssertionError("a finished run was evaluated again")

    monkeypatch.setattr("evaluation.runner._evaluate_run", fail)
    again = run_evaluation(config, tiny_model("llama"), char_tokenizer())
    assert [r["skipped"] for r in again] == [True, True]
    assert [r["metrics"] for r in again] == [r["metrics"] for r in results]


def test_summary_plot_and_table(finished, tmp_path):
    config, _ = finished
    paths = summarize(config.output_dir, tmp_path)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = paths["table"].read_text()
    assert "| tiny-llama | 400 | random | ratio=0.5 |" in table and "no_press" in table
    assert main(["plot", "--results-dir", config.output_dir, "--output-dir", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "summary.md").exists()


def test_config_layers(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("presses: no_press,random\nn_samples: 3\nthresholds: -4\nlengths: [1024, 2048]\n")
    config = load_config(path, n_samples=5)
    assert config.presses == ["no_press", "random"] and config.n_samples == 5
    assert config.thresholds == [-4.0] and config.lengths == [1024, 2048]
    assert config.seed == EvalConfig().seed
    assert load_config(model="some/model").model == "some/model"
    assert load_config(model="default").model is None and load_config(model="none").model is None
    with pytest.raises(ValueError, match="Unknown setting"):
        load_config(path, n_sample=5)
    with pytest.raises(ValueError, match="Unknown press"):
        load_config(presses=["nope"])
    with pytest.raises(ValueError, match="Unknown task"):
        load_config(tasks="niah_single,nope")


def test_plan_sweeps_each_press_knob():
    config = load_config(
        presses=["no_press", "kvzap_mlp", "random"], thresholds=[-5, -4], compression_ratios=[0.25], lengths=[1, 2]
    )
    labels = [r.label for r in plan_runs(config)]
    assert labels[:4] == [
        "no_press__len1",
        "kvzap_mlp__threshold-5__len1",
        "kvzap_mlp__threshold-4__len1",
        "random__compression_ratio0.25__len1",
    ]
    assert len(labels) == 8


def test_cli_errors_before_loading_a_model(tmp_path, capsys):
    assert main(["--press", "kvzip_plus", "--output-dir", str(tmp_path)]) == 1
    assert "not available yet" in capsys.readouterr().err
    assert main(["--tasks", "nope"]) == 2
    assert main(["plot", "--results-dir", str(tmp_path / "missing")]) == 1


def test_cli_sweep_with_yaml_and_flags(tmp_path, monkeypatch, capsys):
    # The CLI loads the model itself: hand it the tiny one. A KVzap press reads a surrogate from --surrogate.
    from kvzap.surrogates import KVzapSurrogate

    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2).save_pretrained(tmp_path / "surrogate")
    monkeypatch.setattr("evaluation.runner._load_model", lambda config: (tiny_model("llama"), char_tokenizer()))
    path = tmp_path / "config.yaml"
    path.write_text("presses: [kvzap_linear]\nthresholds: [100.0]\nn_samples: 5\nmax_new_tokens: 4\n")
    argv = ["--config", str(path), "--n-samples", "1", "--tasks", "niah_single", "--lengths", "400"]
    argv += ["--threshold", "100", "--sliding-window-size", "8", "--surrogate", str(tmp_path / "surrogate")]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "kvzap_linear__threshold100__len400" in printed
    (metrics_path,) = (tmp_path / "out").rglob("metrics.json")
    metrics = json.loads(metrics_path.read_text())
    # Every score is below a threshold of 100: all but the 8-token window is evicted.
    assert metrics["n_predictions"] == 1 and metrics["compression_ratio"] > 0.9
    resolved = json.loads((metrics_path.parent / "config.json").read_text())
    assert resolved["surrogate"] == str(tmp_path / "surrogate") and resolved["sliding_window_size"] == 8
