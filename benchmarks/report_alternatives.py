"""The side-by-side table of BENCHMARKS.md: kvzap against transformers' static and quantized caches.

:func:`alternatives_block` reads ``alternatives.json`` (``benchmarks/bench_alternatives.py``: KV bytes from outside,
prefill time, decode ms/token) and, where they exist, the needle-suite runs of the same methods
(``evaluation/results/alternatives-*``, see :func:`accuracy_points`): each method's score with its 95% interval,
and its paired difference against the full cache on the same samples.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report_common import Results, source

# The evaluation's name of each benchmark method (evaluation/presses.py), and which threshold kvzap's runs need.
EVAL_PRESS = {
    "none": "no_press",
    "static": "static_cache",
    "quanto_int4": "quanto_int4",
    "quanto_int2": "quanto_int2",
    "hqq_int4": "hqq_int4",
    "hqq_int2": "hqq_int2",
    "kvzap": "kvzap_mlp",
    "kvzap_kv8": "kvzap_mlp_kv8",
}
# The needle-suite runs read: run directories under these folders of the checkout (one folder per sweep).
ACCURACY_GLOB = "evaluation/results/alternatives-*"


def _checkout(res: Results) -> Path:
    return res.directory.resolve().parent.parent


def accuracy_points(root: Path | str, threshold: float | None = None) -> dict[tuple[str, int], dict]:
    """The finished needle-suite runs of the alternatives under ``root/evaluation/results/alternatives-*``:
    ``(benchmark method, length) -> {"score", "ci", "n", "difference", "interval", "run"}``, the difference (and
    its 95% paired-bootstrap interval) against the full-cache run of the same folder and length, on the same
    samples (None where there is none). kvzap's runs count only at ``threshold`` (the benchmark's) when given.
    Where a folder holds several runs of one point, the one with the most samples wins."""
    from evaluation.compare import compare_runs

    by_press = {press: method for method, press in EVAL_PRESS.items()}
    runs: dict[tuple[str, int], list[tuple[Path, dict]]] = {}
    for metrics_path in sorted(Path(root).glob(f"{ACCURACY_GLOB}/*/*/metrics.json")):
        metrics = json.loads(metrics_path.read_text())
        method = by_press.get(metrics.get("press"))
        if method is None or metrics.get("length") is None:
            continue
        if method.startswith("kvzap") and threshold is not None and metrics.get("value") != threshold:
            continue
        runs.setdefault((method, metrics["length"]), []).append((metrics_path.parent, metrics))
    points = {}
    for (method, length), found in runs.items():
        directory, metrics = max(found, key=lambda r: r[1]["n_predictions"])
        point = {
            "score": metrics["score"],
            "ci": metrics["score_ci"],
            "n": metrics["n_predictions"],
            "evicted": metrics.get("compression_ratio", 0.0),
            "difference": None,
            "interval": None,
            "run": str(directory),
        }
        full = [d for d, m in runs.get(("none", length), []) if d.parent.parent == directory.parent.parent]
        if method != "none" and full:
            try:
                paired = compare_runs(directory, full[0])
            except ValueError:  # not the same samples: no paired difference
                paired = None
            if paired is not None:
                point.update(difference=paired["difference"], interval=list(paired["interval"]), n=paired["n"])
        points[(method, length)] = point
    return points


def _accuracy_cell(point: dict | None) -> str:
    if point is None:
        return "-"
    low, high = point["ci"]
    cell = f"{point['score']:.1f} [{low:.1f}, {high:.1f}]"
    if point["difference"] is not None:
        d_low, d_high = point["interval"]
        verdict = "" if d_low <= 0 <= d_high else " (resolved)"
        cell += f"; {point['difference']:+.1f} [{d_low:+.1f}, {d_high:+.1f}]{verdict}"
    return cell + f" (n={point['n']})"


def _ratio(row: dict, key: str) -> str:
    ratio = row.get(f"{key}_ratio")
    return "-" if ratio is None else f"{ratio:.2f}x"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n} tokens"


def _speed(row: dict) -> str:
    """Decode speed against no press (> 1 faster): the inverse of the median of the runs' ms/token ratios."""
    ratio = row.get("decode_ms_per_token_ratio")
    return "-" if not ratio else f"{1 / ratio:.2f}x"


def alternatives_block(res: Results) -> list[str] | None:
    """One row per method: KV held after decoding at the longest context (share of the full cache in the model's
    dtype, measured from outside), decode speed against no press at each context (each run's ratio, their median),
    prefill time at the longest context, and the needle-suite accuracy at each length evaluated."""
    data = res.load("alternatives.json")
    if not data or not data["results"]:
        return None
    m = data["meta"]
    points = accuracy_points(_checkout(res), m.get("threshold"))
    runs = [Path(p["run"]).parent.parent.name for p in points.values()]
    lengths = sorted({r["prefill_tokens"] for r in data["results"]})
    longest = lengths[-1]
    acc_lengths = sorted({n for _, n in points})
    by = {(r["method"], r["prefill_tokens"]): r for r in data["results"]}
    # Only the methods a user can pick (EVAL_PRESS): the raw file also holds the 4-bit storage presses refuse, whose
    # figures research/kv-bits-4 cites.
    methods = [m for m in dict.fromkeys(r["method"] for r in data["results"]) if m in EVAL_PRESS]
    ctx = " / ".join(_k(n) for n in lengths)
    acc_head = "".join(f" | needles {_k(n)}: score [95%]; paired - full cache" for n in acc_lengths)
    lines = [
        source(("alternatives.json", m)),
        "",
        f"| method | KV / full cache, {_k(longest)}, after {m['decode_tokens']} tokens | decode speed / no press, "
        f"{ctx} | decode ms/token, {_k(longest)} | prefill / no press, {_k(longest)}{acc_head} |",
        "|---|---|---|---|---|" + "---|" * len(acc_lengths),
    ]
    for method in methods:
        rows = [by.get((method, n)) for n in lengths]
        last = rows[-1] or {}
        label = next((r.get("label") for r in rows if r and r.get("label")), method)
        failed = next(
            (r.get("error") or r.get("skipped") for r in rows if r and ("error" in r or "skipped" in r)), None
        )
        acc = "".join(f" | {_accuracy_cell(points.get((method, n)))}" for n in acc_lengths)
        if failed and "kv_share_after_decode" not in last:
            lines.append(f"| {label} | failed: {failed} | - | - | -{acc} |")
            continue
        evicted = f" ({last['evicted_share']:.0%} evicted)" if last.get("evicted_share") else ""
        speeds = " / ".join(_speed(r) if r and "error" not in r else "-" for r in rows)
        lines.append(
            f"| {label} | **{last['kv_share_after_decode']:.3f}**{evicted} | {speeds} "
            f"| {last['decode_ms_per_token']:.1f} | {_ratio(last, 'prefill_s')}{acc} |"
        )
    if runs:
        folders = ", ".join(f"`evaluation/results/{name}`" for name in sorted(set(runs)))
        lines += ["", f"Accuracy: offline needle suite, run directories in {folders}."]
    return lines
