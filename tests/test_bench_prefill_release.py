"""``benchmarks/bench_prefill_release.py`` end to end on a tiny model: every mode timed, the JSON written, and the
library's heap-release setting restored afterwards."""

from __future__ import annotations

import argparse
import json

import torch

import kvzap.heap as heap
from benchmarks import bench_prefill_release as bench
from kvzap import KVzapScorer, RandomScorer
from tests.conftest import tiny_model


def test_prefill_release_benchmark_end_to_end(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "load", lambda path: (tiny_model("llama", hidden_size=256, intermediate_size=256), None))
    seen = []
    real = bench.set_heap_release
    monkeypatch.setattr(bench, "set_heap_release", lambda *a, **k: seen.append(k) or real(*a, **k))
    out = tmp_path / "prefill.json"
    argv = ["--prefill", "300", "--runs", "2", "--threads", str(torch.get_num_threads()), "--json", str(out)]
    results = bench.main(argv)
    (row,) = results
    assert set(row["runs_s"]) == set(bench.MODES)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in row["runs_s"].values())
    assert row["ratio_to_none"]["none"] == 1.0
    assert json.loads(out.read_text())["results"] == results
    # Every kvzap mode set its way, and the default came back after each.
    assert {"pages": False} in seen and {"min_bytes": None, "pages": False} in seen
    assert seen[-1] == {}
    assert heap._pages is True and heap._min_bytes == heap._DEFAULT_MIN_BYTES


def test_prefill_release_press_without_and_with_a_model():
    # Without --model the benchmark's random model has no trained surrogate, so random scores stand in (asking for
    # the bundled surrogate of a model named '' would fail); with --model, the KVzap-MLP (bundled or --surrogate).
    press = bench.make_press(argparse.Namespace(model=None, surrogate=None, threshold=0.44))
    assert isinstance(press.scorer, RandomScorer) and press.threshold == 0.44
    press = bench.make_press(argparse.Namespace(model="a/model", surrogate="a/surrogate", threshold=-3.4))
    assert isinstance(press.scorer, KVzapScorer) and press.scorer.surrogate == "a/surrogate"
    assert press.threshold == -3.4
