"""``benchmarks/run_gpu.sh`` and its correctness check, run on CPU, so that the first run on a GPU machine fails only
on what needs a GPU. (The first dry run found ``gpu_check`` asking a sliding-window layer of Gemma 3, which the
press leaves alone, for its kept counts.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_compares_every_family_on_cpu(monkeypatch, tmp_path):
    # The SmolLM2-sized model replaced by a tiny Llama (the comparison is the same code).
    monkeypatch.setattr(gpu_check, "load", lambda path, device, dtype: (tiny_model("llama").to(device), None))
    out = tmp_path / "check.json"
    gpu_check.main(["--device", "cpu", "--prefill", "300", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["model"] for r in rows] == [f"tiny {f}" for f in gpu_check.FAMILIES for _ in (1, 2)] + [
        "random SmolLM2-135M-sized Llama"
    ] * 2
    assert all(r["same_kept_counts"] and r["max_abs_logit_diff"] < 1e-3 for r in rows)
    assert all(0 < r["compression_ratio"] < 1 for r in rows)  # something was evicted in every comparison
    gemma = [r for r in rows if r["model"] == "tiny gemma3_text"]
    assert all(r["compact_layers"] == 1 for r in gemma)  # its sliding layer keeps transformers' class


def test_gpu_check_fails_when_the_storages_disagree(monkeypatch, tmp_path):
    def disagree(model, device, batch, prefill, *args, **kwargs):
        return {"batch": batch, "prefill": prefill, "compression_ratio": 0.5, "same_kept_counts": batch == 1}

    monkeypatch.setattr(gpu_check, "compare", lambda *a, **k: {**disagree(*a, **k), "max_abs_logit_diff": 0.0})
    monkeypatch.setattr(gpu_check, "load", lambda path, device, dtype: (tiny_model("llama"), None))
    with pytest.raises(SystemExit, match="compact and masked storage disagree on cpu"):
        gpu_check.main(["--device", "cpu", "--json", str(tmp_path / "check.json")])
    assert (tmp_path / "check.json").exists()  # the report is written first


def test_time_to_first_token_runs_on_token_ids_without_a_tokenizer(monkeypatch, tmp_path):
    """bench_ttft on a model with no tokenizer (run_gpu.sh's random model): no press against chunked and dense."""
    from benchmarks import bench_ttft

    monkeypatch.setattr(bench_ttft, "load", lambda path, device, dtype: (tiny_model("llama").to(device), None))
    out = tmp_path / "ttft.json"
    argv = ["--prefill", "96", "--modes", "none", "dense", "chunk:32", "plain:32", "--runs", "1", "--window", "8"]
    bench_ttft.main([*argv, "--threshold", "0.3", "--json", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["none"]["evicted_share"] == 0 and row["dense"]["ttft_s"] > 0
    assert row["plain:32"]["evicted_share"] == 0 and row["plain:32"]["ttft_s"] > 0
    assert 0 < row["chunk:32"]["evicted_share"] < 1 and 0 < row["dense"]["evicted_share"] < 1


def test_the_time_split_is_refused_off_the_cpu():
    from benchmarks import bench_ttft

    with pytest.raises(SystemExit):
        bench_ttft.main(["--device", "cuda", "--breakdown"])


@pytest.mark.slow
def test_run_gpu_script_dry_run_on_cpu(tmp_path):
    # Every step of the script at toy sizes (about 5 minutes on 2 cores).
    env = {**os.environ, "DEVICE": "cpu", "SMOKE": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh")], check=True, env=env, timeout=900)
    names = ["gpu_check", "decode_fp32", "decode_bf16", "memory", "decode_no_eviction", "ttft"]
    names += ["alternatives_fp32", "alternatives_bf16"]
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == sorted(names)
    check = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(r["same_kept_counts"] for r in check["results"])
    ttft = json.loads((tmp_path / "ttft.json").read_text())
    assert ttft["meta"]["device"] == "cpu" and [r["prefill_tokens"] for r in ttft["results"]] == [256, 512]
    assert all(0 < r["chunk:1024"]["evicted_share"] < 1 for r in ttft["results"])
    bf16 = json.loads((tmp_path / "alternatives_bf16.json").read_text())
    assert {r["method"] for r in bf16["results"]} == {"none", "static", "kvzap", "kvzap_kv8"}
