"""95% confidence intervals of the evaluation's scores.

A sample's score is in percent (0-100). A task whose samples all scored 0 or 100 is a proportion: its interval is
Wilson's score interval (:func:`wilson_interval`), which stays inside [0, 100] and is not empty at 0/n or n/n, as
the normal approximation is. Any other task (partial credit: ``string_match_all`` with several references,
LongBench's F1 and ROUGE) gets a percentile bootstrap over its samples (:func:`bootstrap_interval`). A run's score
is the mean over tasks of the task means. When every task is a proportion over the same number of samples, that
mean is the proportion of all the run's samples, and its interval is Wilson's again; otherwise it is a bootstrap
that resamples each task's samples apart (stratified, :func:`stratified_bootstrap_interval`): every resample keeps
each task's number of samples, as the run did. Resampling uses a fixed seed, so the same scores always give the
same interval. A bootstrap cannot vary what never varied: a task whose samples all scored the same (not 0 or 100)
gets a one-point interval, and adds no width to the run's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np

__all__ = [
    "LEVEL",
    "N_RESAMPLES",
    "wilson_interval",
    "bootstrap_interval",
    "stratified_bootstrap_interval",
    "is_binary",
    "task_interval",
    "run_intervals",
    "paired_difference",
]

#: Confidence level of every interval.
LEVEL = 0.95
#: Bootstrap resamples per interval.
N_RESAMPLES = 2000
#: Seed of the bootstrap's generator (fixed: an interval depends on the scores only).
SEED = 0


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}.")
    return NormalDist().inv_cdf(0.5 + level / 2)  # 1.95996... for 95%


def wilson_interval(successes: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n``, as fractions in [0, 1].

    The interval holds every proportion ``p`` for which the observed share lies within ``z`` standard errors
    ``sqrt(p (1 - p) / n)`` of ``p``: center ``(s/n + z^2 / 2n) / (1 + z^2 / n)``, half-width
    ``z / (1 + z^2 / n) * sqrt(s/n (1 - s/n) / n + z^2 / 4n^2)``.

    Parameters
    ----------
    successes : number of samples that scored 1 (an int in [0, n]).
    n : number of samples (a positive int).
    level : confidence level (0.95: z = 1.96).

    Returns
    -------
    (low, high), with ``low <= successes / n <= high``.
    """
    if isinstance(successes, bool) or isinstance(n, bool) or int(successes) != successes or int(n) != n:
        raise TypeError(f"successes and n must be integers, got {successes!r} and {n!r}.")
    if n < 1:
        raise ValueError(f"n must be a positive number of samples, got {n}.")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n] = [0, {n}], got {successes}.")
    z = _z(level)
    share = successes / n
    denominator = 1 + z * z / n
    center = (share + z * z / (2 * n)) / denominator
    half = z / denominator * np.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    # The bounds are exact at 0/n and n/n; clamp the rounding of the others.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return float(low), float(high)


