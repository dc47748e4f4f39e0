"""Accuracy-vs-compression plot and markdown table from a directory of finished runs.

Reads every ``metrics.json`` below a results directory (as written by :mod:`evaluation.runner`) and writes
``accuracy_vs_compression.png`` (one panel per model, dataset and length, one line per press, the full cache as a
dashed line) and ``summary.md`` (one row per run, one column per task). Datasets without a target length
(LongBench, AIME25) have ``length`` None.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["collect_results", "summary_table", "plot_results", "summarize", "main"]


def collect_results(results_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Load every run's ``metrics.json`` below ``results_dir``.

    Returns
    -------
    list of dict (the metrics, with ``run_dir`` added), sorted by model, dataset, length, press and compression
    ratio.
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"No results directory at {root}; run `python -m evaluation` first.")
    results = []
    for path in sorted(root.rglob("metrics.json")):
        metrics = json.loads(path.read_text(encoding="utf-8"))
        results.append({**metrics, "run_dir": str(path.parent)})
    results.sort(key=lambda r: (*_panel(r), r["press"], r["compression_ratio"]))
    return results


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


def summary_table(results: list[dict[str, Any]]) -> str:
    """A markdown table: model, length, press, parameter, compression ratio, mean score and one column per task."""
    tasks = sorted({task for r in results for task in r["tasks"]})
    header = ["model", "dataset", "length", "press", "parameter", "compression", "score", *tasks]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        cells = [
            str(r.get("model", "")),
            _panel(r)[1],
            "-" if r.get("length") is None else str(r["length"]),
            r["press"],
            _value_label(r),
            f"{r['compression_ratio']:.3f}",
            f"{r['score']:.2f}",
            *(f"{r['tasks'][t]:.1f}" if t in r["tasks"] else "" for t in tasks),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_results(results: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Plot mean score (percent) against the measured compression ratio, one line per press.

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
    presses = sorted({r["press"] for r in results if r["press"] != "no_press"})
    colors = {press: f"C{i % 10}" for i, press in enumerate(presses)}
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(5 * max(len(keys), 1), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        by_press: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in panels[key]:
            by_press[r["press"]].append(r)
        for press, runs in sorted(by_press.items()):
            runs = sorted(runs, key=lambda r: r["compression_ratio"])
            if press == "no_press":
                ax.axhline(runs[0]["score"], color="black", linestyle="--", linewidth=1, label="full cache")
                continue
            ax.plot(
                [r["compression_ratio"] for r in runs],
                [r["score"] for r in runs],
                marker="o",
                label=press,
                color=colors[press],
            )
        ax.set_title(_panel_title(key))
        ax.set_xlabel("compression ratio (share of KV pairs evicted)")
        ax.set_ylabel("score (%)")
        ax.set_xlim(-0.02, 1.0)
        scores = [r["score"] for r in panels[key]]
        ax.set_ylim(max(0.0, min(scores) - 5), min(100.0, max(scores) + 5) + 1)  # keep close results readable
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summarize(results_dir: str | os.PathLike, output_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write ``accuracy_vs_compression.png`` and ``summary.md`` for the runs below ``results_dir``.

    Parameters
    ----------
    results_dir : directory searched recursively for ``metrics.json`` files.
    output_dir : where to write the two files (default: ``results_dir``).

    Returns
    -------
    dict with the paths written, keys ``"plot"`` and ``"table"``.
    """
    results = collect_results(results_dir)
    if not results:
        raise FileNotFoundError(f"No finished runs (metrics.json) below {results_dir}.")
    out = Path(output_dir) if output_dir is not None else Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "summary.md"
    table.write_text(summary_table(results), encoding="utf-8")
    plot = plot_results(results, out / "accuracy_vs_compression.png")
    logger.info("Wrote %s and %s", plot, table)
    return {"plot": plot, "table": table}


def main(argv: list[str] | None = None, prog: str = "python -m evaluation plot") -> int:
    """``python -m evaluation plot --results-dir DIR [--output-dir OUT]``; prints the table."""
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=summarize.__doc__.split("\n")[0])
    parser.add_argument("--results-dir", required=True)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    try:
        paths = summarize(args.results_dir, args.output_dir)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(paths["table"].read_text(encoding="utf-8"), end="")
    print(f"Wrote {paths['plot']} and {paths['table']}")
    return 0
