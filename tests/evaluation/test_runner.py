"""End-to-end sweeps on a tiny model: files written, resume, config layering, CLI and plots; every dataset."""

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.benchmarks import BENCHMARKS, LoadRequest
from evaluation.cli import main
from evaluation.compare import compare_pooled, compare_runs, sample_settings
from evaluation.intervals import run_intervals
from evaluation.metrics import last_boxed, normalize_integer_answer, sample_score
from evaluation.plots import summarize
from evaluation.presses import PRESSES, PressFactory
from evaluation.ruler import TASKS, generate_samples
from evaluation.runner import (
    EvalConfig,
    load_config,
    plan_runs,
    run_dir,
    run_evaluation,
    sample_fingerprints,
)
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
        # Every score has its 95% interval, recomputed here from the written per-sample scores.
        low, high = metrics["score_ci"]
        assert 0.0 <= low <= metrics["score"] <= high <= 100.0 and metrics["tasks_n"] == {"niah_single": 2, "cwe": 2}
        for task, (low, high) in metrics["tasks_ci"].items():
            assert low <= metrics["tasks"][task] <= high and metrics["ci_method"][task] in ("wilson", "bootstrap")
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
        # The fingerprints of the samples it answered: those the generator gives again for these settings.
        again = generate_samples(char_tokenizer(), ["niah_single", "cwe"], 400, 2, seed=config.seed)
        assert json.loads((directory / "samples.json").read_text()) == sample_fingerprints(again)
        assert metrics["tasks_compression_ratio"] == pytest.approx(
            {t: sum(ratios[i] for i, r in enumerate(rows) if r["task"] == t) / 2 for t in ("niah_single", "cwe")}
        )
        assert metrics["surrogate"] is None  # the default surrogate (kvzap presses: bundled or published)
        by_task = {t: [float(r["score"]) for r in rows if r["task"] == t] for t in ("niah_single", "cwe")}
        assert {k: metrics[k] for k in ("score_ci", "tasks_ci", "ci_method")} == {
            k: v for k, v in run_intervals(by_task).items() if k in ("score_ci", "tasks_ci", "ci_method")
        }
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
    assert "| tiny-llama | ruler_offline | 400 | random | ratio=0.5 |" in table and "no_press" in table
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
        "ruler_offline__no_press__len1",
        "ruler_offline__kvzap_mlp__threshold-5__len1",
        "ruler_offline__kvzap_mlp__threshold-4__len1",
        "ruler_offline__random__compression_ratio0.25__len1",
    ]
    assert len(labels) == 8
    # Datasets without target lengths: one run per press and value.
    longbench = load_config(dataset="longbench", presses=["no_press", "random"], compression_ratios=[0.5])
    assert [r.label for r in plan_runs(longbench)] == ["longbench__no_press", "longbench__random__compression_ratio0.5"]


