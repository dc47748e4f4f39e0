"""Intervals in the summary table, the CSV and the plot's error bars; the comparison with the full cache."""

import csv
import json

import pytest

from evaluation.intervals import run_intervals
from evaluation.plots import (
    collect_results,
    compare_to_full_cache,
    highest_compression_inside,
    paired_vs_full_cache,
    summarize,
)


def _write(root, name, press, score, ci, compression=0.0, value=None, knob="threshold"):
    run = root / name
    run.mkdir(parents=True)
    metrics = {
        "model": "m",
        "dataset": "ruler_offline",
        "length": 2048,
        "press": press,
        "knob": None if press == "no_press" else knob,
        "value": value,
        "score": score,
        "score_ci": ci,
        "tasks": {"t": score},
        "tasks_ci": {"t": ci},
        "compression_ratio": compression,
    }
    (run / "metrics.json").write_text(json.dumps(metrics), encoding="utf-8")


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "runs"
    _write(root, "full", "no_press", 50.0, [40.0, 60.0])
    _write(root, "a", "kvzap_mlp", 52.0, [42.0, 62.0], 0.4, -6.0)
    _write(root, "b", "kvzap_mlp", 41.0, [31.0, 51.0], 0.6, -5.0)
    _write(root, "c", "kvzap_mlp", 35.0, [25.0, 45.0], 0.7, -4.0)
    _write(root, "d", "kvzap_mlp", 20.0, [12.0, 30.0], 0.85, -3.0)
    _write(root, "e", "kvzip_plus_threshold", 30.0, [21.0, 39.5], 0.5, -5.0)
    _write(root, "f", "kvzip_plus_threshold", 45.0, [35.0, 55.0], 0.8, -3.0)
    return root


def test_comparison_with_the_full_cache(sweep):
    results = collect_results(sweep)
    full = next(r for r in results if r["press"] == "no_press")
    verdicts = {(r["press"], r["compression_ratio"]): compare_to_full_cache(r, full) for r in results}
    assert verdicts == {
        ("kvzap_mlp", 0.4): "inside",
        ("kvzap_mlp", 0.6): "inside",
        ("kvzap_mlp", 0.7): "below, intervals overlap",
        ("kvzap_mlp", 0.85): "below, intervals disjoint",
        ("kvzip_plus_threshold", 0.5): "below, intervals disjoint",
        ("kvzip_plus_threshold", 0.8): "inside",
        ("no_press", 0.0): "",
    }
    # "Stays inside" up to a compression: every run at or below it is inside (kvzip_plus fails at its first).
    (panel,) = highest_compression_inside(results).items()
    assert panel[0] == ("m", "ruler_offline", 2048)
    assert panel[1]["kvzap_mlp"]["compression_ratio"] == 0.6 and panel[1]["kvzip_plus_threshold"] is None


