"""Accuracy against KV bytes: kvzap and the caches a user would pick instead, one point per method and context.

Reads ``alternatives.json`` (KV bytes after the prefill, measured from outside, as a share of the full cache) and
the needle-suite runs that :func:`benchmarks.report_alternatives.accuracy_points` finds (score and 95% interval);
a method without a finished run at a length is left out of that length's panel::

    python -m benchmarks.plot_alternatives [--results benchmarks/results] [--out benchmarks/results/alternatives.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.report_alternatives import EVAL_PRESS, accuracy_points
from benchmarks.report_common import Results


def plot(results_dir: Path | str, out: Path | str, root: Path | str | None = None) -> Path:
    """Write the figure to ``out``; ``root`` is the checkout holding the evaluation runs (default: the one holding
    ``results_dir``). Raises ValueError when there is nothing to plot, saying what is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvzap.models import model_name

    res = Results(results_dir)
    data = res.load("alternatives.json")
    if not data:
        raise ValueError(f"No alternatives.json in {results_dir}: run python -m benchmarks.bench_alternatives first.")
    root = Path(root) if root is not None else res.directory.resolve().parent.parent
    points = accuracy_points(root, data["meta"].get("threshold"))
    rows = {(r["method"], r["prefill_tokens"]): r for r in data["results"] if "kv_share_after_prefill" in r}
    lengths = sorted({length for (method, length) in points if (method, length) in rows})
    if not lengths:
        raise ValueError(
            f"No needle-suite run under {root}/evaluation/results/alternatives-* matches a length of alternatives.json "
            "(see BENCHMARKS.md for the evaluation command)."
        )
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False, sharey=True)
    # One colour a method in every panel, and one legend entry a method (a panel may lack some methods).
    colours = {method: plt.cm.tab10(i % 10) for i, method in enumerate(EVAL_PRESS)}
    legend: dict[str, tuple[str, object]] = {}
    for ax, length in zip(axes[0], lengths, strict=True):
        for (method, at), point in sorted(points.items()):
            if at != length or (method, at) not in rows:
                continue
            row = rows[(method, at)]
            low, high = point["ci"]
            x = row["kv_share_after_prefill"]
            marker = "*" if method.startswith("kvzap") else "o"
            handle = ax.errorbar(
                x,
                point["score"],
                yerr=[[point["score"] - low], [high - point["score"]]],
                fmt=marker,
                markersize=11 if marker == "*" else 7,
                capsize=3,
                color=colours[method],
            )
            legend.setdefault(method, (row.get("label", method), handle))
        ax.set_xscale("log")
        ax.set_xlabel("KV bytes after the prefill / full cache (measured from outside)")
        ax.set_title(f"{length} tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("needle suite score (95% interval)")
    order = [method for method in EVAL_PRESS if method in legend]  # accuracy_points knows EVAL_PRESS's methods only
    axes[0][-1].legend([legend[m][1] for m in order], [legend[m][0] for m in order], fontsize=8, loc="lower right")
    fig.suptitle(f"Accuracy against KV memory, {model_name(data['meta']['model'])}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results", help="the directory holding alternatives.json")
    parser.add_argument("--out", default="benchmarks/results/alternatives.png", help="where to write the figure")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot(args.results, args.out)}")
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