def test_cli_errors_before_loading_a_model(tmp_path, monkeypatch, capsys):
    def no_model(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("evaluation.runner._load_model", no_model)
    # A press declared in the registry but not implemented.
    monkeypatch.setitem(PRESSES, "future", PressFactory("future", "threshold", None, "a future press"))
    assert main(["--press", "future", "--output-dir", str(tmp_path)]) == 1
    assert "not available yet" in capsys.readouterr().err
    # aime25 prunes while decoding: a press that cannot is refused before the model loads.
    argv = ["--dataset", "aime25", "--press", "kvzip_plus_threshold", "--threshold", "0", "--output-dir", str(tmp_path)]
    assert main(argv) == 1
    assert "aime25 prunes while decoding, which kvzip_plus_threshold cannot" in capsys.readouterr().err
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


# --- standard benchmarks, from the local fixtures ----------------------------------------------------------------
FIXTURES = Path(__file__).parent / "fixtures"


def _read_outputs(result):
    directory = Path(result["run_dir"])
    metrics = json.loads((directory / "metrics.json").read_text())
    resolved = json.loads((directory / "config.json").read_text())
    with (directory / "predictions.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return metrics, resolved, rows


def _assert_consistent(metrics, rows, tasks):
    assert list(metrics["tasks"]) == list(tasks) and metrics["n_predictions"] == len(rows)
    for task in tasks:
        scores = [float(r["score"]) for r in rows if r["task"] == task]
        assert metrics["tasks"][task] == pytest.approx(sum(scores) / len(scores))
    assert metrics["score"] == pytest.approx(sum(metrics["tasks"].values()) / len(tasks))


def test_ruler_hub_format_end_to_end(tmp_path, monkeypatch):
    tasks = ["niah_single_1", "vt", "qa_1"]
    config = load_config(
        dataset="ruler",
        dataset_path=str(FIXTURES / "ruler"),
        presses=["no_press", "random"],
        compression_ratios=[0.5],
        tasks=tasks,
        lengths=[512],
        fraction=0.5,
        max_new_tokens=4,
        output_dir=str(tmp_path),
    )
    results = run_evaluation(config, tiny_model("llama"), char_tokenizer())
    assert [Path(r["run_dir"]).name.rsplit("__", 1)[0] for r in results] == [
        "ruler__no_press__len512",
        "ruler__random__compression_ratio0.5__len512",
    ]
    for result in results:
        metrics, resolved, rows = _read_outputs(result)
        _assert_consistent(metrics, rows, tasks)
        assert metrics["dataset"] == "ruler" and metrics["length"] == 512
        assert [r["task"] for r in rows] == ["niah_single_1", "niah_single_1", "vt", "qa_1"]  # half of each, >= 1
        assert resolved["dataset"] == "ruler" and resolved["fraction"] == 0.5 and "n_samples" not in resolved
        assert resolved["source"] == str((FIXTURES / "ruler").resolve())
        for row in rows:
            sample = {"task": row["task"], "answers": json.loads(row["answers"])}
            assert float(row["score"]) == BENCHMARKS["ruler"].score(sample, row["prediction"])
    # Resume skips; another fraction is another run.
    monkeypatch.setattr("evaluation.runner._evaluate_run", _fail)
    assert all(r["skipped"] for r in run_evaluation(config, tiny_model("llama"), char_tokenizer()))
    other = dataclasses.replace(config, fraction=1.0)
    assert run_dir(other, plan_runs(other)[0], "tiny-llama") != Path(results[0]["run_dir"])


def _fail(*args, **kwargs):
    raise AssertionError("a finished run was evaluated again")


def test_longbench_end_to_end(tmp_path, monkeypatch):
    tasks = ["narrativeqa", "trec", "passage_retrieval_en", "lcc"]
    config = load_config(
        dataset="longbench",
        dataset_path=str(FIXTURES / "longbench"),
        presses=["no_press", "key_norm"],
        compression_ratios=[0.5],
        tasks=tasks,
        fraction=0.5,
        max_new_tokens=3,
        max_context_length=120,
        output_dir=str(tmp_path),
    )
    results = run_evaluation(config, tiny_model("llama"), char_tokenizer())
    assert [r["length"] for r in results] == [None, None] and [r["dataset"] for r in results] == ["longbench"] * 2
    # The samples run: one of the two of each task, contexts cut in the middle to 120 tokens.
    request = LoadRequest(tasks=tuple(tasks), path=str(FIXTURES / "longbench"), fraction=0.5, max_context_length=120)
    samples = BENCHMARKS["longbench"].load(request, char_tokenizer())
    assert [s["task"] for s in samples] == tasks and all(len(s["context"]) <= 120 for s in samples)
    for result in results:
        metrics, resolved, rows = _read_outputs(result)
        _assert_consistent(metrics, rows, tasks)
        assert [(r["id"], int(r["n_tokens"])) for r in rows] == [(s["id"], s["n_tokens"]) for s in samples]
        assert resolved["length"] is None and resolved["max_context_length"] == 120 and resolved["fraction"] == 0.5
        for row, sample in zip(rows, samples, strict=True):
            assert float(row["score"]) == BENCHMARKS["longbench"].score(sample, row["prediction"])
        ratios = [float(r["compression_ratio"]) for r in rows]
        assert ratios == [0.0] * 4 if result["press"] == "no_press" else all(0.4 < r < 0.6 for r in ratios)
    monkeypatch.setattr("evaluation.runner._evaluate_run", _fail)
    assert all(r["skipped"] for r in run_evaluation(config, tiny_model("llama"), char_tokenizer()))


def test_aime_end_to_end_prunes_while_decoding(tmp_path, monkeypatch):
    from kvzap.surrogates import KVzapSurrogate

    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2).save_pretrained(tmp_path / "surrogate")
    config = load_config(
        dataset="aime25",
        dataset_path=str(FIXTURES / "aime25"),
        presses=["no_press", "kvzap_linear"],
        thresholds=[100.0],
        surrogate=str(tmp_path / "surrogate"),
        sliding_window_size=4,
        max_new_tokens=10,
        temperature=0.8,
        output_dir=str(tmp_path / "out"),
    )
    assert config.decoding is False  # the setting is off, but AIME always prunes while decoding
    results = run_evaluation(config, tiny_model("llama"), char_tokenizer())
    by_press = {r["press"]: _read_outputs(r) for r in results}
    for metrics, resolved, rows in by_press.values():
        _assert_consistent(metrics, rows, ["aime25"])
        assert [r["id"] for r in rows] == ["fixture-1", "fixture-2", "fixture-3"]
        assert resolved["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
        for row in rows:
            assert float(row["score"]) == (
                100.0
                if normalize_integer_answer(last_boxed(row["prediction"]) or "") == json.loads(row["answers"])[0]
                else 0.0
            )
    metrics, resolved, rows = by_press["kvzap_linear"]
    assert resolved["decoding"] is True and metrics["compression_ratio"] > 0.5
    assert by_press["no_press"][1]["decoding"] is None and by_press["no_press"][0]["compression_ratio"] == 0.0
    monkeypatch.setattr("evaluation.runner._evaluate_run", _fail)
    assert all(r["skipped"] for r in run_evaluation(config, tiny_model("llama"), char_tokenizer()))
    # The sampling settings are part of the run's identity.
    hotter = dataclasses.replace(config, temperature=1.0)
    assert run_dir(hotter, plan_runs(hotter)[0], "tiny-llama") != Path(results[0]["run_dir"])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(dataset="nope"), "Unknown dataset 'nope'; choose from ruler_offline, ruler, longbench, aime25"),
        (dict(dataset="longbench", tasks="narrativeqa,niah_single"), "Unknown task 'niah_single' for the dataset"),
        (dict(dataset="ruler", tasks=["cwe", "cwe"]), "named twice"),
        (dict(dataset="longbench", lengths=[4096]), "has no target lengths"),
        (dict(dataset="aime25", lengths=[4096]), "has no target lengths"),
        (dict(dataset="ruler", n_samples=5), "use fraction"),
        (dict(fraction=0.5), "ruler_offline takes n_samples"),
        (dict(dataset="ruler", fraction=0.0), r"fraction must be in \(0, 1\]"),
        (dict(dataset="ruler", fraction=1.5), r"fraction must be in \(0, 1\]"),
        (dict(dataset_path="tests"), "ruler_offline is generated"),
        (dict(dataset="ruler", dataset_path="/no/such/dir"), "does not exist"),
        (dict(dataset="ruler", dataset_path=str(FIXTURES / "ruler"), lengths=[4096]), "4096.jsonl"),
        (dict(dataset="longbench", dataset_path=str(FIXTURES / "longbench")), "qasper"),
        (dict(dataset="ruler", haystack_file="x.txt"), "haystack_file is a setting of ruler_offline"),
        (dict(temperature=0.7), "temperature set the sampling of aime25"),
        (dict(dataset="longbench", top_k=5), "top_k set the sampling"),
        (dict(dataset="aime25", temperature=0.0), "temperature must be > 0"),
        (dict(dataset="aime25", top_p=2.0), r"top_p must be in \(0, 1\]"),
        (dict(dataset="aime25", max_context_length=100), "max_context_length does not apply"),
        (dict(dataset="aime25", prefill_chunk_size=64), "prefill_chunk_size does not apply"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size must be a positive integer"),
    ],
)
def test_bad_settings_fail_before_loading(settings, message):
    with pytest.raises(ValueError, match=message):
        load_config(**settings)


