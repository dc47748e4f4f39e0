"""``benchmarks/bench_batch.py`` end to end on a tiny model, in a second or two.

The benchmark compares the speed of a left-padded batch with that of its prompts run one at a time: that is only
a fair comparison if both compute the same thing. With a per-pair scorer (a pair's score depends on that pair
only), each batched row must evict what it evicts alone and decode the same greedy tokens. Speedups pair each run
with the baseline of the same run, and the report's "Ragged batches" section appears only when the JSON does.
"""

from __future__ import annotations

import json

import torch

from benchmarks import bench_batch
from benchmarks.report import blocks
from kvzap import DMSThresholdPress
from kvzap.presses.baseline_scorers import KeyNormScorer
from tests.conftest import tiny_model

LENGTHS = ("40", "25", "33", "12")  # mixed, and the last row is barely longer than the window


def key_norm_press(args, mode: str) -> DMSThresholdPress:
    # Deterministic per pair, unlike the random scorer of the model-less benchmark: batched rows can match alone.
    return DMSThresholdPress(
        KeyNormScorer(), threshold=args.threshold, sliding_window_size=args.window, decoding=True, storage=mode
    )


def test_batch_benchmark_end_to_end(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_batch, "load", lambda path, device, dtype: (tiny_model("llama"), None))
    monkeypatch.setattr(bench_batch, "make_press", key_norm_press)
    out = tmp_path / "batch.json"
    argv = ["--lengths", *LENGTHS, "--decode", "6", "--runs", "2", "--threshold=-0.7", "--window", "8"]
    results = bench_batch.main([*argv, "--threads", str(torch.get_num_threads()), "--json", str(out)])
    rows = {r["way"]: r for r in results}
    assert list(rows) == list(bench_batch.WAYS)
    alone, none, kvzap = rows["one_at_a_time"], rows["batched_none"], rows["batched_kvzap"]

    # Same work batched and alone: every row's tokens, and the pooled evicted share (padding not counted).
    assert kvzap["same_tokens_as_one_at_a_time"] == len(LENGTHS)
    assert 0.1 < kvzap["evicted_share"] < 0.9
    assert abs(kvzap["evicted_share"] - alone["evicted_share"]) < 1e-6
    assert none["evicted_share"] == 0.0
    # (KV bytes are measured, but not compared: at a few dozen tokens the compact blocks' reserve dominates them.)
    for row in results:
        assert row["kv_bytes_after_prefill"] > 0 and row["kv_bytes_after_decode"] > 0
        assert row["runs"] == 2 and len(row["decode_tok_s_runs"]) == 2
        assert row["decode_tok_s"] > 0 and row["prefill_s"] > 0
    assert none["decode_vs_batched_none"] == 1.0 and alone["decode_vs_one_at_a_time"] == 1.0

    data = json.loads(out.read_text())
    assert data["meta"]["lengths"] == [int(n) for n in LENGTHS] and data["meta"]["decode_tokens"] == 6
    assert data["meta"]["full_kv_bytes"] < data["meta"]["full_kv_bytes_padded"]
    text = blocks(tmp_path)["batch"]
    assert "Raw: [batch.json](benchmarks/results/batch.json)" in text
    assert text.count("| one left-padded batch") == 2 and text.count("| kvzap (compact), one prompt") == 1
    assert "vs batched without a press: **" in text and "(goal >= 1.2x: " in text and "(goal >= 2.5x: " in text
    assert "equal those of the prompt decoded alone under the same press: 4 of 4." in text
    assert "batch" not in blocks(tmp_path / "elsewhere")


def test_speedups_pair_each_run_with_its_own_baseline():
    def runs(rates: list[float]) -> list[dict]:
        keys = ("prefill_s", "decode_s", "kv_bytes_after_prefill", "kv_bytes_after_decode", "evicted_share")
        return [{"decode_tok_s": r, "tokens": [[1, 2]], **dict.fromkeys(keys, 1.0)} for r in rates]

    # A noisy run slows every way alike: per-run ratios 1.2, 1.3, 1.0 (median 1.2); the ratio of the medians
    # (26 / 20 = 1.3) would mix different runs.
    results = bench_batch.summarize({"batched_none": runs([10, 20, 30]), "batched_kvzap": runs([12, 26, 30])})
    kvzap = results[1]
    assert kvzap["way"] == "batched_kvzap" and kvzap["decode_tok_s"] == 26
    assert abs(kvzap["decode_vs_batched_none"] - 1.2) < 1e-12
    assert "decode_vs_one_at_a_time" not in kvzap and "same_tokens_as_one_at_a_time" not in kvzap