def test_table_csv_and_error_bars(sweep, tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    bars = []
    original = Axes.errorbar

    def spy(self, x, y, yerr=None, **kwargs):
        bars.append((kwargs.get("label"), list(x), list(y), yerr))
        return original(self, x, y, yerr=yerr, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", spy)
    paths = summarize(sweep, tmp_path / "out")
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mlp = next(b for b in bars if b[0] == "kvzap_mlp")
    assert mlp[1] == [0.4, 0.6, 0.7, 0.85] and mlp[3] == [[10.0, 10.0, 10.0, 8.0], [10.0, 10.0, 10.0, 10.0]]

    table = paths["table"].read_text()
    assert (
        "| m | ruler_offline | 2048 | no_press | - | - | 0.000 | 50.00 [40.0, 60.0] |  |  | 50.0 [40.0, 60.0] |"
        in table
    )
    # No predictions.csv in these runs: no paired difference.
    assert "| kvzap_mlp | tau=-3 | - | 0.850 | 20.00 [12.0, 30.0] | below, intervals disjoint |  |" in table
    assert "- m, ruler_offline, 2048 tokens: kvzap_mlp 0.600 (tau=-5), kvzip_plus_threshold none" in table

    with paths["csv"].open(newline="") as handle:
        rows = {(r["press"], r["value"]): r for r in csv.DictReader(handle)}
    row = rows[("kvzap_mlp", "-4.0")]
    assert (row["score"], row["score_low"], row["score_high"]) == ("35.0", "25.0", "45.0")
    assert (row["t_low"], row["t_high"], row["vs_full_cache"]) == ("25.0", "45.0", "below, intervals overlap")


def _write_predictions(run, scores, compression):
    with (run / "predictions.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "id", "prediction", "answers", "score", "compression_ratio", "n_tokens"])
        for i, score in enumerate(scores):
            writer.writerow(["t", i, "x", "[]", score, compression, 100])


def test_the_paired_difference_from_the_full_cache(sweep, tmp_path):
    """With per-sample predictions, each run gets its paired difference from the full cache in the table and CSV."""
    full = [100.0] * 25 + [0.0] * 15
    _write_predictions(sweep / "full", full, 0.0)
    _write_predictions(sweep / "b", [0.0] * 6 + full[6:], 0.6)  # loses 6 of the full cache's 25 needles: -15
    _write_predictions(sweep / "a", full, 0.4)  # the same answers: 0, nothing to resolve
    results = collect_results(sweep)
    runs = {(r["press"], r["value"]): r for r in results}
    full_run = runs[("no_press", None)]
    paired = paired_vs_full_cache(runs[("kvzap_mlp", -5.0)], full_run)
    assert paired["difference"] == pytest.approx(-15.0) and paired["n"] == 40 and paired["interval"][1] < 0
    assert paired_vs_full_cache(full_run, full_run) is None
    assert paired_vs_full_cache(runs[("kvzap_mlp", -4.0)], full_run) is None  # run c has no predictions

    paths = summarize(sweep, tmp_path / "out")
    table = paths["table"].read_text()
    low, high = paired["interval"]
    assert f"| -15.0 [{low:+.1f}, {high:+.1f}] loss |" in table
    assert "| +0.0 [+0.0, +0.0] not resolved |" in table
    with paths["csv"].open(newline="") as handle:
        rows = {(r["press"], r["value"]): r for r in csv.DictReader(handle)}
    assert float(rows[("kvzap_mlp", "-5.0")]["paired_difference"]) == pytest.approx(-15.0)
    assert rows[("kvzap_mlp", "-4.0")]["paired_difference"] == ""


def test_runs_without_intervals_get_them_from_their_predictions(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    metrics = {"model": "m", "press": "no_press", "knob": None, "value": None, "length": 2048, "score": 45.0}
    metrics.update(tasks={"a": 70.0, "b": 20.0}, compression_ratio=0.0)
    (run / "metrics.json").write_text(json.dumps(metrics), encoding="utf-8")
    scores = {"a": [100.0] * 7 + [0.0] * 3, "b": [50.0, 0.0, 0.0, 0.0, 50.0, 0.0, 0.0, 0.0, 0.0, 100.0]}
    with (run / "predictions.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "id", "prediction", "answers", "score", "compression_ratio", "n_tokens"])
        for task, values in scores.items():
            ratio = {"a": 0.5, "b": 0.75}[task]
            writer.writerows([task, i, "", "[]", v, ratio + 0.01 * (i % 2), 10] for i, v in enumerate(values))
    (result,) = collect_results(tmp_path)
    expected = run_intervals(scores)
    assert result["score_ci"] == expected["score_ci"] and result["tasks_ci"] == expected["tasks_ci"]
    assert result["ci_method"] == {"a": "wilson", "b": "bootstrap"}
    # Each task's own compression ratio, from the same predictions (runs written before metrics.json had it).
    assert result["tasks_compression_ratio"] == pytest.approx({"a": 0.505, "b": 0.755})
    with summarize(tmp_path, tmp_path / "csv")["csv"].open(newline="") as handle:
        (row,) = csv.DictReader(handle)
    assert (float(row["a_compression_ratio"]), float(row["b_compression_ratio"])) == pytest.approx((0.505, 0.755))
    # Without predictions either: no interval, and the table shows the score alone.
    (run / "predictions.csv").unlink()
    (result,) = collect_results(tmp_path)
    assert result["score_ci"] is None
    assert "| 45.00 |" in summarize(tmp_path, tmp_path / "out")["table"].read_text()


def test_a_press_with_another_surrogate_is_a_series_of_its_own(sweep, tmp_path, monkeypatch):
    # The same press and threshold with a retrained surrogate (``--surrogate``): its own line, row and verdict,
    # never merged with the default surrogate's runs. One run records the surrogate in metrics.json, the other
    # (written before metrics.json had it) only in its config.json.
    from matplotlib.axes import Axes

    _write(sweep, "g", "kvzap_mlp", 48.0, [38.0, 58.0], 0.85, -3.0)
    metrics = json.loads((sweep / "g" / "metrics.json").read_text())
    (sweep / "g" / "metrics.json").write_text(json.dumps({**metrics, "surrogate": "train/results/run300/mlp"}))
    _write(sweep, "h", "kvzap_mlp", 55.0, [45.0, 65.0], 0.6, -5.0)
    (sweep / "h" / "config.json").write_text(json.dumps({"surrogate": "train/results/run300/mlp/"}))
    series = "kvzap_mlp (run300/mlp)"

    results = collect_results(sweep)
    assert [r["compression_ratio"] for r in results if r["press"] == "kvzap_mlp" and r["surrogate"]] == [0.6, 0.85]
    (panel,) = highest_compression_inside(results).values()
    assert panel["kvzap_mlp"]["compression_ratio"] == 0.6 and panel[series]["compression_ratio"] == 0.85

    bars = []
    original = Axes.errorbar
    monkeypatch.setattr(
        Axes, "errorbar", lambda self, x, y, **kw: bars.append((kw.get("label"), list(x))) or original(self, x, y, **kw)
    )
    paths = summarize(sweep, tmp_path / "out")
    assert dict(bars)["kvzap_mlp"] == [0.4, 0.6, 0.7, 0.85] and dict(bars)[series] == [0.6, 0.85]
    table = paths["table"].read_text()
    assert f"| {series} | tau=-3 | - | 0.850 | 48.00 [38.0, 58.0] | inside |" in table
    assert f"{series} 0.850 (tau=-3)" in table
    with paths["csv"].open(newline="") as handle:
        surrogates = {r["surrogate"] for r in csv.DictReader(handle) if r["press"] == "kvzap_mlp"}
    assert surrogates == {"", "train/results/run300/mlp", "train/results/run300/mlp/"}


def test_per_task_plot_puts_each_task_at_its_own_compression(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    root = tmp_path / "runs"
    _write(root, "full", "no_press", 50.0, [40.0, 60.0])
    for name, value, ratio in (("a", -3.0, 0.7), ("b", -2.0, 0.8)):
        _write(root, name, "kvzap_mlp", 40.0, [30.0, 50.0], ratio, value)
        metrics = json.loads((root / name / "metrics.json").read_text())
        metrics["tasks_compression_ratio"] = {"t": round(ratio + 0.05, 2)}  # the task evicts more than the mean
        (root / name / "metrics.json").write_text(json.dumps(metrics))
    _write(root, "old", "kvzip_plus_threshold", 45.0, [35.0, 55.0], 0.75, -3.0)  # no per-task ratio: left out
    bars, lines = [], []
    original_bar, original_line = Axes.errorbar, Axes.axhline
    monkeypatch.setattr(
        Axes,
        "errorbar",
        lambda self, x, y, **kw: bars.append((kw.get("label"), list(x))) or original_bar(self, x, y, **kw),
    )
    monkeypatch.setattr(Axes, "axhline", lambda self, y, **kw: lines.append(y) or original_line(self, y, **kw))
    paths = summarize(root, tmp_path / "out")
    assert paths["tasks_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The run-level plot draws kvzap_mlp at 0.7 and 0.8 and the oracle; the per-task plot at 0.75 and 0.85 only.
    assert bars == [("kvzap_mlp", [0.7, 0.8]), ("kvzip_plus_threshold", [0.75]), ("kvzap_mlp", [0.75, 0.85])]
    assert lines == [50.0, 50.0]  # the full cache in both plots


def test_runs_of_one_setting_with_different_weights_are_kept_apart(tmp_path):
    # The bundled default before and after a new bundled surrogate: the same press, surrogate None, different
    # weights. Older runs have no fingerprint ("unrecorded"); a lone setting gets no label at all.
    root = tmp_path / "runs"
    _write(root, "full", "no_press", 50.0, [40.0, 60.0])
    _write(root, "old", "kvzap_mlp", 30.0, [20.0, 40.0], 0.83, -2.0)
    _write(root, "new", "kvzap_mlp", 48.0, [38.0, 58.0], 0.83, -2.0)
    metrics = json.loads((root / "new" / "metrics.json").read_text())
    (root / "new" / "metrics.json").write_text(
        json.dumps({**metrics, "surrogate": "a/mlp", "surrogate_weights": "0123456789abcdef"})
    )
    (root / "old" / "config.json").write_text(json.dumps({"surrogate": "a/mlp"}))  # the same directory, retrained
    _write(root, "oracle", "kvzip_plus_threshold", 45.0, [35.0, 55.0], 0.8, -3.0)
    results = collect_results(root)
    assert {r["run_dir"].rsplit("/", 1)[1]: r.get("weights_label") for r in results} == {
        "full": None,
        "old": "unrecorded",
        "new": "01234567",
        "oracle": None,
    }
    (panel,) = highest_compression_inside(results).values()
    assert panel["kvzap_mlp (a/mlp) @01234567"]["score"] == 48.0 and panel["kvzap_mlp (a/mlp) @unrecorded"] is None
    table = summarize(root, tmp_path / "out")["table"].read_text()
    assert "| kvzap_mlp (a/mlp) @unrecorded | tau=-2 |" in table and "| kvzap_mlp (a/mlp) @01234567 |" in table


def _write_weighted(root, name, press, model, surrogate, weights, ratio):
    """A tau -3 run of ``press`` on ``model`` that read ``surrogate`` (None: the default), fingerprint ``weights``."""
    _write(root, name, press, 40.0, [30.0, 50.0], ratio, -3.0)
    metrics = json.loads((root / name / "metrics.json").read_text())
    metrics.update(model=model, surrogate=surrogate, surrogate_weights=weights)
    (root / name / "metrics.json").write_text(json.dumps(metrics))


def test_a_line_is_named_by_the_weights_its_runs_read(tmp_path):
    # The surrogate bundled now is the press's plain line however it was named (the default, or --surrogate
    # pointing at a copy of it); the default read when other weights were bundled is "earlier bundled".
    from evaluation.presses import bundled_weights

    model = "SmolLM2-135M-Instruct"
    bundled = bundled_weights(model, "kvzap_mlp")
    assert bundled is not None and bundled_weights(model, "no_press") is None
    root = tmp_path / "runs"
    runs = {
        "default_now": (None, bundled, 0.6),
        "copy_now": ("train/results/x/mlp", bundled, 0.8),
        "default_then": (None, "fedcba9876543210", 0.7),
        "other": ("train/results/y/mlp", "0011223344556677", 0.75),
    }
    for name, (surrogate, weights, ratio) in runs.items():
        _write_weighted(root, name, "kvzap_mlp", model, surrogate, weights, ratio)
    series = {r["run_dir"].rsplit("/", 1)[1]: r["series"] for r in collect_results(root)}
    assert series == {
        "default_now": "kvzap_mlp",
        "copy_now": "kvzap_mlp",
        "default_then": "kvzap_mlp (earlier bundled)",
        "other": "kvzap_mlp (y/mlp)",
    }


def test_runs_of_the_same_weights_share_one_line(tmp_path):
    # A surrogate bundled once and replaced since: the runs that read it as the default and the runs that named
    # its directory are one line, named after the directory; other weights read as the default stay apart.
    model = "SmolLM2-135M-Instruct"
    root = tmp_path / "runs"
    runs = {
        "default_then": (None, "fedcba9876543210", 0.6),
        "named_then": ("train/results/z/mlp", "fedcba9876543210", 0.8),
        "named_copy": ("train/results/a/mlp", "fedcba9876543210", 0.85),
        "default_before": (None, "0123456789abcdef", 0.7),
        "other_press": (None, "fedcba9876543210", 0.5),
    }
    for name, (surrogate, weights, ratio) in runs.items():
        press = "kvzap_linear" if name == "other_press" else "kvzap_mlp"
        _write_weighted(root, name, press, model, surrogate, weights, ratio)
    results = collect_results(root)
    series = {r["run_dir"].rsplit("/", 1)[1]: r["series"] for r in results}
    assert series == {
        "default_then": "kvzap_mlp (a/mlp)",
        "named_then": "kvzap_mlp (a/mlp)",
        "named_copy": "kvzap_mlp (a/mlp)",
        "default_before": "kvzap_mlp (earlier bundled)",
        "other_press": "kvzap_linear (earlier bundled)",
    }
    # One set of weights per line: no run needs its fingerprint to tell it apart.
    assert all(r.get("weights_label") is None for r in results)


def _write_seed_run(root, name, press, seed, scores, compression, value=None, samples_of=None, **config):
    """A finished run as the runner writes it: config.json (its seed), samples.json (one content hash per sample,
    drawn from ``samples_of`` or the seed), predictions.csv (``scores``: task -> per-sample scores) and
    metrics.json (those scores' means)."""
    run = root / name
    run.mkdir(parents=True)
    knob = None if press == "no_press" else "threshold"
    settings = {"model": "m", "dataset": "ruler_offline", "source": None, "press": press, "knob": knob}
    settings.update(value=value, length=2048, tasks=sorted(scores), seed=seed, haystack="h", n_samples=40)
    settings.update(sweep={"seed": seed, "output_dir": str(root)}, **config)
    (run / "config.json").write_text(json.dumps(settings))
    content = seed if samples_of is None else samples_of
    ids = {f"{t}/{i}": f"{t}-{i}-seed{content}" for t, values in scores.items() for i in range(len(values))}
    (run / "samples.json").write_text(json.dumps(ids))
    with (run / "predictions.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "id", "prediction", "answers", "score", "compression_ratio", "n_tokens"])
        for task, values in scores.items():
            for i, score in enumerate(values):
                writer.writerow([task, i, "x", "[]", score, compression[task], 100])
    tasks = {t: sum(v) / len(v) for t, v in scores.items()}
    metrics = {"model": "m", "dataset": "ruler_offline", "length": 2048, "press": press, "knob": knob}
    metrics.update(value=value, score=sum(tasks.values()) / len(tasks), tasks=tasks)
    n = sum(len(v) for v in scores.values())
    metrics["compression_ratio"] = sum(compression[t] * len(v) for t, v in scores.items()) / n
    metrics.update(run_intervals(scores))
    (run / "metrics.json").write_text(json.dumps(metrics))
    return run


@pytest.fixture
def seeds(tmp_path):
    """The full cache and KVzap at tau -3 on two seeds' samples; a third seed for KVzap only."""
    root = tmp_path / "runs"
    full = {0: ([100.0] * 30 + [0.0] * 10, [100.0] * 10 + [0.0] * 10), 1: ([100.0] * 20 + [0.0] * 20, [100.0] * 20)}
    press = {0: ([100.0] * 25 + [0.0] * 15, [100.0] * 8 + [0.0] * 12), 1: ([100.0] * 20 + [0.0] * 20, [0.0] * 20)}
    for seed in (0, 1):
        scores = dict(zip(("a", "b"), full[seed], strict=True))
        _write_seed_run(root, f"full{seed}", "no_press", seed, scores, {"a": 0.0, "b": 0.0})
        scores = dict(zip(("a", "b"), press[seed], strict=True))
        _write_seed_run(root, f"mlp{seed}", "kvzap_mlp", seed, scores, {"a": 0.7, "b": 0.8}, -3.0)
    return root, full, press


def test_runs_of_one_setting_on_several_seeds_are_pooled(seeds, tmp_path):
    root, full, press = seeds
    results = collect_results(root)
    assert len(results) == 2  # one row per setting, not per run
    mlp = next(r for r in results if r["press"] == "kvzap_mlp")
    assert mlp["seeds"] == [0, 1] and len(mlp["runs"]) == 2 and mlp["n_predictions"] == 120
    # Each task's score is the mean of all its samples over both seeds; the run's, the mean of the tasks.
    a, b = press[0][0] + press[1][0], press[0][1] + press[1][1]
    assert mlp["tasks"] == {"a": pytest.approx(sum(a) / 80), "b": pytest.approx(sum(b) / 40)}
    assert mlp["score"] == pytest.approx((sum(a) / 80 + sum(b) / 40) / 2)
    assert mlp["compression_ratio"] == pytest.approx((0.7 * 80 + 0.8 * 40) / 120)
    assert mlp["tasks_compression_ratio"] == {"a": pytest.approx(0.7), "b": pytest.approx(0.8)}
    assert mlp["score_ci"] == pytest.approx(run_intervals({"a": a, "b": b})["score_ci"])
    # The paired difference pairs each seed's run with the full cache of its seed, the pairs pooled: over both
    # seeds, task a loses 5 of 80 and task b gains 0 and loses 2 + 20 of 40: the mean over tasks is the mean of those.
    paired = mlp["paired_vs_full_cache"]
    assert paired["n"] == 120
    assert paired["difference"] == pytest.approx((-5 * 100 / 80 + -22 * 100 / 40) / 2)
    # One run per seed alone would be a different (smaller) comparison: the pooled one is not seed 0's.
    alone = collect_results(root, pool=False)
    assert len(alone) == 4 and all(len(r["runs"]) == 1 for r in alone)
    seed0 = next(r for r in alone if r["run_dir"].endswith("mlp0"))
    assert seed0["paired_vs_full_cache"]["n"] == 60
    assert seed0["paired_vs_full_cache"]["difference"] == pytest.approx((-5 * 100 / 40 + -2 * 100 / 20) / 2)

    paths = summarize(root, tmp_path / "out")
    table = paths["table"].read_text()
    assert "| kvzap_mlp | tau=-3 | 0, 1 | 0.733 |" in table
    with paths["csv"].open(newline="") as handle:
        (row,) = [r for r in csv.DictReader(handle) if r["press"] == "kvzap_mlp"]
    assert (row["seeds"], row["runs"], row["n_predictions"]) == ("0 1", "2", "120")
    from evaluation.plots import main

    assert main(["--results-dir", str(root), "--output-dir", str(tmp_path / "per_run"), "--per-run"]) == 0
    assert "| kvzap_mlp | tau=-3 | 1 |" in (tmp_path / "per_run" / "summary.md").read_text()


def test_a_seed_without_its_full_cache_leaves_the_pooled_row_unpaired(seeds):
    root, _, _ = seeds
    _write_seed_run(root, "mlp2", "kvzap_mlp", 2, {"a": [100.0] * 40, "b": [0.0] * 20}, {"a": 0.7, "b": 0.8}, -3.0)
    mlp = next(r for r in collect_results(root) if r["press"] == "kvzap_mlp")
    assert mlp["seeds"] == [0, 1, 2] and mlp["n_predictions"] == 180
    assert mlp["paired_vs_full_cache"] is None  # seed 2 has no full-cache run to pair with


def test_runs_of_the_same_samples_or_of_other_settings_are_not_pooled(seeds):
    root, _, _ = seeds
    # A rerun of seed 0 (same samples): pooling would count them twice.
    _write_seed_run(root, "mlp0_again", "kvzap_mlp", 0, {"a": [0.0] * 40, "b": [0.0] * 20}, {"a": 0.7, "b": 0.8}, -3.0)
    assert sum(r["press"] == "kvzap_mlp" for r in collect_results(root)) == 3
    root2 = root.parent / "runs2"
    # Another window: a different setting, on the same seeds or not.
    for seed, window in ((0, 128), (1, 64)):
        scores = {"a": [100.0] * 40, "b": [0.0] * 20}
        _write_seed_run(
            root2, f"w{seed}", "kvzap_mlp", seed, scores, {"a": 0.7, "b": 0.8}, -3.0, sliding_window_size=window
        )
    results = collect_results(root2)
    assert len(results) == 2 and all(r["seeds"] in ([0], [1]) for r in results)


def test_a_full_cache_on_other_tasks_is_not_the_reference(seeds, tmp_path):
    # A probe of the full cache on more tasks (another mean over tasks) in the same panel: each row is compared with
    # the full cache of its own tasks, wherever the probe sorts.
    root, _, _ = seeds
    probe = {"a": [0.0] * 10, "b": [0.0] * 10, "c": [0.0] * 10}  # scores 0: every press row would be "above" it
    for seed in (0, 1):
        _write_seed_run(root, f"probe{seed}", "no_press", seed, probe, {"a": 0.0, "b": 0.0, "c": 0.0}, n_samples=10)
    results = collect_results(root)
    assert sum(r["press"] == "no_press" for r in results) == 2
    mlp = next(r for r in results if r["press"] == "kvzap_mlp")
    full = next(r for r in results if r["press"] == "no_press" and set(r["tasks"]) == {"a", "b"})
    table = summarize(root, tmp_path / "out")["table"].read_text()
    row = next(line for line in table.splitlines() if "| kvzap_mlp |" in line)
    assert compare_to_full_cache(mlp, full) == "below, intervals disjoint"
    assert mlp["paired_vs_full_cache"]["n"] == 120  # paired with the full cache of its tasks, seed by seed
    assert "| below, intervals disjoint |" in row
    assert highest_compression_inside(results)[("m", "ruler_offline", 2048)]["kvzap_mlp"] is (
        mlp if compare_to_full_cache(mlp, full) == "inside" else None
    )