def _percentiles(means: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def bootstrap_interval(
    values: Sequence[float], level: float = LEVEL, n_resamples: int = N_RESAMPLES, seed: int = SEED
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``: the mean of ``n_resamples`` resamples (with
    replacement, as many values as given), its ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles.

    Parameters
    ----------
    values : ``(n,)`` per-sample scores (n >= 1).
    level, n_resamples, seed : confidence level, resamples, seed of the generator.

    Returns
    -------
    (low, high) in the values' unit.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1 or data.size == 0:
        raise ValueError(f"values must be a non-empty list of numbers, got shape {data.shape}.")
    _z(level)  # checks the level
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, data.size, size=(n_resamples, data.size))  # (R, n)
    return _percentiles(data[picks].mean(axis=1), level)


def stratified_bootstrap_interval(
    groups: Mapping[str, Sequence[float]], level: float = LEVEL, n_resamples: int = N_RESAMPLES, seed: int = SEED
) -> tuple[float, float]:
    """Bootstrap interval of the mean over groups of each group's mean (a run's score: the mean over tasks).

    Each resample draws every group's samples from that group alone, with replacement, keeping its size.

    Parameters
    ----------
    groups : task -> ``(n_task,)`` per-sample scores, each non-empty.
    level, n_resamples, seed : confidence level, resamples, seed of the generator.

    Returns
    -------
    (low, high) in the scores' unit.
    """
    if not groups:
        raise ValueError("groups must hold at least one group of scores.")
    _z(level)
    rng = np.random.default_rng(seed)
    total = np.zeros(n_resamples)
    for name in sorted(groups):  # a fixed order of draws: the interval does not depend on the mapping's order
        data = np.asarray(groups[name], dtype=np.float64)
        if data.ndim != 1 or data.size == 0:
            raise ValueError(f"The group {name!r} must hold a non-empty list of scores, got shape {data.shape}.")
        total += data[rng.integers(0, data.size, size=(n_resamples, data.size))].mean(axis=1)  # (R,)
    return _percentiles(total / len(groups), level)


def is_binary(scores: Sequence[float], full: float = 100.0) -> bool:
    """True when every score is 0 or ``full``: the task's mean is a proportion."""
    return all(s == 0.0 or s == full for s in scores)


def task_interval(scores: Sequence[float], level: float = LEVEL) -> tuple[tuple[float, float], str]:
    """The interval of one task's mean score (percent) and the method used: ``"wilson"`` when every sample
    scored 0 or 100, else ``"bootstrap"``.

    Parameters
    ----------
    scores : ``(n,)`` per-sample scores in percent (n >= 1).

    Returns
    -------
    ((low, high) in percent, method).
    """
    if not len(scores):
        raise ValueError("scores must hold at least one sample's score.")
    if is_binary(scores):
        low, high = wilson_interval(sum(s == 100.0 for s in scores), len(scores), level)
        return (100.0 * low, 100.0 * high), "wilson"
    return bootstrap_interval(scores, level), "bootstrap"


def run_intervals(scores_by_task: Mapping[str, Sequence[float]], level: float = LEVEL) -> dict:
    """Every interval of a run, as written to its ``metrics.json``.

    Parameters
    ----------
    scores_by_task : task -> ``(n_task,)`` per-sample scores in percent (tasks without samples left out).

    Returns
    -------
    dict with ``score_ci`` ([low, high] of the mean over tasks), ``score_ci_method`` (``"wilson"`` when every
    task is a proportion over the same number of samples, else ``"bootstrap"``: stratified by task),
    ``tasks_ci`` (task -> [low, high]), ``ci_method`` (task -> ``"wilson"`` or ``"bootstrap"``) and ``ci``
    (level, resamples, seed).
    """
    if not scores_by_task:
        raise ValueError("scores_by_task must hold at least one task's scores.")
    tasks_ci, methods = {}, {}
    for task, scores in scores_by_task.items():
        interval, methods[task] = task_interval(scores, level)
        tasks_ci[task] = list(interval)
    sizes = {len(scores) for scores in scores_by_task.values()}
    if set(methods.values()) == {"wilson"} and len(sizes) == 1:
        # Equal task sizes: the mean of the task proportions is the proportion of all samples.
        pooled = [s for scores in scores_by_task.values() for s in scores]
        low, high = wilson_interval(sum(s == 100.0 for s in pooled), len(pooled), level)
        score_ci, score_method = [100.0 * low, 100.0 * high], "wilson"
    else:
        score_ci, score_method = list(stratified_bootstrap_interval(scores_by_task, level)), "bootstrap"
    return {
        "score_ci": score_ci,
        "score_ci_method": score_method,
        "tasks_ci": tasks_ci,
        "ci_method": methods,
        "ci": {"level": level, "bootstrap_resamples": N_RESAMPLES, "seed": SEED},
    }


def paired_difference(
    a: Mapping[str, Mapping[str, float]],
    b: Mapping[str, Mapping[str, float]],
    level: float = LEVEL,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> dict:
    """The score difference ``a - b`` of two runs over the samples both answered, with a paired bootstrap interval.

    Two runs of one benchmark answer the same samples, and most samples get the same score from both: what varies
    is each sample's difference. Resampling those differences (stratified by task, as :func:`run_intervals` does)
    gives the interval of the difference itself, much narrower than the gap two runs' own intervals leave, and
    the right test of "is a better than b": the difference is resolved when its interval excludes 0.

    Parameters
    ----------
    a, b : task -> sample id -> score in percent. Samples found in one run only are left out (and counted).
    level, n_resamples, seed : confidence level, resamples, seed of the generator.

    Returns
    -------
    dict with ``difference`` (mean over tasks of the per-task mean difference, in points), ``interval``
    ([low, high]), ``n`` (paired samples), ``unpaired`` (samples of one run only) and ``tasks`` (task ->
    ``{"difference", "interval", "n"}``).
    """
    diffs: dict[str, list[float]] = {}
    unpaired = 0
    for task in sorted(set(a) | set(b)):
        ours, theirs = a.get(task, {}), b.get(task, {})
        common = sorted(set(ours) & set(theirs))
        unpaired += len(set(ours) ^ set(theirs))
        if common:
            diffs[task] = [float(ours[i]) - float(theirs[i]) for i in common]
    if not diffs:
        raise ValueError("The two runs share no sample (same task and id): they cannot be compared pairwise.")
    tasks = {
        task: {
            "difference": float(np.mean(d)),
            "interval": list(bootstrap_interval(d, level, n_resamples, seed)),
            "n": len(d),
        }
        for task, d in diffs.items()
    }
    return {
        "difference": float(np.mean([t["difference"] for t in tasks.values()])),
        "interval": list(stratified_bootstrap_interval(diffs, level, n_resamples, seed)),
        "n": sum(len(d) for d in diffs.values()),
        "unpaired": unpaired,
        "tasks": tasks,
    }
