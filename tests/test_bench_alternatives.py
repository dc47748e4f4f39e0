"""benchmarks/bench_alternatives.py on a tiny model: one length, one run, the dynamic cache against quanto int4."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_alternatives
from tests.conftest import tiny_model


def test_the_benchmark_writes_every_figure(tmp_path):
    pytest.importorskip("optimum.quanto")
    # Head size 64 (SmolLM2's): quanto's groups of 64 then always fill the flattened (head, token, channel) axis.
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "alternatives.json"
    argv = ["--prefill", "300", "--runs", "1", "--decode", "3", "--threads", "1", "--methods", "none", "quanto_int4"]
    bench_alternatives.main([*argv, "--json", str(path)], model=model)
    data = json.loads(path.read_text())
    m = data["meta"]
    assert m["methods"] == ["none", "quanto_int4"] and m["decode_tokens"] == 3 and m["runs"] == 1
    assert {"command", "commit", "date", "machine", "torch", "transformers"} <= set(m)
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"none", "quanto_int4"} and all(r["prefill_tokens"] == 300 for r in rows.values())
    for row in rows.values():
        assert "error" not in row and "skipped" not in row
        assert row["kv_bytes_after_prefill"] > 0 and row["kv_bytes_after_decode"] > 0
        assert row["prefill_s"] > 0 and row["decode_ms_per_token"] > 0
        assert len(row["prefill_s_runs"]) == 1 and len(row["decode_ms_per_token_ratio_runs"]) == 1
    none, quanto = rows["none"], rows["quanto_int4"]
    # The dynamic cache holds exactly the fp32 prompt (then the decoded tokens too), measured from outside.
    assert none["kv_bytes_after_prefill"] == none["full_kv_bytes"]
    assert none["kv_bytes_after_decode"] == none["full_kv_bytes_after_decode"]
    assert none["decode_ms_per_token_ratio"] == 1.0 and none["prefill_s_ratio"] == 1.0
    # int4 with fp32 scales: about 1/6 of the fp32 cache (a few decoded tokens wait in full precision).
    assert quanto["kv_bytes_after_prefill"] < 0.2 * none["kv_bytes_after_prefill"]
    assert quanto["kv_bytes_after_decode"] < 0.25 * none["kv_bytes_after_decode"]


def test_a_failing_method_is_recorded_and_the_others_go_on(monkeypatch, tmp_path):
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    real = bench_alternatives.make_cache

    def broken(model, method, max_len):
        if method == "static":
            raise RuntimeError("no static cache here")
        return real(model, method, max_len)

    monkeypatch.setattr(bench_alternatives, "make_cache", broken)
    argv = ["--prefill", "200", "--runs", "2", "--decode", "2", "--threads", "1", "--methods", "none", "static"]
    results = {r["method"]: r for r in bench_alternatives.main(argv, model=model)["results"]}
    assert results["static"]["error"].startswith("RuntimeError: no static cache here")
    assert len(results["none"]["prefill_s_runs"]) == 2


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_alternatives.main(["--runs", "0"], model=tiny_model("llama"))
    with pytest.raises(SystemExit):
        bench_alternatives.main(["--methods", "none", "none"], model=tiny_model("llama"))


def test_the_table_and_the_plot_read_the_benchmark_and_the_needle_runs(tmp_path):
    """A checkout in miniature: the benchmark's results file and a needle sweep of the same methods at the same
    length; the table prints each method's bytes, times and score with its paired difference to the full cache,
    and the plot is written."""
    pytest.importorskip("optimum.quanto")
    from benchmarks.plot_alternatives import plot
    from benchmarks.report_alternatives import accuracy_points, alternatives_block
    from benchmarks.report_common import Results
    from evaluation.runner import load_config, run_evaluation
    from tests.conftest import char_tokenizer

    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    results = tmp_path / "benchmarks" / "results"
    argv = ["--prefill", "300", "--runs", "1", "--decode", "2", "--threads", "1", "--methods", "none", "quanto_int4"]
    bench_alternatives.main([*argv, "--json", str(results / "alternatives.json")], model=model)
    config = load_config(
        output_dir=str(tmp_path / "evaluation" / "results" / "alternatives-test"),
        presses=["no_press", "quanto_int4"],
        tasks=["niah_single"],
        lengths=[300],
        n_samples=2,
        max_new_tokens=4,
    )
    run_evaluation(config, model, char_tokenizer())
    points = accuracy_points(tmp_path)
    assert set(points) == {("none", 300), ("quanto_int4", 300)}
    assert points[("none", 300)]["difference"] is None and points[("quanto_int4", 300)]["n"] == 2
    assert points[("quanto_int4", 300)]["interval"] is not None
    lines = alternatives_block(Results(results))
    rows = [line for line in lines if line.startswith("| no press") or line.startswith("| quantized cache")]
    assert len(rows) == 2 and "quanto int4" in rows[1] and "(n=2)" in rows[1] and "; " in rows[1]
    assert "needles 0k" not in lines[2] and "decode speed / no press, 0k" not in lines[2]
    assert "alternatives-test" in lines[-1]
    out = plot(results, tmp_path / "alternatives.png")
    assert out.stat().st_size > 1000
