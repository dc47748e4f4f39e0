"""Accuracy-vs-compression plots, and ``python -m evaluation plot``, from a directory of finished runs.

Reads every ``metrics.json`` below a results directory (:func:`evaluation.collect.collect_results`) and writes
``accuracy_vs_compression.png`` (one panel per model, dataset and length, one line per press with 95% error bars,
the full cache as a dashed line inside its shaded interval), ``accuracy_by_task.png`` (each task's score against
its own compression ratio), ``summary.md`` and ``summary.csv`` (:mod:`evaluation.summary`: one row per run, one
column per task, every score with its 95% interval and its paired difference from the full cache). Runs written
before intervals were recorded get them from their ``predictions.csv``. Datasets without a target length
(LongBench, AIME25) have ``length`` None. A line is a press and the weights it read
(:func:`evaluation.collect._label_weights`).

Runs of one setting that differ only in their samples (``--seed 0``, ``--seed 1``, ...) are pooled into one row
(:func:`evaluation.collect.pool_seeds`): its scores, intervals and compression are those of all their samples, and
its paired difference from the full cache pairs each seed's run with the full cache's run of the same samples.
``--per-run`` keeps one row per run directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# The collected results and their tables, importable from here too, beside the plots drawn from them.
from .collect import (
    _panel,
    _panel_title,
    _series,
    collect_results,
    compare_to_full_cache,
    highest_compression_inside,
    paired_vs_full_cache,
    pool_seeds,
)
from .rundirs import task_compression
from .summary import summary_rows, summary_table, write_csv

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


def _draw_series(ax, xs: list[float], scores: list[float], intervals: list, label: str, color: str) -> None:
    """One line of scores with asymmetric error bars: the distance from each score to the bounds of its interval
    (none where a run has no interval)."""
    errors = [
        [s - i[0] if i else 0.0 for s, i in zip(scores, intervals, strict=True)],
        [i[1] - s if i else 0.0 for s, i in zip(scores, intervals, strict=True)],
    ]
    ax.errorbar(xs, scores, yerr=errors, marker="o", capsize=3, label=label, color=color)


def _draw_full_cache(ax, score: float, interval: list[float] | None) -> None:
    """The full cache's score as a dashed line, inside its shaded 95% interval (where it has one)."""
    ax.axhline(score, color="black", linestyle="--", linewidth=1, label="full cache")
    if interval:
        ax.axhspan(*interval, color="black", alpha=0.08, linewidth=0)


def _pyplot():
    """matplotlib's pyplot drawing to files only (no display needed), imported when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_panel(results: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    panels: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        panels[_panel(r)].append(r)
    return panels


def _series_colors(results: list[dict[str, Any]]) -> dict[str, str]:
    """One color per line (press and weights), the same in every panel."""
    series = sorted({_series(r) for r in results if r["press"] != "no_press"})
    return {name: f"C{i % 10}" for i, name in enumerate(series)}


def _save(plt, fig, path: str | os.PathLike, dpi: int) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_results(results: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Plot mean score (percent) against the measured compression ratio, one line per press (and surrogate).

    Parameters
    ----------
    results : as returned by :func:`collect_results`.
    path : PNG file to write.
    """
    plt = _pyplot()
    panels = _by_panel(results)
    keys = sorted(panels)
    colors = _series_colors(results)
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
                _draw_full_cache(ax, full["score"], full.get("score_ci"))
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
    return _save(plt, fig, path, dpi=120)


def plot_tasks(results: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Plot each task's score against that task's own compression ratio: one row of panels per model, dataset and
    length, one panel per task, one line per press (and surrogate), 95% error bars, the full cache dashed.

    The tasks of one run evict different shares (a task's prompts score differently), so a task is compared
    across presses at its own compression, not at the run's mean. Runs without per-task compression ratios are
    left out.
    """
    plt = _pyplot()
    panels = _by_panel(results)
    keys = sorted(panels)
    tasks = sorted({task for r in results for task in r["tasks"]})
    colors = _series_colors(results)
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
                    _draw_full_cache(ax, full["tasks"][task], (full.get("tasks_ci") or {}).get(task))
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
    return _save(plt, fig, path, dpi=100)


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
    write_csv(results, out / "summary.csv")
    plot = plot_results(results, out / "accuracy_vs_compression.png")
    tasks_plot = plot_tasks(results, out / "accuracy_by_task.png")
    logger.info("Wrote %s, %s, %s and %s", plot, tasks_plot, table, out / "summary.csv")
    return {"plot": plot, "tasks_plot": tasks_plot, "table": table, "csv": out / "summary.csv"}


def main(argv: list[str] | None = None, prog: str = "python -m evaluation plot") -> int:
    """``python -m evaluation plot --results-dir DIR [--output-dir OUT] [--per-run]``; prints the table."""
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
