"""Batched evaluation (``batch_size``): the same answers and per-sample statistics as batch 1, resumable inside a
run, and clear refusals for what cannot batch. Tiny seeded model, offline."""

import csv
import json
import logging
from pathlib import Path

import pytest
import torch

from evaluation.cli import main
from evaluation.runner import interleave_tasks, load_config, plan_batches, run_evaluation
from kvzap.pipeline import KVPressTextGenerationPipeline
from tests.conftest import char_tokenizer, tiny_model

SETTINGS = dict(
    presses=["no_press", "kvzap_mlp"],
    thresholds=[0.0],
    tasks=["niah_single", "cwe"],
    lengths=[400],
    n_samples=4,
    max_new_tokens=6,
    sliding_window_size=8,
)


@pytest.fixture(scope="module")
def surrogate(tmp_path_factory):
    from kvzap.surrogates import KVzapSurrogate

    path = tmp_path_factory.mktemp("surrogate")
    torch.manual_seed(0)  # the ratios checked below depend on the weights (torch's default seed is random)
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2, hidden_dim=8).save_pretrained(path)
    return str(path)


def _sweep(output_dir, surrogate, **overrides):
    config = load_config(output_dir=str(output_dir), surrogate=surrogate, **{**SETTINGS, **overrides})
    return run_evaluation(config, tiny_model("llama"), char_tokenizer())


def _outputs(results):
    """Per run directory name: its predictions.csv rows (strings, as written) and its metrics.json."""
    found = {}
    for result in results:
        directory = Path(result["run_dir"])
        with (directory / "predictions.csv").open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        found[directory.name] = (rows, json.loads((directory / "metrics.json").read_text()))
    return found


@pytest.fixture(scope="module")
def batch_one(tmp_path_factory, surrogate):
    """The reference: every sample alone."""
    return _outputs(_sweep(tmp_path_factory.mktemp("batch1"), surrogate))


@pytest.fixture
def batches_seen(monkeypatch):
    """The context lengths of every batch the pipeline prefills."""
    seen = []
    original = KVPressTextGenerationPipeline._forward_batch

    def spy(self, rows, *args, **kwargs):
        seen.append([r["context_ids"].shape[1] for r in rows])
        return original(self, rows, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward_batch", spy)
    return seen


def test_batch_of_three_gives_the_answers_and_ratios_of_batch_one(tmp_path, surrogate, batch_one, batches_seen):
    batched = _outputs(_sweep(tmp_path, surrogate, batch_size=3))
    assert list(batched) == list(batch_one)  # the batch size is not part of a run's identity
    # Padded batches ran: rows of different lengths prefilled together, grouped by task (one answer prefix each).
    # 8 samples of one budget (max_new_tokens) per run: batches of 3, 3 and 2, across both tasks.
    assert [len(b) for b in batches_seen] == [3, 3, 2] * 2
    assert any(len(set(b)) > 1 for b in batches_seen)
    assert all(b == sorted(b) for b in batches_seen)  # sorted by length: the padding stays small
    for name, (rows, metrics) in batch_one.items():
        assert batched[name][0] == rows  # predictions, scores and per-sample compression ratios, as written
        assert batched[name][1] == metrics  # scores, intervals, mean compression
    ratios = {name: [float(r["compression_ratio"]) for r in rows] for name, (rows, _) in batch_one.items()}
    no_press, dms = sorted(ratios, key=lambda name: "kvzap_mlp" in name)
    assert ratios[no_press] == [0.0] * 8
    assert all(0.1 < r < 0.9 for r in ratios[dms]) and len(set(ratios[dms])) > 1  # each row its own statistic


def test_presses_that_cannot_pad_batch_equal_lengths_only(tmp_path, surrogate, batches_seen, caplog):
    settings = dict(presses=["key_norm"], compression_ratios=[0.5], tasks=["cwe"])  # two pairs of equal lengths
    reference = _outputs(_sweep(tmp_path / "one", surrogate, **settings))
    with caplog.at_level(logging.WARNING, logger="evaluation.runner"):
        batched = _outputs(_sweep(tmp_path / "three", surrogate, batch_size=3, **settings))
    assert batched == reference
    assert all(len(set(b)) == 1 for b in batches_seen) and any(len(b) > 1 for b in batches_seen)
    assert "key_norm batches contexts of equal length only, as it cannot prune a padded batch" in caplog.text


def test_a_killed_run_resumes_with_its_finished_batches(tmp_path, surrogate, batch_one, monkeypatch):
    original = KVPressTextGenerationPipeline._forward_batch
    calls = []

    def killed_at_second_batch(self, rows, *args, **kwargs):
        calls.append(len(rows))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, rows, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward_batch", killed_at_second_batch)
    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path, surrogate, batch_size=3, presses=["kvzap_mlp"])
    (run,) = [p for p in tmp_path.rglob("predictions.partial.jsonl")]
    assert not (run.parent / "metrics.json").exists() and (run.parent / "config.json").exists()
    assert len(run.read_text().splitlines()) == calls[0] == 3  # the first batch, on disk
    with run.open("a") as handle:
        handle.write('{"task": "cwe", "id": "cw')  # a line the kill cut off
    monkeypatch.undo()

    # Resumed one sample at a time: only the five samples left run again.
    prefilled = []
    original_forward = KVPressTextGenerationPipeline._forward

    def count(self, inputs, *args, **kwargs):
        prefilled.append(inputs["context_ids"].shape[1])
        return original_forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward", count)
    resumed = _outputs(_sweep(tmp_path, surrogate, presses=["kvzap_mlp"]))
    assert len(prefilled) == 5
    (name,) = resumed
    assert resumed[name] == batch_one[name]  # the same files as a run never interrupted
    assert not list(tmp_path.rglob("predictions.partial.jsonl"))


