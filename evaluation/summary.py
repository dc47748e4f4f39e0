"""The summary of collected runs (:func:`evaluation.collect.collect_results`) as a markdown table and CSV rows.

``summary.md`` (:func:`summary_table`) has one row per run, or per setting pooled over seeds, one column per task,
every score with its 95% interval, where each press leaves the full cache's interval, and its paired difference
from the full cache (:func:`evaluation.collect.paired_vs_full_cache`); ``summary.csv`` (:func:`summary_rows`) holds
the same numbers, one column per bound.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from .collect import _full_cache_runs, _panel, _panel_title, _series, compare_to_full_cache, highest_compression_inside

__all__ = ["summary_rows", "summary_table", "write_csv"]


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


def _paired_label(paired: dict[str, Any] | None) -> str:
    if paired is None:
        return ""
    low, high = paired["interval"]
    verdict = "loss" if high < 0 else "gain" if low > 0 else "not resolved"
    return f"{paired['difference']:+.1f} [{low:+.1f}, {high:+.1f}] {verdict}"


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat record per result (the rows of ``summary.csv``: a run, or a setting's runs pooled over seeds): its
    settings, seeds (space-separated) and number of runs, compression, score, each task's score, every 95% interval
    as ``<name>_low`` / ``<name>_high`` (empty without one) and the comparison with the full cache
    (:func:`evaluation.collect.compare_to_full_cache`)."""
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
    """A markdown table: model, length, press, parameter, seeds (those pooled into the row,
    :func:`evaluation.collect.pool_seeds`), compression ratio, mean score and one column per task, each score with
    its 95% interval (``54.0 [41.2, 66.3]``), where the score lies against the full cache's interval, and the
    paired difference from the full cache (``-2.1 [-6.0, +1.5] not resolved``: the runs' per-sample differences
    bootstrapped, :func:`evaluation.collect.paired_vs_full_cache`); then, per panel, the highest compression each
    press reaches inside that interval."""
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


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    """Write :func:`summary_rows` to ``path`` (``summary.csv``), one column per field."""
    rows = summary_rows(results)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
