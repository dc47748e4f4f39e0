"""``benchmarks/report.py``: the sections BENCHMARKS.md takes from the JSON of the benchmark scripts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from benchmarks.common import sweep
from benchmarks.report import blocks


def _block(tmp_path, name: str) -> list[str]:
    return blocks(tmp_path)[name].splitlines()


def test_the_report_judges_the_peak_rss(tmp_path):
    """``benchmarks/report.py`` compares kvzap with no press against the goal (0.8 x evicted x full KV)."""

    def entry(runs, evicted=0.6):
        return {"runs_mb": runs, "median_mb": sorted(runs)[len(runs) // 2], "evicted_share": [evicted] * len(runs)}

    meta = {"num_layers": 30, "threshold": -3.4, "decode_tokens": 64, "rss_prompt": 8192, "rss_decode": 256}
    meta["rss_full_bytes"] = 400 * 2**20  # goal: 0.8 x 0.6 x 400 = 192 MB lower
    memory = {
        "meta": meta,
        "results": [],
        "peak_rss": {"none": entry([1700, 1680, 1500]), "compact": entry([1300, 1250, 1280])},
    }
    (tmp_path / "memory.json").write_text(json.dumps(memory))
    rss = _block(tmp_path, "memory-rss")
    assert "| no press | 60.0% | **1680** | 1700, 1680, 1500 |" in rss
    assert "| kvzap compact | 60.0% | **1280** | 1300, 1250, 1280 |" in rss
    assert rss[-1].startswith("kvzap peaks **400 MB lower** (goal: lower by >= 0.8 x evicted x full KV")
    assert rss[-1].endswith("= 192 MB: met).")


def test_the_first_token_table_prints_each_runs_ratio_and_the_breakdown(tmp_path):
    def mode(ttft, ratios, evicted=0.7):
        return {
            "ttft_s": ttft,
            "ttft_s_runs": [ttft] * 3,
            "ratio_to_none": sorted(ratios)[1],
            "ratio_runs": ratios,
            "evicted_share": evicted,
        }

    part = {
        "weights_s": 1.0,
        "attention_s": 0.5,
        "scoring_s": 0.02,
        "bookkeeping_s": 0.1,
        "python_and_other_ops_s": 0.2,
        "wall_s": 1.82,
    }
    row = {
        "prefill_tokens": 8192,
        "none": mode(20.0, [1.0, 1.0, 1.0], 0.0),
        "dense": mode(20.4, [1.01, 1.02, 1.05]),
        "chunk:1024": mode(14.0, [0.69, 0.70, 0.72]),
        "breakdown": {
            "none": {"prefill_chunk": {**part, "tokens": 8192}, "decode_step": part},
            "chunk:1024": {"prefill_chunk": {**part, "tokens": 1024}, "decode_step": part},
        },
    }
    (tmp_path / "ttft.json").write_text(json.dumps({"meta": {"runs": 3}, "results": [row]}))
    lines = _block(tmp_path, "ttft")
    assert "| 8192 | no press | 20.00 |  |  |" in lines
    assert "| 8192 | kvzap, chunks of 1024 | 14.00 | **0.70x** (0.69, 0.70, 0.72) | 70% |" in lines
    assert "| 8192 | kvzap, one forward | 20.40 | **1.02x** (1.01, 1.02, 1.05) | 70% |" in lines
    breakdown = _block(tmp_path, "ttft-breakdown")
    assert (
        "| 8192 | last prefill chunk (1024 tokens) | kvzap, chunks of 1024 | 1820 | 1000 | 500 | 20 | 100 | 200 |"
        in breakdown
    )
    assert "| 8192 | a decoding step | no press | 1820.0 | 1000.0 | 500.0 | 20.0 | 100.0 | 200.0 |" in breakdown
    # Gemma 3's file joins the same table, its rows naming the model; chunking alone (no press) shows no eviction.
    row = {"prefill_tokens": 32768, "none": mode(300.0, [1.0] * 3, 0.0), "plain:1024": mode(100.0, [0.33] * 3, 0.0)}
    (tmp_path / "gemma_ttft.json").write_text(json.dumps({"meta": {"runs": 3}, "results": [row]}))
    both = _block(tmp_path, "ttft")
    assert "[ttft.json]" in both[0] and "[gemma_ttft.json]" in both[0]
    assert "| 32768, Gemma 3 270M | no press, chunks of 1024 | 100.00 | **0.33x** (0.33, 0.33, 0.33) |  |" in both
    gemma_baseline = "| 32768, Gemma 3 270M | no press | 300.00 |  |  |"
    assert both.index("| 8192 | no press | 20.00 |  |  |") < both.index(gemma_baseline)
    # One forward timed again alone: its rows and profiled run join both tables, and the glance quotes it.
    quiet = {
        "prefill_tokens": 8192,
        "none": mode(30.0, [1.0] * 3, 0.0),
        "dense": mode(28.5, [0.93, 0.95, 1.04]),
        "breakdown": {
            "none": {"prefill_chunk": {**part, "tokens": 8192}, "decode_step": part},
            "dense": {"prefill_chunk": {**part, "tokens": 8192}, "decode_step": part},
        },
    }
    (tmp_path / "ttft_one_forward.json").write_text(json.dumps({"meta": {"runs": 3}, "results": [quiet]}))
    three = _block(tmp_path, "ttft")
    assert "[ttft_one_forward.json]" in three[0]
    quiet_row = "| 8192, quiet host | kvzap, one forward | 28.50 | **0.95x** (0.93, 0.95, 1.04) | 70% |"
    assert three.index("| 8192 | no press | 20.00 |  |  |") < three.index(quiet_row) < three.index(gemma_baseline)
    breakdown = _block(tmp_path, "ttft-breakdown")
    assert "[ttft_one_forward.json]" in breakdown[0]
    quiet_chunk = "| 8192, quiet host | last prefill chunk (8192 tokens) | kvzap, one forward | 1820 | 1000 | 500 |"
    assert f"{quiet_chunk} 20 | 100 | 200 |" in breakdown
    assert not [line for line in breakdown if line.startswith("| 8192, quiet host | a decoding step")]
    glance = "\n".join(_block(tmp_path, "glance"))
    assert "one dense forward, the default, **0.95x** on a quiet host (1.02x on a shared one)" in glance


def test_the_second_model_section_reads_every_gemma_run_and_judges_the_collection(tmp_path):
    def row(n, none_prefill_mb, none_mb, kvzap_mb, none_tok, kvzap_tok):
        return {
            "prefill_tokens": n,
            "none_kv_bytes_after_prefill": none_prefill_mb * 2**20,
            "none_kv_bytes_after_decode": none_mb * 2**20,
            "compact_kv_bytes_after_prefill": kvzap_mb * 2**20,
            "compact_kv_bytes_after_decode": kvzap_mb * 2**20,
            "compact_evicted_share": 0.7,
            "none_decode_tok_s": none_tok,
            "compact_decode_tok_s": kvzap_tok,
            "none_prefill_s": 40.0,
            "compact_prefill_s": 41.0,
        }

    meta = {"model": "/x/gemma-3-270m", "dtype": "float32", "threads": 2, "threshold": -1.5, "window": 128}
    meta["decode_tokens"] = 64
    (tmp_path / "gemma_decode.json").write_text(
        json.dumps({"meta": {**meta, "runs": 3}, "results": [row(16384, 576, 111, 45, 7.0, 9.1)]})
    )
    (tmp_path / "gemma_decode_32k.json").write_text(
        json.dumps({"meta": {**meta, "runs": 1}, "results": [row(8192, 288, 64, 32, 8.0, 8.0)]})
    )
    seconds = {"plain_sdpa_last_logits": 4.0, "plain_sdpa_all_logits": 9.0, "kvzip_plus_collection": 6.4}
    collect = {"meta": {"repeat_tokens": 2415, "runs": 3, "scored_layers": [5, 11, 17]}, "seconds": seconds}
    (tmp_path / "gemma_collect.json").write_text(json.dumps(collect))
    lines = _block(tmp_path, "gemma-decode")
    rows = [line for line in lines if line.startswith("| 8192 |") or line.startswith("| 16384 |")]
    assert [r.split(" | ")[0] for r in rows] == ["| 8192", "| 16384"]  # sorted by context, from both files
    assert "| 64.0, 32.0 (**0.50**) |" in rows[0] and "**1.00x**" in rows[0] and rows[0].startswith("| 8192 | 1 |")
    assert "| 576.0, 45.0 |" in rows[1] and "**1.30x**" in rows[1]
    collection = _block(tmp_path, "gemma-collect")
    assert "One 2415-token repeat prompt, layers 5, 11, 17 scored, median of 3 runs." in collection
    assert "| kvzip_plus_collection | 6.40 | 1.60x |" in collection
    assert collection[-1] == "Goal: the collection <= 1.5x the plain forward: not met."


def test_the_decode_sweep_keeps_each_runs_ratio_and_the_report_uses_their_median(tmp_path):
    """Machine noise that drifts across runs moves both modes of a run alike: the median of each run's ratio sees
    through it where the ratio of the medians does not (here 2.0x against 1.5x)."""
    config = SimpleNamespace(vocab_size=100, num_hidden_layers=2, num_key_value_heads=1, head_dim=4)
    model = SimpleNamespace(config=config, dtype=torch.float32)
    speed = {"none": iter([10.0, 4.0, 2.0]), "compact": iter([20.0, 8.0, 4.0])}  # the machine slows down run by run

    def one_run(model, mode, prompt, args):
        rate = next(speed[mode])
        return {"prefill_s": 1.0 / rate, "decode_tok_s": rate, "evicted_share": 0.5 if mode == "compact" else 0.0}

    args = SimpleNamespace(prefill=[16], runs=3, peak_memory=None)
    (row,) = sweep(model, None, args, ["none", "compact"], one_run)
    assert row["compact_decode_tok_s_runs"] == [20.0, 8.0, 4.0]
    assert row["compact_decode_tok_s_ratio_runs"] == [2.0, 2.0, 2.0]
    assert row["compact_decode_tok_s_ratio"] == 2.0 and row["compact_prefill_s_ratio"] == 0.5
    assert row["compact_decode_tok_s"] / row["none_decode_tok_s"] == 2.0  # medians 8 / 4: here the same
    # The report reads the paired ratios when the file has them.
    row["compact_decode_tok_s"] = 12.0  # a ratio of medians (3.0x) the report must not print
    row.update(compact_evicted_share=0.5, compact_kv_bytes_after_prefill=1, masked_kv_bytes_after_prefill=1)
    row["full_kv_bytes"] = 2
    meta = {"model": "m", "dtype": "float32", "threads": 2, "threshold": -3.4, "window": 128}
    meta.update(decoding_pruning=True, decode_tokens=64, runs=3, torch="2", transformers="5")
    (tmp_path / "decode.json").write_text(json.dumps({"meta": meta, "results": [row]}))
    (line,) = [line for line in _block(tmp_path, "decode") if line.startswith("| 16 |")]
    assert "| **2.00x** (2.00, 2.00, 2.00) |" in line
