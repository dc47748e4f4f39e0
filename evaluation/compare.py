"""``python -m evaluation compare RUN_A RUN_B``: the score difference of two runs, sample by sample.

Two runs of one benchmark (two presses, two thresholds, two surrogates) answer the same samples. Whether their
scores differ is a question about the per-sample differences, which :func:`evaluation.intervals.paired_difference`
resamples: the interval of ``A - B`` it prints is the test (resolved when it excludes 0), where comparing the two
runs' own intervals is far too conservative. Each run is read from its ``predictions.csv``, or, for a run still
going, from its ``predictions.partial.jsonl`` (the comparison then covers the samples both have answered).

Samples are paired by task and id, and ids do not say everything that makes a sample: the offline RULER generator
builds sample ``niah_single-2048-0`` from the seed, the haystack text and the model's tokenizer. So the two runs'
``config.json`` must agree on what defines their samples (:func:`sample_settings`), or the comparison is refused.
Runs that wrote ``samples.json`` (a hash of each sample's context, question and answers) are judged on it instead:
the same samples compare whatever the settings say (two models sharing a tokenizer), different ones are refused.

One seed's 200 needle samples often leave a difference of half a point unresolved. ``compare A0 B0 A1 B1 ...``
pools pairs of runs, one pair per seed: each pair must answer the same samples, as above; the pairs must answer
different ones (another seed), and each side must run the same press, value and surrogate in every pair
(:func:`press_settings`). The difference is then bootstrapped over all pairs' samples, still stratified by task.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .intervals import paired_difference
from .rundirs import (  # re-exported: the reports and evaluation.tables read run directories through them
    read_config,
    read_predictions,
    read_run,
    read_sample_fingerprints,
    sample_key,
    sample_settings,
)

__all__ = [
    "read_predictions",
    "read_run",
    "read_config",
    "read_sample_fingerprints",
    "sample_settings",
    "press_settings",
    "compare_runs",
    "compare_pooled",
    "format_comparison",
    "main",
]


def _differing_settings(run_a: Path, run_b: Path) -> list[str]:
    """The :func:`sample_settings` on which the two runs' ``config.json`` disagree (none when either has none)."""
    config_a, config_b = read_config(run_a), read_config(run_b)
    if config_a is None or config_b is None:
        return []
    return _disagreements(sample_settings(config_a), sample_settings(config_b))


def _disagreements(settings_a: dict[str, Any], settings_b: dict[str, Any]) -> list[str]:
    """``"key A against B"`` for every setting both have and give different values, sorted."""
    return sorted(
        f"{key} {settings_a[key]!r} against {settings_b[key]!r}"
        for key in settings_a.keys() & settings_b.keys()
        if settings_a[key] != settings_b[key]
    )


#: The settings of a run's ``config.json`` that say what answered its samples: one side of a pooled comparison
#: keeps them in every pair (``surrogate_weights`` names the weights, whatever directory they were read from).
PRESS_SETTINGS = ("press", "knob", "value", "surrogate_weights", "sliding_window_size", "decoding", "dtype")


