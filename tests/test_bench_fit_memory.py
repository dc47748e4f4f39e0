"""``benchmarks/bench_fit_memory.py``: its synthetic collection is one ``train`` reads, and its outside measure sees
a known allocation of a child process."""

from __future__ import annotations

import sys

from benchmarks.bench_fit_memory import SHAPES, sample_peak, write_synthetic_collection
from train.collect import load_collections


def test_synthetic_collection_has_the_model_shapes(tmp_path):
    write_synthetic_collection(tmp_path, train_rows=900, test_rows=300, rows_per_shard=400)
    X, y, (manifest,) = load_collections([tmp_path / "train"])
    assert X.shape == (900, SHAPES["n_layers"], SHAPES["hidden_size"]) and X.dtype.itemsize == 2
    assert y.shape == (900, SHAPES["n_layers"], SHAPES["kv_heads"])
    assert len(manifest["shards"]) == 3 and manifest["n_prompts"] == 2
    assert load_collections([tmp_path / "test"])[0].shape[0] == 300


def test_sample_peak_sees_a_child_allocation():
    code = "import time; block = bytearray(300 << 20); time.sleep(1.0)"  # 300 MiB, written (zeroed) by bytearray
    peak = sample_peak([sys.executable, "-c", code])
    assert 300 <= peak["anon_mib"] < 400 and peak["seconds"] >= 1.0
