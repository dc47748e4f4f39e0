"""Accuracy-vs-compression plot and markdown table from a directory of finished runs.

Reads every ``metrics.json`` below a results directory (as written by :mod:`evaluation.runner`) and writes
``accuracy_vs_compression.png`` (one panel per model, dataset and length, one line per press with 95% error bars,
the full cache as a dashed line inside its shaded interval), ``accuracy_by_task.png`` (each task's score against
its own compression ratio), ``summary.md`` (one row per run, one column per task,
every score with its 95% interval, where each press leaves the full cache's interval, and its paired difference
from the full cache: :func:`paired_vs_full_cache`) and ``summary.csv`` (the
same numbers, one column per bound). Runs written before intervals were recorded get them from their
``predictions.csv``. Datasets without a target length (LongBench, AIME25) have ``length`` None. A line is a press and
the weights it read: a run with other weights than the surrogate bundled now is a series of its own, named
``press (surrogate directory)`` or ``press (earlier bundled)`` (:func:`_label_weights`): the same press with two
surrogates is never drawn as one line nor ranked as one press, and runs of the same weights share one line.

Runs of one setting that differ only in their samples (``--seed 0``, ``--seed 1``, ...) are pooled into one row
(:func:`pool_seeds`): its scores, intervals and compression are those of all their samples, and its paired
difference from the full cache pairs each seed's run with the full cache's run of the same samples. ``--per-run``
keeps one row per run directory.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .intervals import run_intervals

logger = logging.getLogger(__name__)

__all__ = [
    "collect_results",
    "pool_seeds",
    "summary_table",
    "summary_rows",
    "paired_vs_full_cache",
    "task_compression",
    "compare_to_full_cache",
    "highest_compression_inside",
    "plot_results",
    "plot_tasks",
    "summarize",
    "main",
]


def collect_results(results_dir: str | os.PathLike, pool: bool = True) -> list[dict[str, Any]]:
    """Load every run's ``metrics.json`` below ``results_dir``.

    Parameters
    ----------
    results_dir : directory searched recursively.
    pool : pool the runs of one setting that answered different samples (one per seed) into one result
        (:func:`pool_seeds`); False keeps one result per run directory.

    Returns
    -------
    list of dict (the metrics, with ``run_dir``, ``runs`` (the run directories behind the result: one, or the
    pooled seeds'), ``seeds`` and ``paired_vs_full_cache`` (:func:`paired_vs_full_cache`) added), sorted by model,
    dataset, length, press and compression ratio.
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"No results directory at {root}; run `python -m evaluation` first.")
    results = []
    for path in sorted(root.rglob("metrics.json")):
        metrics = json.loads(path.read_text(encoding="utf-8"))
        config = path.parent / "config.json"
        record = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        for key in ("surrogate", "surrogate_weights"):  # runs written before metrics.json recorded them
            if key not in metrics:
                metrics[key] = record.get(key)
        run = _with_task_compression(_with_intervals({**metrics, "run_dir": str(path.parent)}))
        run.update(runs=[str(path.parent)], seeds=[record["seed"]] if record.get("seed") is not None else [])
        results.append(run)
    _label_weights(results)
    if pool:
        results = pool_seeds(results)
    on_its_tasks = _full_caches_on_tasks(results)
    for r in results:  # read each run's predictions once, for the table and the CSV
        r["paired_vs_full_cache"] = paired_vs_full_cache(r, on_its_tasks(r) or None)
    results.sort(key=lambda r: (*_panel(r), _series(r), r["compression_ratio"]))
    return results


#: ``config.json`` settings that only choose which samples a run answers (or where it was written): runs that
#: differ in nothing else are one setting, measured on several seeds' samples.
_SAMPLE_ONLY = frozenset({"seed", "n_samples", "fraction", "shards", "sweep", "surrogate"})


def _sample_identity(run_dir: str) -> str | None:
    """What a run's samples are, as a string two runs share exactly when they answered the same samples: the
    content hashes of its ``samples.json``, else the :func:`~evaluation.compare.sample_settings` of its generated
    samples; None when the run records neither (a Hub dataset's run of an older version)."""
    from .compare import read_config, read_sample_fingerprints, sample_settings

    fingerprints = read_sample_fingerprints(run_dir)
    if fingerprints is not None:
        return json.dumps(sorted(fingerprints.items()))
    config = read_config(run_dir)
    if config is not None and config.get("source") is None:
        return json.dumps(sorted(sample_settings(config).items()), default=str)
    return None


def _setting_key(run: dict[str, Any]) -> str | None:
    """The setting a run measured, whatever its samples: its line (:func:`_series`) and every ``config.json``
    setting but those of :data:`_SAMPLE_ONLY`; None for a run without ``config.json`` (never pooled)."""
    from .compare import read_config

    config = read_config(run["run_dir"])
    if config is None:
        return None
    setting = {k: v for k, v in config.items() if k not in _SAMPLE_ONLY}
    return json.dumps([_series(run), setting], sort_keys=True, default=str)


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the runs of one setting on different samples: every score, interval and compression ratio
    recomputed over all their samples (``predictions.csv``), as one run of all of them would have written."""
    from .compare import read_run

    scores: dict[str, list[float]] = defaultdict(list)
    rows: list[dict[str, Any]] = []
    for run in runs:
        for row in read_run(run["run_dir"])[0]:
            scores[row["task"]].append(row["score"])
            rows.append(row)
    tasks = [t for t in runs[0]["tasks"] if t in scores]
    pooled = dict(runs[0])
    pooled.update(
        tasks={t: sum(scores[t]) / len(scores[t]) for t in tasks},
        tasks_n={t: len(scores[t]) for t in tasks},
        n_predictions=len(rows),
        compression_ratio=sum(r["compression_ratio"] for r in rows) / len(rows),
        tasks_compression_ratio=task_compression(rows, tasks),
        runs=[run["run_dir"] for run in runs],
        seeds=sorted(seed for run in runs for seed in run.get("seeds", [])),
    )
    pooled["score"] = sum(pooled["tasks"].values()) / len(tasks)
    pooled.update(run_intervals({t: scores[t] for t in tasks}))
    return pooled


def pool_seeds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pool the runs of one setting measured on different samples (``--seed 0``, ``--seed 1``, ...) into one result.

    Runs are one setting when their line (:func:`_series`) and every ``config.json`` setting but those that only
    choose samples (:data:`_SAMPLE_ONLY`: seed, sample count, shards, ...) agree. They are pooled only when each
    has its ``predictions.csv`` and all answered different samples (:func:`_sample_identity`); two runs of the
    same samples (a rerun) stay apart, as do runs without a ``config.json``. A pooled result's scores, intervals
    and compression are those of all its samples (:func:`_pooled`), ``runs`` lists its run directories and
    ``seeds`` their seeds; ``run_dir`` is the first one's.
    """
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    out = []
    for run in results:
        key = _setting_key(run)
        if key is None:
            out.append(run)
        else:
            groups[key].append(run)
    for runs in groups.values():
        identities = [_sample_identity(run["run_dir"]) for run in runs]
        poolable = (
            len(runs) > 1
            and None not in identities
            and len(set(identities)) == len(runs)
            and all((Path(run["run_dir"]) / "predictions.csv").is_file() for run in runs)
        )
        if poolable:
            out.append(_pooled(sorted(runs, key=lambda r: (r.get("seeds") or [0], r["run_dir"]))))
        else:
            out.extend(runs)
    return out


def _label_weights(results: list[dict[str, Any]]) -> None:
    """Give each run its line (``series``): the press and the weights it read.

    A run whose recorded weights are the surrogate the installed package bundles for its model belongs to the
    press's plain line, however the weights were named (``--surrogate`` pointing at a copy of them, or the
    default). A run with other weights is named after its ``--surrogate`` directory (``kvzap_mlp
    (run300/mlp)``: the directory, with its parent when the directory is named after the type), or, when it read
    the default, ``press (earlier bundled)``: the surrogate bundled when it ran. Where one line still holds runs
    of different weights (a surrogate retrained into the same directory; runs written before fingerprints were
    recorded), each run is also marked with its weights' fingerprint (``weights_label``: 8 hex digits, or
    ``unrecorded``), so that :func:`_series` keeps them apart.

    Runs of one press that recorded the same weights share one line whatever they were called: a run that read
    the default while those weights were bundled joins the line of a run that named them with ``--surrogate``
    (the first such name in sorted order, where several directories held the same weights), so a surrogate that
    was bundled and then replaced keeps one line."""
    for r in results:
        r["series"] = _base_series(r)
    named: dict[tuple[str, str], str] = {}
    for r in sorted(results, key=lambda r: r["series"]):
        weights = r.get("surrogate_weights")
        if weights and r.get("surrogate") and r["series"] != r["press"]:
            named.setdefault((r["press"], weights), r["series"])
    for r in results:
        weights = r.get("surrogate_weights")
        if weights and r["series"] != r["press"]:
            r["series"] = named.get((r["press"], weights), r["series"])
    seen: dict[tuple, set] = defaultdict(set)
    for r in results:
        seen[(*_panel(r), r["series"])].add(r.get("surrogate_weights"))
    for r in results:
        if len(seen[(*_panel(r), r["series"])]) > 1:
            weights = r.get("surrogate_weights")
            r["weights_label"] = weights[:8] if weights else "unrecorded"


@functools.cache
def _bundled_weights(model: str, press: str) -> str | None:
    """The fingerprint of the surrogate bundled now for ``model`` and read by ``press`` (None if there is none);
    imported when first needed, so that plotting without learned presses never loads the press registry."""
    from .presses import bundled_weights

    return bundled_weights(model, press)


def _base_series(result: dict[str, Any]) -> str:
    """A run's line before fingerprint labels; see :func:`_label_weights`."""
    press, surrogate, weights = result["press"], result.get("surrogate"), result.get("surrogate_weights")
    if weights and weights == _bundled_weights(str(result.get("model") or ""), press):
        return press
    if surrogate:
        path = Path(str(surrogate).rstrip("/"))
        name = (
            f"{path.parent.name}/{path.name}"
            if path.name in ("mlp", "linear", "fastkvzip") and path.parent.name
            else path.name
        )
        return f"{press} ({name})"
    if weights:
        return f"{press} (earlier bundled)"
    return press


def _series(result: dict[str, Any]) -> str:
    """The line a run belongs to (:func:`_label_weights`), with its weights' fingerprint where one line holds runs
    of different weights (``kvzap_mlp @3fa2b1c0``)."""
    series = result.get("series") or _base_series(result)
    if result.get("weights_label"):
        series += f" @{result['weights_label']}"
    return series


def _with_intervals(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its intervals: those of its ``metrics.json``, else computed from its ``predictions.csv``
    (runs finished before intervals were recorded), else none (``score_ci`` None)."""
    if result.get("score_ci") is not None:
        return result
    predictions = Path(result["run_dir"]) / "predictions.csv"
    if not predictions.is_file():
        return {**result, "score_ci": None, "tasks_ci": {}}
    by_task: dict[str, list[float]] = defaultdict(list)
    with predictions.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            by_task[row["task"]].append(float(row["score"]))
    return {**result, **run_intervals({t: by_task[t] for t in result["tasks"] if t in by_task})}


def _with_task_compression(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``tasks_compression_ratio`` (each task's mean compression ratio): that of its
    ``metrics.json``, else computed from its ``predictions.csv`` (runs written before it was recorded), else {}."""
    if result.get("tasks_compression_ratio") is not None:
        return result
    predictions = Path(result["run_dir"]) / "predictions.csv"
    if not predictions.is_file():
        return {**result, "tasks_compression_ratio": {}}
    with predictions.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    tasks = [t for t in result["tasks"] if any(row["task"] == t for row in rows)]
    return {**result, "tasks_compression_ratio": task_compression(rows, tasks)}


def task_compression(rows: list[dict[str, Any]], tasks: Iterable[str]) -> dict[str, float]:
    """Mean compression ratio of each task's samples (``rows``: predictions with ``task`` and
    ``compression_ratio``)."""
    out = {}
    for task in tasks:
        ratios = [float(r["compression_ratio"]) for r in rows if r["task"] == task]
        out[task] = sum(ratios) / len(ratios)
    return out


def _panel(result: dict[str, Any]) -> tuple[str, str, int]:
    """The panel a run belongs to: model, dataset, length (-1 for datasets without one, sorted first)."""
    length = result.get("length")
    return (
        str(result.get("model", "")),
        str(result.get("dataset", "ruler_offline")),
        -1 if length is None else int(length),
    )


def _panel_title(key: tuple[str, str, int]) -> str:
    model, dataset, length = key
    return f"{model}, {dataset}" + (f", {length} tokens" if length >= 0 else "")


def _value_label(result: dict[str, Any]) -> str:
    if result.get("knob") is None:
        return "-"
    short = "tau" if result["knob"] == "threshold" else "ratio"
    return f"{short}={result['value']:g}"


def _with_ci(value: float, interval: list[float] | None, digits: int) -> str:
    """``"54.0 [41.2, 66.3]"``, or the value alone without an interval."""
    if not interval:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{interval[0]:.1f}, {interval[1]:.1f}]"


def compare_to_full_cache(result: dict[str, Any], full: dict[str, Any] | None) -> str:
    """Where a run's score lies against the full cache's run of its panel (on the same tasks: :func:`_full_cache_runs`).

    Returns
    -------
    ``"inside"`` (the score is inside the full cache's 95% interval), ``"below"``/``"above"`` followed by
    ``", intervals overlap"`` or ``", intervals disjoint"`` (a difference larger than both intervals), or ``""``
    for the full cache itself and for panels without a full-cache run or intervals.
    """
    if full is None or result is full or result["press"] == "no_press":
        return ""
    full_ci, own_ci = full.get("score_ci"), result.get("score_ci")
    if not full_ci or not own_ci:
        return ""
    if full_ci[0] <= result["score"] <= full_ci[1]:
        return "inside"
    side = "below" if result["score"] < full_ci[0] else "above"
    disjoint = own_ci[1] < full_ci[0] or own_ci[0] > full_ci[1]
    return f"{side}, intervals {'disjoint' if disjoint else 'overlap'}"


def paired_vs_full_cache(result: dict[str, Any], full: dict[str, Any] | None) -> dict[str, Any] | None:
    """The paired difference of a run's score and the full cache's (:func:`evaluation.compare.compare_runs`: both
    runs' per-sample scores, matched by task and id), or None for the full cache itself, a panel without one, or
    runs without per-sample predictions. ``full`` is the full cache's result of the panel, or a list of them (its
    runs on several seeds, kept apart): each of the result's runs (one, or its seeds' when it was pooled by
    :func:`pool_seeds`) is paired with the full cache's run of the same samples, and the pairs are pooled
    (:func:`evaluation.compare.compare_pooled`); None when one of its runs has no full-cache run of its samples.

    Returns
    -------
    ``{"difference", "interval", "n"}``, in points; a loss is resolved when the interval's upper end is below 0.
    """
    fulls = [] if full is None else full if isinstance(full, list) else [full]
    if not fulls or any(result is f for f in fulls) or result["press"] == "no_press":
        return None
    from .compare import compare_pooled

    runs = result.get("runs") or [result["run_dir"]]
    full_runs = [run for f in fulls for run in f.get("runs") or [f["run_dir"]]]
    if len(runs) == 1 and len(full_runs) == 1:
        pairs = [(runs[0], full_runs[0])]  # compare_pooled refuses them if they answered different samples
    else:  # each seed's run against the full cache's run of the same samples
        partners: dict[str, str] = {}
        for run in full_runs:
            identity = _sample_identity(run)
            if identity is not None:
                partners.setdefault(identity, run)
        pairs = [(run, partners.get(_sample_identity(run) or "")) for run in runs]
        if any(partner is None for _, partner in pairs):
            return None
    try:
        paired = compare_pooled(pairs)
    except (FileNotFoundError, ValueError):
        return None
    return {"difference": paired["difference"], "interval": paired["interval"], "n": paired["n"]}


def _paired_label(paired: dict[str, Any] | None) -> str:
    if paired is None:
        return ""
    low, high = paired["interval"]
    verdict = "loss" if high < 0 else "gain" if low > 0 else "not resolved"
    return f"{paired['difference']:+.1f} [{low:+.1f}, {high:+.1f}] {verdict}"


def _full_caches_on_tasks(results: list[dict[str, Any]]) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """The full-cache results a result can be compared with (a function of the result): those of its panel on the
    same tasks (a full cache run on other tasks has another mean over tasks)."""
    fulls: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r["press"] == "no_press":
            fulls[_panel(r)].append(r)
    return lambda result: [f for f in fulls.get(_panel(result), []) if set(f["tasks"]) == set(result["tasks"])]


def _full_cache_runs(results: list[dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """The full cache's result each result is compared with (a function of the result): of those on its tasks
    (:func:`_full_caches_on_tasks`), the one sharing most of its seeds; None where the panel has none on its tasks."""
    on_its_tasks = _full_caches_on_tasks(results)

    def full_of(result: dict[str, Any]) -> dict[str, Any] | None:
        seeds = set(result.get("seeds") or [])
        return max(on_its_tasks(result), key=lambda f: len(seeds & set(f.get("seeds") or [])), default=None)

    return full_of


def highest_compression_inside(results: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Per panel and press, the highest compression up to which the press stays inside the full cache's interval.

    A press *stays inside* up to its run of highest compression ratio such that every run of that press at that
    compression or below has its score inside the full cache's 95% interval.

    Returns
    -------
    dict panel -> {series (the press, with its surrogate when one was given): the run (a result dict), or None when
    its lowest-compression run is already outside}; panels without a full-cache run (or without intervals) are
    left out.
    """
    full_of = _full_cache_runs(results)
    found: dict[tuple[str, str, int], dict[str, Any]] = defaultdict(dict)
    by_press: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r["press"] != "no_press" and (full := full_of(r)) is not None and full.get("score_ci"):
            by_press[(_panel(r), _series(r))].append(r)
    for (panel, press), runs in sorted(by_press.items()):
        best = None
        for r in sorted(runs, key=lambda r: r["compression_ratio"]):
            if compare_to_full_cache(r, full_of(r)) != "inside":
                break
            best = r
        found[panel][press] = best
    return dict(found)


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat record per result (the rows of ``summary.csv``: a run, or a setting's runs pooled over seeds): its
    settings, seeds (space-separated) and number of runs, compression, score, each task's score, every 95% interval
    as ``<name>_low`` / ``<name>_high`` (empty without one) and the comparison with the full cache
    (:func:`compare_to_full_cache`)."""
    tasks = sorted({task for r in results for task in r["tasks"]})
    full_of = _full_cache_runs(results)
    rows = []
    for r in results:
        row: dict[str, Any] = {
            "model": r.get("model", ""),
            "dataset": _panel(r)[1],
            "length": r.get("length"),
            "press": r["press"],
            "surrogate": r.get("surrogate"),
            "surrogate_weights": r.get("surrogate_weights"),
            "knob": r.get("knob"),
            "value": r.get("value"),
            "seeds": " ".join(str(seed) for seed in r.get("seeds") or []),
            "runs": len(r.get("runs") or [r["run_dir"]]),
            "compression_ratio": r["compression_ratio"],
            "n_predictions": r.get("n_predictions"),
        }
        intervals = {"score": r.get("score_ci"), **{t: (r.get("tasks_ci") or {}).get(t) for t in tasks}}
        values = {"score": r["score"], **{t: r["tasks"].get(t) for t in tasks}}
        for name, value in values.items():
            row[name] = value
            row[f"{name}_low"], row[f"{name}_high"] = intervals[name] or (None, None)
        for task in tasks:
            row[f"{task}_compression_ratio"] = (r.get("tasks_compression_ratio") or {}).get(task)
        row["vs_full_cache"] = compare_to_full_cache(r, full_of(r))
        paired = r.get("paired_vs_full_cache")
        row["paired_difference"] = None if paired is None else paired["difference"]
        row["paired_difference_low"], row["paired_difference_high"] = (
            (None, None) if paired is None else paired["interval"]
        )
        rows.append(row)
    return rows


def summary_table(results: list[dict[str, Any]]) -> str:
    """A markdown table: model, length, press, parameter, seeds (those pooled into the row, :func:`pool_seeds`),
    compression ratio, mean score and one column per task,
    each score with its 95% interval (``54.0 [41.2, 66.3]``), where the score lies against the full cache's
    interval, and the paired difference from the full cache (``-2.1 [-6.0, +1.5] not resolved``: the runs'
    per-sample differences bootstrapped, :func:`paired_vs_full_cache`); then, per panel, the highest compression
    each press reaches inside that interval."""
    tasks = sorted({task for r in results for task in r["tasks"]})
    full_of = _full_cache_runs(results)
    header = [
        "model",
        "dataset",
        "length",
        "press",
        "parameter",
        "seeds",
        "compression",
        "score",
        "vs full cache",
        "minus full cache, paired",
        *tasks,
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        task_ci = r.get("tasks_ci") or {}
        cells = [
            str(r.get("model", "")),
            _panel(r)[1],
            "-" if r.get("length") is None else str(r["length"]),
            _series(r),
            _value_label(r),
            ", ".join(str(seed) for seed in r.get("seeds") or []) or "-",
            f"{r['compression_ratio']:.3f}",
            _with_ci(r["score"], r.get("score_ci"), 2),
            compare_to_full_cache(r, full_of(r)),
            _paired_label(r.get("paired_vs_full_cache")),
            *(_with_ci(r["tasks"][t], task_ci.get(t), 1) if t in r["tasks"] else "" for t in tasks),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    inside = highest_compression_inside(results)
    if inside:
        lines += ["", "Highest compression at which each press stays inside the full cache's 95% interval:", ""]
        for panel, presses in sorted(inside.items()):
            reached = ", ".join(
                f"{press} {r['compression_ratio']:.3f} ({_value_label(r)})" if r is not None else f"{press} none"
                for press, r in sorted(presses.items())
            )
            lines.append(f"- {_panel_title(panel)}: {reached}")
    return "\n".join(lines) + "\n"


def _write_csv(results: list[dict[str, Any]], path: Path) -> None:
    rows = summary_rows(results)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _draw_series(ax, xs: list[float], scores: list[float], intervals: list, label: str, color: str) -> None:
    """One line of scores with asymmetric error bars: the distance from each score to the bounds of its interval
    (none where a run has no interval)."""
    errors = [
        [s - i[0] if i else 0.0 for s, i in zip(scores, intervals, strict=True)],
        [i[1] - s if i else 0.0 for s, i in zip(scores, intervals, strict=True)],
    ]
    ax.errorbar(xs, scores, yerr=errors, marker="o", capsize=3, label=label, color=color)


def plot_results(results: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Plot mean score (percent) against the measured compression ratio, one line per press (and surrogate).

    Parameters
    ----------
    results : as returned by :func:`collect_results`.
    path : PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        panels[_panel(r)].append(r)
    keys = sorted(panels)
    # One color per press in every panel.
    presses = sorted({_series(r) for r in results if r["press"] != "no_press"})
    colors = {press: f"C{i % 10}" for i, press in enumerate(presses)}
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(5 * max(len(keys), 1), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        by_press: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in panels[key]:
            by_press[_series(r)].append(r)
        for press, runs in sorted(by_press.items()):
            runs = sorted(runs, key=lambda r: r["compression_ratio"])
            if press == "no_press":  # the full cache on the tasks most of the panel's runs answered
                others = [set(r["tasks"]) for r in panels[key] if r["press"] != "no_press"]
                full = max(runs, key=lambda f: sum(set(f["tasks"]) == tasks for tasks in others))
                ax.axhline(full["score"], color="black", linestyle="--", linewidth=1, label="full cache")
                if full.get("score_ci"):
                    ax.axhspan(*full["score_ci"], color="black", alpha=0.08, linewidth=0)
                continue
            _draw_series(
                ax,
                [r["compression_ratio"] for r in runs],
                [r["score"] for r in runs],
                [r.get("score_ci") for r in runs],
                press,
                colors[press],
            )
        ax.set_title(_panel_title(key))
        ax.set_xlabel("compression ratio (share of KV pairs evicted)")
        ax.set_ylabel("score (%, 95% interval)")
        ax.set_xlim(-0.02, 1.0)
        lows = [r["score_ci"][0] if r.get("score_ci") else r["score"] for r in panels[key]]
        highs = [r["score_ci"][1] if r.get("score_ci") else r["score"] for r in panels[key]]
        ax.set_ylim(max(0.0, min(lows) - 5), min(100.0, max(highs) + 5) + 1)  # keep close results readable
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tasks(results: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Plot each task's score against that task's own compression ratio: one row of panels per model, dataset and
    length, one panel per task, one line per press (and surrogate), 95% error bars, the full cache dashed.

    The tasks of one run evict different shares (a task's prompts score differently), so a task is compared
    across presses at its own compression, not at the run's mean. Runs without per-task compression ratios are
    left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        panels[_panel(r)].append(r)
    keys = sorted(panels)
    tasks = sorted({task for r in results for task in r["tasks"]})
    series = sorted({_series(r) for r in results if r["press"] != "no_press"})
    colors = {name: f"C{i % 10}" for i, name in enumerate(series)}
    fig, axes = plt.subplots(
        len(keys), max(len(tasks), 1), figsize=(3.6 * max(len(tasks), 1), 3.2 * len(keys)), squeeze=False
    )
    for row, key in zip(axes, keys, strict=True):
        for ax, task in zip(row, tasks, strict=True):
            by_series: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in panels[key]:
                own = task in (r.get("tasks_compression_ratio") or {}) or r["press"] == "no_press"
                if task in r["tasks"] and own:
                    by_series[_series(r)].append(r)
            for name, runs in sorted(by_series.items()):
                if runs[0]["press"] == "no_press":
                    full = runs[0]
                    ax.axhline(full["tasks"][task], color="black", linestyle="--", linewidth=1, label="full cache")
                    interval = (full.get("tasks_ci") or {}).get(task)
                    if interval:
                        ax.axhspan(*interval, color="black", alpha=0.08, linewidth=0)
                    continue
                runs = sorted(runs, key=lambda r: r["tasks_compression_ratio"][task])
                _draw_series(
                    ax,
                    [r["tasks_compression_ratio"][task] for r in runs],
                    [r["tasks"][task] for r in runs],
                    [(r.get("tasks_ci") or {}).get(task) for r in runs],
                    name,
                    colors[name],
                )
            ax.set_title(f"{task}\n{_panel_title(key)}", fontsize="small")
            ax.set_xlabel("this task's compression ratio")
            ax.set_ylabel("score (%, 95% interval)")
            ax.set_xlim(-0.02, 1.0)
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize="x-small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(
    results_dir: str | os.PathLike, output_dir: str | os.PathLike | None = None, pool: bool = True
) -> dict[str, Path]:
    """Write ``accuracy_vs_compression.png``, ``summary.md`` and ``summary.csv`` for the runs below ``results_dir``.

    Parameters
    ----------
    results_dir : directory searched recursively for ``metrics.json`` files.
    output_dir : where to write the two files (default: ``results_dir``).
    pool : one row per setting, its seeds pooled (:func:`pool_seeds`); False: one row per run directory.

    Returns
    -------
    dict with the paths written, keys ``"plot"``, ``"tasks_plot"`` (:func:`plot_tasks`), ``"table"`` and
    ``"csv"``.
    """
    results = collect_results(results_dir, pool=pool)
    if not results:
        raise FileNotFoundError(f"No finished runs (metrics.json) below {results_dir}.")
    out = Path(output_dir) if output_dir is not None else Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "summary.md"
    table.write_text(summary_table(results), encoding="utf-8")
    _write_csv(results, out / "summary.csv")
    plot = plot_results(results, out / "accuracy_vs_compression.png")
    tasks_plot = plot_tasks(results, out / "accuracy_by_task.png")
    logger.info("Wrote %s, %s, %s and %s", plot, tasks_plot, table, out / "summary.csv")
    return {"plot": plot, "tasks_plot": tasks_plot, "table": table, "csv": out / "summary.csv"}


def main(argv: list[str] | None = None, prog: str = "python -m evaluation plot") -> int:
    """``python -m evaluation plot --results-dir DIR [--output-dir OUT] [--per-run]``; prints the table."""
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=summarize.__doc__.split("\n")[0])
    parser.add_argument("--results-dir", required=True)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument(
        "--per-run",
        action="store_true",
        help="one row per run directory (default: the runs of one setting on different seeds pooled into one row)",
    )
    args = parser.parse_args(argv)
    try:
        paths = summarize(args.results_dir, args.output_dir, pool=not args.per_run)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(paths["table"].read_text(encoding="utf-8"), end="")
    print(f"Wrote {paths['plot']}, {paths['tasks_plot']}, {paths['table']} and {paths['csv']}")
    return 0
