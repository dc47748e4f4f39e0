"""Figures of a fit's report: per-layer R^2 (:func:`plot_r2`) and bar charts per kind of text (:func:`plot_kinds`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .metrics import EVICTIONS

__all__ = ["plot_kinds", "plot_r2"]


def _pyplot():
    """``matplotlib.pyplot`` drawing off screen (no display on training machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike, dpi: int) -> Path:
    """Write ``fig`` to the PNG file ``path`` (its folder created), close it and return ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def plot_r2(results: dict[str, dict], path: str | os.PathLike, title: str = "") -> Path:
    """Plot per-layer held-out R^2 (mean over heads, with the min-max range over heads) of each surrogate.

    Parameters
    ----------
    results : dict
        Surrogate name -> the dict returned by :func:`train.metrics.evaluate_surrogate`.
    path : str or PathLike
        PNG file to write.
    title : str
        Figure title.

    Returns
    -------
    Path
        ``path``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, result in results.items():
        per_head = np.asarray(result["per_head"])  # (L, H)
        layers = np.arange(per_head.shape[0])
        ax.plot(layers, per_head.mean(axis=1), marker="o", ms=3, label=f"{name} (mean {result['mean_r2']:.3f})")
        ax.fill_between(layers, per_head.min(axis=1), per_head.max(axis=1), alpha=0.2)
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out R$^2$ (squared Pearson)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path, dpi=120)


def _bar_styles(names: Sequence[str], evictions: Sequence[float | None]) -> dict[tuple, dict]:
    """Colour and opacity of each ``(surrogate, eviction)`` bar series: one colour per surrogate (matplotlib's
    ``tab10`` cycle, then ``tab20``), lighter at higher eviction rates, so the series of several surrogates stay
    apart (a single colour cycle over every series repeated colours from the fourth surrogate on)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    alphas = np.linspace(1.0, 0.4, len(evictions)) if len(evictions) > 1 else [1.0]
    return {
        (name, eviction): {"color": cmap(i % cmap.N), "alpha": float(alpha)}
        for i, name in enumerate(names)
        for eviction, alpha in zip(evictions, alphas, strict=True)
    }


def plot_kinds(results: dict[str, dict], path: str | os.PathLike, title: str = "") -> Path:
    """Bar charts per kind of text: R^2, then the DMS-like and per-head kept-set overlaps at each eviction rate.

    Parameters
    ----------
    results : dict
        Surrogate name -> a dict with ``per_kind`` (see :func:`train.metrics.evaluate_surrogate`).
    path : str or PathLike
        PNG file to write.
    title : str
        Figure title.

    Returns
    -------
    Path
        ``path``.
    """
    plt = _pyplot()
    names = [name for name, result in results.items() if result.get("per_kind")]
    if not names:
        raise ValueError("results hold no `per_kind` entry to plot; evaluate with the kinds of the rows.")
    kinds = sorted({kind for name in names for kind in results[name]["per_kind"]})
    x = np.arange(len(kinds))
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.1 * len(kinds)) + 2.5, 10), sharex=True)
    panels = [
        ("R$^2$ (squared Pearson)", None),
        ("kept-set overlap, DMS-like", "dms"),
        ("overlap, per head", "per_head"),
    ]
    for ax, (label, rule) in zip(axes, panels, strict=True):
        rates = [None] if rule is None else list(EVICTIONS)
        series = [(name, eviction) for name in names for eviction in rates]
        styles = _bar_styles(names, rates)
        width = 0.8 / len(series)
        for i, (name, eviction) in enumerate(series):
            values = []
            for kind in kinds:
                entry = results[name]["per_kind"].get(kind)
                if entry is None:
                    values.append(np.nan)
                elif rule is None:
                    values.append(entry["mean_r2"])
                else:
                    values.append(entry["overlap"][rule][f"{eviction:g}"]["mean"])
            legend = name if eviction is None else f"{name}, {eviction:.0%} evicted"
            style = styles[name, eviction]
            ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=legend, **style)
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
        if rule is not None:  # a random ranking keeps 1 - eviction of the oracle's set
            for eviction in EVICTIONS:
                ax.axhline(1 - eviction, color="grey", lw=0.6, ls=":")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[-1].set_xticks(x, kinds, rotation=30, ha="right")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    return _save(fig, path, dpi=110)