def test_plan_batches_groups_by_budget_and_length():
    lengths = [50, 10, 30, 10, 40, 20, 30]
    budgets = [8, 8, 8, 8, 8, 4, 8]
    # Sorted by length inside each budget (smallest first); a batch never mixes budgets.
    assert plan_batches(lengths, budgets, 2, equal_lengths=False) == [[5], [1, 3], [2, 6], [4, 0]]
    assert plan_batches(lengths, budgets, 8, equal_lengths=False) == [[5], [1, 3, 2, 6, 4, 0]]
    assert plan_batches(lengths, budgets, 8, equal_lengths=True) == [[5], [1, 3], [2, 6], [4], [0]]
    assert plan_batches(lengths, budgets, 1, equal_lengths=False) == [[5], [1], [3], [2], [6], [4], [0]]
    with pytest.raises(ValueError, match="one entry per sample"):
        plan_batches([1, 2], [8], 2, equal_lengths=False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(batch_size=0), "batch_size must be a positive integer, got 0"),
        (dict(batch_size=-2), "batch_size must be a positive integer, got -2"),
        (dict(batch_size=2.5), "batch_size must be a positive integer, got 2.5"),
        (dict(dataset="aime25", batch_size=2), "'aime25' samples each answer with model.generate"),
        (dict(presses=["no_press", "random"], batch_size=2), r"random decide differently in a batch"),
        (dict(presses=["kvzap_mlp"], decoding=True, batch_size=2), "decoding=True prunes while answering"),
    ],
)
def test_batches_that_cannot_match_batch_one_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        load_config(**settings)


def test_batch_size_flag(capsys):
    assert load_config(presses=["no_press", "key_norm"], decoding=True, batch_size=4).batch_size == 4
    assert main(["--batch-size", "0"]) == 2
    assert "batch_size must be a positive integer, got 0" in capsys.readouterr().err
    from kvzap.cli import main as kvzap_main

    assert kvzap_main(["evaluate", "--batch-size", "0"]) == 2  # `kvzap evaluate` forwards the flag
    assert "batch_size must be a positive integer, got 0" in capsys.readouterr().err


def test_one_at_a_time_a_killed_run_holds_every_task(tmp_path, surrogate, batch_one, monkeypatch):
    # Samples are answered task by task in turn, so a run stopped part-way has a partial score over every task.
    original = KVPressTextGenerationPipeline._forward
    calls = []

    def killed_at_fifth(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward", killed_at_fifth)
    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path, surrogate, presses=["kvzap_mlp"])
    (run,) = [p for p in tmp_path.rglob("predictions.partial.jsonl")]
    tasks = [json.loads(line)["task"] for line in run.read_text().splitlines()]
    assert tasks == ["niah_single", "cwe", "niah_single", "cwe"]
    monkeypatch.undo()
    resumed = _outputs(_sweep(tmp_path, surrogate, presses=["kvzap_mlp"]))
    (name,) = resumed
    assert resumed[name] == batch_one[name]  # written in the samples' order, as a run never interrupted