def test_chinese_tasks_need_jieba(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "jieba" else real_find_spec(name))
    with pytest.raises(ValueError, match="pip install jieba"):
        load_config(dataset="longbench", tasks=["dureader"])
    assert load_config(dataset="longbench", tasks=["lsht", "passage_retrieval_zh"]).task_list == (
        "lsht",
        "passage_retrieval_zh",
    )


def test_dataset_defaults_resolve():
    assert load_config().task_list == tuple(TASKS) and load_config().length_list == [4096]
    assert load_config().samples_per_task == 10 and load_config().sampling is None
    longbench = load_config(dataset="longbench")
    assert len(longbench.task_list) == 16 and longbench.length_list == [None]
    assert load_config(dataset="ruler", lengths=[4096, 8192]).length_list == [4096, 8192]
    aime = load_config(dataset="aime25", top_k=0)
    assert aime.sampling.top_k == 0 and aime.sampling.temperature == 0.6
    assert aime.decoding_for("threshold") is True and aime.decoding_for("compression_ratio") is None


def test_cli_benchmark_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("evaluation.runner._load_model", lambda config: (tiny_model("llama"), char_tokenizer()))
    argv = ["--dataset", "longbench", "--dataset-path", str(FIXTURES / "longbench"), "--tasks", "trec,lcc"]
    argv += ["--press", "no_press", "--max-new-tokens", "2", "--fraction", "0.5", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    assert "longbench__no_press" in capsys.readouterr().out
    (metrics_path,) = tmp_path.rglob("metrics.json")
    metrics = json.loads(metrics_path.read_text())
    assert metrics["n_predictions"] == 2 and set(metrics["tasks"]) == {"trec", "lcc"}
    assert main(["--dataset", "longbench", "--lengths", "4096"]) == 2
    assert "has no target lengths" in capsys.readouterr().err
    assert main(["--dataset", "aime25", "--top-p", "0"]) == 2


def test_help_lists_every_dataset(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("ruler_offline", "ruler", "longbench", "aime25", "--dataset-path", "--fraction", "--temperature"):
        assert name in out
    assert "simonjegou/ruler" in out and "THUDM/LongBench" in out and "alessiodevoto/aime25" in out


def test_plot_panels_per_dataset_and_datasets_without_length(tmp_path):
    from evaluation.plots import _panel, collect_results, summary_table

    def write(name, **metrics):
        run = tmp_path / name
        run.mkdir()
        base = {"model": "m", "score": 50.0, "tasks": {"t": 50.0}, "compression_ratio": 0.0, "knob": None}
        (run / "metrics.json").write_text(json.dumps({**base, **metrics}), encoding="utf-8")

    write("a", dataset="ruler_offline", length=2048, press="no_press", value=None)
    write("b", dataset="longbench", length=None, press="no_press", value=None)
    write("c", dataset="longbench", length=None, press="kvzap_mlp", knob="threshold", value=-4.0, compression_ratio=0.5)
    results = collect_results(tmp_path)
    assert [(_panel(r), r["press"]) for r in results] == [
        (("m", "longbench", -1), "kvzap_mlp"),
        (("m", "longbench", -1), "no_press"),
        (("m", "ruler_offline", 2048), "no_press"),
    ]
    assert "| m | longbench | - | kvzap_mlp | tau=-4 | - | 0.500 |" in summary_table(results)
    paths = summarize(tmp_path, tmp_path / "out")  # two panels, no crash on the missing length
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chunked_prefill_runs_in_their_own_directories(finished, monkeypatch):
    config, results = finished
    calls = []
    from kvzap.pipeline import KVPressTextGenerationPipeline

    original = KVPressTextGenerationPipeline._forward

    def spy(self, inputs, *args, **kwargs):
        calls.append(kwargs.get("prefill_chunk_size"))
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward", spy)
    chunked = load_config(output_dir=config.output_dir, prefill_chunk_size=64, **SETTINGS)
    again = run_evaluation(chunked, tiny_model("llama"), char_tokenizer())
    assert [r["skipped"] for r in again] == [False, False]  # not mistaken for the dense runs
    assert {r["run_dir"] for r in again}.isdisjoint(r["run_dir"] for r in results)
    assert calls and set(calls) == {64}
    recorded = json.loads((Path(again[1]["run_dir"]) / "config.json").read_text())
    assert recorded["prefill_chunk_size"] == 64


def test_sinks_key_the_runs_that_keep_them_and_reach_the_press(tmp_path):
    from evaluation.cli import config_from_args
    from evaluation.presses import make_press
    from evaluation.runner import RunSpec

    def directory(press="kvzip_plus_threshold", **settings):
        knob, value = ("threshold", -4.0) if press != "random" else ("compression_ratio", 0.5)
        config = load_config(output_dir=str(tmp_path), presses=[press], **settings)
        return run_dir(config, RunSpec(press, knob, value, 400), "tiny")

    dense = directory()
    assert directory(sink_size=None) == dense  # one forward keeps no sinks: its directory is unchanged
    assert directory(sink_size=2) != dense
    # In chunks the press keeps SINK_SIZE (4) unless told: the same setting as an explicit 4, not as 0.
    assert directory(prefill_chunk_size=64) == directory(prefill_chunk_size=64, sink_size=4)
    assert directory(prefill_chunk_size=64, sink_size=0) != directory(prefill_chunk_size=64)
    assert directory("random", sink_size=2) == directory("random")  # top-k presses keep no sinks
    assert make_press("kvzip_plus_threshold", -4.0, sink_size=3).sink_size == 3
    assert make_press("kvzip_plus_threshold", -4.0).sink_size is None
    config, _ = config_from_args(["--press", "kvzap_mlp", "--threshold=-3", "--sink-size", "2"])
    assert config.sink_size == 2
    with pytest.raises(ValueError, match="sink_size"):
        load_config(sink_size=-1)


def test_processes_share_the_runs(tmp_path, monkeypatch):
    """Under a multi-process launch, process r of N runs runs[r::N]; together they cover the sweep once."""
    import evaluation.runner as runner

    settings = {**SETTINGS, "compression_ratios": [0.25, 0.5, 0.75]}  # 4 runs: no_press and 3 random
    config = load_config(output_dir=str(tmp_path), **settings)
    done = []
    for rank in (0, 1):
        monkeypatch.setattr(runner, "_process_share", lambda rank=rank: (rank, 2, None))
        results = run_evaluation(config, tiny_model("llama"), char_tokenizer())
        done.append([(r["press"], r["value"]) for r in results])
    assert done == [[("no_press", None), ("random", 0.5)], [("random", 0.25), ("random", 0.75)]]
    assert len(list(tmp_path.rglob("metrics.json"))) == 4


def test_process_share_under_torchrun_on_cpu(tmp_path):
    """Two CPU processes launched by torchrun see ranks 0 and 1 of 2 (accelerate needs cpu=True to see them)."""
    script = tmp_path / "share.py"
    # Each process writes its own file: the processes' stdout interleave in torchrun's.
    script.write_text(
        "import os, pathlib\nfrom evaluation.runner import _process_share\n"
        f"pathlib.Path({str(tmp_path)!r}, 'share-' + os.environ['RANK']).write_text("
        "'share %d %d' % _process_share()[:2])\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shares = [(tmp_path / f"share-{rank}").read_text() for rank in (0, 1)]
    assert shares == ["share 0 2", "share 1 2"]


def test_compare_reads_finished_and_unfinished_runs(tmp_path, capsys):
    """`python -m evaluation compare A B`: the paired difference of a finished run and one still going."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    columns = ["task", "id", "prediction", "answers", "score", "compression_ratio", "n_tokens"]
    with (a / "predictions.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for i in range(4):
            writer.writerow(dict(zip(columns, ["t", i, "x", "[]", 100.0, 0.8, 10], strict=True)))
    lines = [json.dumps({"task": "t", "id": i, "score": 100.0 * (i < 2), "compression_ratio": 0.6}) for i in range(3)]
    (b / "predictions.partial.jsonl").write_text("\n".join(lines) + '\n{"task": "t", "id"', encoding="utf-8")
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "(unfinished)" in out and "1 samples answered by one run only" in out
    assert "| **mean over tasks** | 3 | 100.0 | 66.7 | +33.3" in out and "| 1 / 0 | 80.0% | 60.0% |" in out
    assert main(["compare", str(a), str(b), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["difference"] == pytest.approx(100 / 3) and result["n"] == 3 and not result["finished_b"]
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 1
    assert "holds no predictions.csv" in capsys.readouterr().err


def test_compare_refuses_runs_of_different_samples(tmp_path, capsys):
    """Sample ids do not carry the seed, haystack or model that made an offline RULER sample: `compare` reads both
    runs' config.json and refuses to pair runs whose samples differ."""
    base = {"model": "M", "dataset": "ruler_offline", "source": None, "length": 2048, "seed": 0, "haystack": "h"}
    base.update(max_context_length=None, press="kvzap_mlp", value=-3, surrogate=None)
    runs = {}
    for name, change in [
        ("a", {}),
        ("same", {"value": -2.5, "surrogate": "other/mlp", "press": "no_press"}),
        ("seed1", {"seed": 1}),
        ("model", {"model": "N"}),
        ("hub", {"dataset": "ruler", "source": "org/ruler", "seed": 1}),
        ("hub_seed2", {"dataset": "ruler", "source": "org/ruler", "seed": 2}),
    ]:
        run = runs[name] = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({**base, **change}))
        lines = [json.dumps({"task": "t", "id": i, "score": 100.0, "compression_ratio": 0.5}) for i in range(2)]
        (run / "predictions.partial.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # Another press, threshold or surrogate on the same samples: paired as before.
    assert main(["compare", str(runs["a"]), str(runs["same"])]) == 0
    capsys.readouterr()
    assert main(["compare", str(runs["a"]), str(runs["seed1"])]) == 1
    err = capsys.readouterr().err
    assert "did not answer the same samples (seed 0 against 1)" in err and "--seed" in err
    with pytest.raises(ValueError, match="model 'M' against 'N'"):
        compare_runs(runs["a"], runs["model"])
    with pytest.raises(ValueError, match="dataset 'ruler_offline' against 'ruler'; source None against 'org/ruler'"):
        compare_runs(runs["a"], runs["hub"])
    # A Hub dataset's rows are fixed: its seed only picks a fraction of them, which the ids pair.
    assert compare_runs(runs["hub"], runs["hub_seed2"])["n"] == 2
    assert sample_settings({"dataset": "d", "source": "s", "length": 1, "seed": 3}) == {
        "dataset": "d",
        "source": "s",
        "length": 1,
    }
    # Runs without config.json (or of older versions lacking a setting) are compared on what they have.
    (runs["seed1"] / "config.json").unlink()
    assert compare_runs(runs["a"], runs["seed1"])["n"] == 2


def test_compare_judges_runs_on_their_sample_fingerprints(tmp_path, capsys):
    """A run writes samples.json, a hash of every sample's content: `compare` pairs two runs on it when both have
    one, so two models sharing a tokenizer (a fine-tuned copy) compare, and runs whose samples differ are refused
    even when their settings agree."""
    tok = char_tokenizer()
    samples = {seed: generate_samples(tok, ["niah_single"], 600, 3, seed=seed) for seed in (0, 1)}
    assert samples[0][0]["id"] == samples[1][0]["id"] and samples[0][0]["context"] != samples[1][0]["context"]
    fingerprints = {seed: sample_fingerprints(s) for seed, s in samples.items()}
    assert list(fingerprints[0]) == [
        "niah_single/niah_single-600-0",
        "niah_single/niah_single-600-1",
        "niah_single/niah_single-600-2",
    ]
    assert fingerprints[0] == sample_fingerprints(generate_samples(tok, ["niah_single"], 600, 3, seed=0))
    assert all(fingerprints[0][k] != fingerprints[1][k] for k in fingerprints[0])
    base = {"model": "M", "dataset": "ruler_offline", "source": None, "length": 600, "seed": 0, "haystack": "h"}
    runs = {}
    for name, change, seed in [("a", {}, 0), ("tuned", {"model": "M-tuned"}, 0), ("same_settings", {}, 1)]:
        run = runs[name] = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({**base, **change}))
        (run / "samples.json").write_text(json.dumps(fingerprints[seed]))
        lines = [
            json.dumps({"task": s["task"], "id": s["id"], "score": 100.0, "compression_ratio": 0.5})
            for s in samples[seed]
        ]
        (run / "predictions.partial.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert compare_runs(runs["a"], runs["tuned"])["n"] == 3  # the settings differ (model), the samples do not
    with pytest.raises(ValueError, match="3 of 3 paired samples differ in content, e.g. niah_single/niah_single-600-0"):
        compare_runs(runs["a"], runs["same_settings"])
    # A run without fingerprints (older versions): judged on the settings, which refuse the other model.
    (runs["tuned"] / "samples.json").unlink()
    with pytest.raises(ValueError, match="model 'M' against 'M-tuned'"):
        compare_runs(runs["a"], runs["tuned"])


def test_compare_pools_pairs_of_runs_over_seeds(tmp_path, capsys):
    """`compare A0 B0 A1 B1`: one paired difference over both seeds' samples, whose ids coincide; refused when a
    side mixes presses, when two pairs hold the same samples, or when a run has no partner."""
    base = {"model": "M", "dataset": "ruler_offline", "source": None, "length": 600, "haystack": "h"}
    base.update(max_context_length=None, press="kvzap_mlp", knob="threshold", surrogate_weights="w")

    def run(name, seed, value, scores):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**base, "seed": seed, "value": value}))
        lines = [
            json.dumps({"task": task, "id": f"{task}-{i}", "score": score, "compression_ratio": 0.5 + seed / 10})
            for task in ("t", "u")
            for i, score in enumerate(scores)
        ]
        (directory / "predictions.partial.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return str(directory)

    a0, b0 = run("a0", 0, -3, [100, 100, 0, 0]), run("b0", 0, -2, [100, 0, 0, 0])
    a1, b1 = run("a1", 1, -3, [100, 100, 100, 0]), run("b1", 1, -2, [100, 100, 0, 0])
    pooled = compare_pooled([(a0, b0), (a1, b1)])
    # Eight samples a task (ids t-0..t-3 twice, kept apart by their pair): A 5/8, B 3/8 in both tasks.
    assert pooled["n"] == 16 and pooled["unpaired"] == 0 and pooled["pairs"] == 2
    assert pooled["difference"] == pytest.approx(25.0)
    assert pooled["score_a"] == pytest.approx(62.5) and pooled["score_b"] == pytest.approx(37.5)
    assert pooled["compression_a"] == pytest.approx(0.55) and pooled["run_a"] == f"{a0} + {a1}"
    assert (pooled["higher_a"], pooled["higher_b"]) == (4, 0) and pooled["tasks"]["t"]["higher_a"] == 2
    single = [compare_runs(a, b) for a, b in ((a0, b0), (a1, b1))]
    assert [r["n"] for r in single] == [8, 8] and [r["difference"] for r in single] == [25.0, 25.0]
    low, high = pooled["interval"]
    assert low <= 25.0 <= high and high - low < single[0]["interval"][1] - single[0]["interval"][0]
    assert main(["compare", a0, b0, a1, b1]) == 0
    out = capsys.readouterr().out
    assert "pooled over 2 pairs of runs" in out and "| **mean over tasks** | 16 | 62.5 | 37.5 | +25.0" in out
    # The seed-1 pair swapped: side A would pool threshold -3 with -2.
    with pytest.raises(ValueError, match="A's runs .* were not answered alike \\(value -3 against -2\\)"):
        compare_pooled([(a0, b0), (b1, a1)])
    with pytest.raises(ValueError, match="answered the same samples: pooled pairs must be runs of different"):
        compare_pooled([(a0, b0), (a0, b0)])
    with pytest.raises(SystemExit):
        main(["compare", a0, b0, a1])
    assert "the last of 3 has no partner" in capsys.readouterr().err
