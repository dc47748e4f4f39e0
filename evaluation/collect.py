"""The finished runs below a results directory, pooled over seeds, labelled and set against the full cache.

:func:`collect_results` reads every run's ``metrics.json`` (through :mod:`evaluation.rundirs`), fills in what
runs of older versions did not record (intervals, per-task compression ratios, computed from their
``predictions.csv``), gives each run its line (:func:`_label_weights`: the press and the weights it read) and its
panel (model, dataset, length), pools the runs of one setting on several seeds (:func:`pool_seeds`), and pairs
each with the full cache's run of the same samples (:func:`paired_vs_full_cache`). :mod:`evaluation.summary`
turns the results into tables and :mod:`evaluation.plots` into figures.

A line is a press and the weights it read: a run with other weights than the surrogate bundled now is a series of
its own, named ``press (surrogate directory)`` or ``press (earlier bundled)``: the same press with two
surrogates is never drawn as one line nor ranked as one press, and runs of the same weights share one line.
"""

from __future__ import annotations

import functools
import json
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .compare import compare_pooled
from .intervals import run_intervals
from .rundirs import (
    read_config,
    read_metrics,
    read_predictions_csv,
    read_run,
    read_sample_fingerprints,
    sample_settings,
    summarize_rows,
    task_compression,
)

__all__ = [
    "collect_results",
    "pool_seeds",
    "paired_vs_full_cache",
    "compare_to_full_cache",
    "highest_compression_inside",
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
        metrics = read_metrics(path.parent)
        record = read_config(path.parent) or {}
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
    config = read_config(run["run_dir"])
    if config is None:
        return None
    setting = {k: v for k, v in config.items() if k not in _SAMPLE_ONLY}
    return json.dumps([_series(run), setting], sort_keys=True, default=str)


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the runs of one setting on different samples: every score, interval and compression ratio
    recomputed over all their samples (``predictions.csv``), as one run of all of them would have written
    (:func:`evaluation.rundirs.summarize_rows`, which the runner writes ``metrics.json`` with)."""
    rows = [row for run in runs for row in read_run(run["run_dir"])[0]]
    pooled = dict(runs[0])
    pooled.update(
        summarize_rows(rows, list(runs[0]["tasks"])),
        runs=[run["run_dir"] for run in runs],
        seeds=sorted(seed for run in runs for seed in run.get("seeds", [])),
    )
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
    for row in read_predictions_csv(predictions):
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
    rows = read_predictions_csv(predictions)
    tasks = [t for t in result["tasks"] if any(row["task"] == t for row in rows)]
    return {**result, "tasks_compression_ratio": task_compression(rows, tasks)}


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