def press_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run's ``config.json`` that decide what answered its samples (:data:`PRESS_SETTINGS`),
    as far as the config has them."""
    return {key: config[key] for key in PRESS_SETTINGS if key in config}


def _check_same_samples(run_a: Path, run_b: Path, keys: set[str]) -> None:
    """Raise ValueError when the two runs did not answer the same samples under the paired ``keys``
    (``task/id``). Runs that both wrote sample fingerprints (``samples.json``) are judged on those, so two models
    sharing a tokenizer compare on the samples they share; older runs on their :func:`sample_settings`."""
    fingerprints = read_sample_fingerprints(run_a), read_sample_fingerprints(run_b)
    content: list[str] = []
    if (
        fingerprints[0] is not None
        and fingerprints[1] is not None
        and all(k in fingerprints[0] and k in fingerprints[1] for k in keys)
    ):
        other = sorted(k for k in keys if fingerprints[0][k] != fingerprints[1][k])
        if not other:
            return
        content = [f"{len(other)} of {len(keys)} paired samples differ in content, e.g. {other[0]}"]
    differing = content + _differing_settings(run_a, run_b)
    if differing:
        raise ValueError(
            f"{run_a} and {run_b} did not answer the same samples ({'; '.join(differing)}), although "
            "their sample ids match: a paired comparison needs two runs of the same benchmark settings. Rerun one "
            "of them with the other's settings (e.g. `python -m evaluation ... --seed N`) and compare those."
        )


def compare_runs(run_a: str | Path, run_b: str | Path) -> dict[str, Any]:
    """:func:`~evaluation.intervals.paired_difference` of two run directories' scores (``A - B``), with each run's
    mean score and compression ratio over the paired samples, per task and overall (mean over tasks), and how
    many paired samples each run scored higher (``higher_a``, ``higher_b``; overall, their sums).

    Raises ValueError when the runs did not answer the same samples: by their sample fingerprints
    (``samples.json``, :func:`evaluation.rundirs.sample_fingerprints`) where both runs wrote them, else by their
    ``config.json`` (:func:`sample_settings`)."""
    return compare_pooled([(run_a, run_b)])


def _check_pooled(pairs: list[tuple[Path, Path]]) -> None:
    """Raise ValueError, before any score is read, when pooled pairs would count a sample twice (two pairs of the
    same samples) or mix presses on one side (:func:`press_settings` differ between pairs)."""
    for side, runs in (("A", [a for a, _ in pairs]), ("B", [b for _, b in pairs])):
        configs = [(run, press_settings(config)) for run in runs if (config := read_config(run)) is not None]
        if not configs:
            continue
        first, reference = configs[0]
        for run, settings in configs[1:]:
            differing = _disagreements(reference, settings)
            if differing:
                raise ValueError(
                    f"{side}'s runs {first} and {run} were not answered alike ({'; '.join(differing)}): pooling "
                    f"pairs needs the same press, value and surrogate on side {side} in every pair. Give each "
                    "side's runs of one setting, one per seed."
                )
    seen: dict[str, Path] = {}
    for run, _ in pairs:
        fingerprints = read_sample_fingerprints(run)
        config = read_config(run)
        if fingerprints is not None:
            identity = sorted(fingerprints.values())
        elif config is not None and config.get("source") is None:
            identity = sorted(sample_settings(config).items())
        else:
            continue  # a Hub dataset's seed picks rows without saying which: nothing to check on
        key = json.dumps(identity, default=str)
        if key in seen:
            raise ValueError(
                f"{seen[key]} and {run} answered the same samples: pooled pairs must be runs of different samples "
                "(one pair per seed, e.g. `python -m evaluation ... --seed 1` for the second pair)."
            )
        seen[key] = run


def compare_pooled(pairs: list[tuple[str | Path, str | Path]]) -> dict[str, Any]:
    """:func:`compare_runs` over several pairs of runs (``A`` and ``B`` of seed 0, of seed 1, ...) pooled into one
    paired difference: every pair is checked as :func:`compare_runs` checks its two runs, the pairs must answer
    different samples and each side the same :func:`press_settings` (ValueError otherwise, before scores are
    read). Samples are keyed by pair and id, so ``n`` counts every pair's paired samples; the result holds the
    keys of :func:`compare_runs`, ``run_a`` and ``run_b`` joining the runs of each side with ``" + "``."""
    if not pairs:
        raise ValueError("Give at least one pair of runs to compare.")
    paths = [(Path(a), Path(b)) for a, b in pairs]
    if len(paths) > 1:
        _check_pooled(paths)
    by_a: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    by_b: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    finished = {"a": True, "b": True}
    for index, (run_a, run_b) in enumerate(paths):
        rows_a, done_a = read_run(run_a)
        rows_b, done_b = read_run(run_b)
        finished["a"] &= done_a
        finished["b"] &= done_b
        keys = {sample_key(r) for r in rows_a} & {sample_key(r) for r in rows_b}
        _check_same_samples(run_a, run_b, keys)
        prefix = f"{index}:" if len(paths) > 1 else ""
        for rows, by in ((rows_a, by_a), (rows_b, by_b)):
            for r in rows:
                by[r["task"]][prefix + r["id"]] = r
    result = paired_difference(
        {t: {i: r["score"] for i, r in s.items()} for t, s in by_a.items()},
        {t: {i: r["score"] for i, r in s.items()} for t, s in by_b.items()},
    )
    for task, entry in result["tasks"].items():
        common = sorted(set(by_a[task]) & set(by_b[task]))
        # How many samples each run scored higher: a difference of a few points is often a handful of samples.
        entry["higher_a"] = sum(by_a[task][i]["score"] > by_b[task][i]["score"] for i in common)
        entry["higher_b"] = sum(by_a[task][i]["score"] < by_b[task][i]["score"] for i in common)
        for side, by in (("a", by_a), ("b", by_b)):
            entry[f"score_{side}"] = sum(by[task][i]["score"] for i in common) / len(common)
            entry[f"compression_{side}"] = sum(by[task][i]["compression_ratio"] for i in common) / len(common)
    for key in ("score_a", "score_b", "compression_a", "compression_b"):
        result[key] = sum(t[key] for t in result["tasks"].values()) / len(result["tasks"])
    for key in ("higher_a", "higher_b"):
        result[key] = sum(t[key] for t in result["tasks"].values())
    result.update(
        run_a=" + ".join(str(a) for a, _ in pairs),
        run_b=" + ".join(str(b) for _, b in pairs),
        finished_a=finished["a"],
        finished_b=finished["b"],
        pairs=len(pairs),
    )
    return result


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a Markdown table, one row per task and one for the run (mean over tasks)."""

    def line(name: str, e: dict[str, Any]) -> str:
        low, high = e["interval"]
        verdict = "A higher" if low > 0 else "B higher" if high < 0 else "not resolved"
        evicted = f"{100 * e['compression_a']:.1f}% | {100 * e['compression_b']:.1f}%"
        return (
            f"| {name} | {e['n']} | {e['score_a']:.1f} | {e['score_b']:.1f} | {e['difference']:+.1f} "
            f"[{low:+.1f}, {high:+.1f}] | {verdict} | {e['higher_a']} / {e['higher_b']} | {evicted} |"
        )

    out = [
        f"A: {result['run_a']}" + ("" if result["finished_a"] else " (unfinished)"),
        f"B: {result['run_b']}" + ("" if result["finished_b"] else " (unfinished)"),
        *([f"pooled over {result['pairs']} pairs of runs (one per seed)"] if result.get("pairs", 1) > 1 else []),
        "",
        "| task | paired samples | A | B | A - B [95%, paired bootstrap] | | samples A / B higher | A evicted "
        "| B evicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    out += [line(task, e) for task, e in result["tasks"].items()]
    out.append(line("**mean over tasks**", result))
    if result["unpaired"]:
        out.append(f"\n{result['unpaired']} samples answered by one run only were left out.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None, prog: str = "python -m evaluation compare") -> int:
    """``python -m evaluation compare RUN_A RUN_B [RUN_A RUN_B ...] [--json]``; prints the table (or the JSON)."""
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("run_a", help="a run directory (holding predictions.csv or predictions.partial.jsonl)")
    parser.add_argument("run_b", help="the run to compare it with, on the same benchmark")
    parser.add_argument(
        "more",
        nargs="*",
        metavar="RUN_A RUN_B",
        help="more pairs of runs, one pair per seed (A then B), pooled with the first into one paired difference",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if len(args.more) % 2:
        parser.error(
            f"runs come in pairs (A then B, one pair per seed); the last of {2 + len(args.more)} has no partner"
        )
    pairs = [(args.run_a, args.run_b)] + list(zip(args.more[::2], args.more[1::2], strict=True))
    try:
        result = compare_pooled(pairs)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_comparison(result).rstrip("\n"))
    return 0