def test_interleave_tasks_takes_each_task_in_turn():
    samples = [{"task": t, "id": f"{t}{i}"} for t, n in (("a", 3), ("b", 1), ("c", 2)) for i in range(n)]
    assert [s["id"] for s in interleave_tasks(samples)] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert interleave_tasks([]) == []


def test_shards_split_a_run_and_the_last_one_writes_its_results(tmp_path, surrogate, batch_one, monkeypatch):
    # Each share is answered by its own process in real use; here one after the other, with a pipeline that records
    # which samples each answers.
    asked = []
    original_forward = KVPressTextGenerationPipeline._forward

    def record(self, inputs, *args, **kwargs):
        asked.append(inputs["context_ids"].shape[1])
        return original_forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_forward", record)
    first = _sweep(tmp_path, surrogate, shard="0/3")
    assert [r["metrics"] for r in first] == [None, None] and len(asked) == 2 * 3  # 8 samples: shares of 3, 3, 2
    # config.json describes the run, not the process: every shard writes the same record.
    records = {p: p.read_bytes() for p in tmp_path.rglob("config.json")}
    assert len(records) == 2
    for text in records.values():
        record = json.loads(text)
        assert record["shards"] == 3 and record["sweep"]["shard"] is None
    partials = sorted(tmp_path.rglob("predictions.partial.jsonl"))
    assert [len(p.read_text().splitlines()) for p in partials] == [3, 3]
    # The first share holds samples of both tasks (shares are cut from the interleaved order).
    assert {json.loads(line)["task"] for line in partials[0].read_text().splitlines()} == {"niah_single", "cwe"}
    assert _sweep(tmp_path, surrogate, shard="2/3")[0]["metrics"] is None and len(asked) == 2 * 5
    last = _sweep(tmp_path, surrogate, shard="1/3")
    assert len(asked) == 2 * 8  # every sample answered once, by one shard
    assert _outputs(last) == batch_one  # the files of the run made in one process, under the same names
    assert {p: p.read_bytes() for p in tmp_path.rglob("config.json")} == records  # whichever shard wrote last
    assert not list(tmp_path.rglob("predictions.partial.jsonl")) and not list(tmp_path.rglob("*.tmp"))
    again = _sweep(tmp_path, surrogate, shard="0/3")  # finished runs are skipped by every shard
    assert all(r["skipped"] for r in again) and len(asked) == 2 * 8


@pytest.mark.parametrize("shard", ["3/3", "1", "-1/2", "a/b", "1/0"])
def test_a_bad_shard_is_refused_before_anything_runs(tmp_path, shard):
    with pytest.raises(ValueError, match="shard must be 'K/N' with 0 <= K < N"):
        load_config(output_dir=str(tmp_path), shard=shard, **SETTINGS)
    assert not any(tmp_path.iterdir())


def test_shard_on_the_command_line(tmp_path, surrogate, capsys, monkeypatch):
    from evaluation import runner

    monkeypatch.setattr(runner, "_load_model", lambda config: (tiny_model("llama"), char_tokenizer()))
    args = ["--output-dir", str(tmp_path), "--surrogate", surrogate, "--press", "kvzap_mlp", "--threshold", "0"]
    args += ["--tasks", "cwe", "--lengths", "400", "--n-samples", "2", "--max-new-tokens", "4"]
    args += ["--sliding-window-size", "8"]
    assert main([*args, "--shard", "1/2"]) == 0
    assert "this shard done; other shards unfinished" in capsys.readouterr().out
    assert main([*args, "--shard", "0/2"]) == 0
    out = capsys.readouterr().out
    assert "kvzap_mlp" in out and "unfinished" not in out
    (metrics,) = tmp_path.rglob("metrics.json")
    assert json.loads(metrics.read_text())["n_predictions"] == 2
    record = json.loads((metrics.parent / "config.json").read_text())
    assert record["shards"] == 2 and record["sweep"]["shard"] is None
