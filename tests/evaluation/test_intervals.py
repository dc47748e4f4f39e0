"""95% intervals of the evaluation's scores: Wilson against hand-computed values, the bootstraps, the run record."""

import math

import numpy as np
import pytest

from evaluation.intervals import (
    bootstrap_interval,
    is_binary,
    paired_difference,
    run_intervals,
    stratified_bootstrap_interval,
    task_interval,
    wilson_interval,
)

Z = 1.959963984540054  # the 0.975 quantile of the standard normal


@pytest.mark.parametrize(
    ("successes", "n", "expected"),
    [
        # 0/n: [0, z^2 / (n + z^2)] = [0, 3.8415 / 13.8415]
        (0, 10, (0.0, 0.277533)),
        # 5/10: 0.5 -/+ (z / 1.38415) * sqrt(0.025 + 0.009604) = 0.5 -/+ 0.263407
        (5, 10, (0.236593, 0.763407)),
        # n/n mirrors 0/n
        (10, 10, (0.722467, 1.0)),
        # 27/40: center (0.675 + 0.048019) / 1.096039 = 0.659666, half 1.788224 * sqrt(0.005484 + 0.000600)
        (27, 40, (0.520177, 0.799155)),
    ],
)
def test_wilson_matches_hand_computed_values(successes, n, expected):
    low, high = wilson_interval(successes, n)
    assert low == pytest.approx(expected[0], abs=1e-6) and high == pytest.approx(expected[1], abs=1e-6)


@pytest.mark.parametrize(("successes", "n"), [(1, 3), (5, 10), (27, 40), (39, 40)])
def test_wilson_bounds_are_where_the_score_test_is_on_the_edge(successes, n):
    """Each bound p solves (s/n - p)^2 = z^2 p (1 - p) / n: the share is exactly z standard errors away."""
    share = successes / n
    for bound in wilson_interval(successes, n):
        assert (share - bound) ** 2 == pytest.approx(Z * Z * bound * (1 - bound) / n, abs=1e-12)


def test_wilson_refuses_bad_counts():
    with pytest.raises(ValueError, match="n must be a positive number"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match=r"successes must be in \[0, n\] = \[0, 4\], got 5"):
        wilson_interval(5, 4)
    with pytest.raises(TypeError, match="must be integers"):
        wilson_interval(1.5, 4)
    with pytest.raises(ValueError, match="level must be in"):
        wilson_interval(1, 4, level=1.0)


def test_bootstrap_is_seeded_and_brackets_the_mean():
    values = [0.0, 25.0, 50.0, 75.0, 100.0, 100.0, 40.0, 60.0]
    low, high = bootstrap_interval(values)
    assert (low, high) == bootstrap_interval(values)  # same scores, same interval
    assert low < np.mean(values) < high and 0.0 <= low and high <= 100.0
    # 2000 resamples of a mean: close to the normal interval mean -/+ 1.96 s / sqrt(n) (s with divisor n).
    half = Z * np.std(values) / math.sqrt(len(values))
    assert high - low == pytest.approx(2 * half, rel=0.1)
    assert bootstrap_interval([30.0] * 5) == (30.0, 30.0)  # nothing varies: a single point
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_interval([])


def test_stratified_bootstrap_keeps_each_task_apart():
    # Task a always scores 100, task b always 0: every resample's mean over tasks is 50 exactly.
    assert stratified_bootstrap_interval({"a": [100.0] * 3, "b": [0.0] * 7}) == (50.0, 50.0)
    groups = {"a": [0.0, 50.0, 100.0, 100.0], "b": [20.0, 40.0]}
    low, high = stratified_bootstrap_interval(groups)
    assert low < (62.5 + 30.0) / 2 < high
    assert stratified_bootstrap_interval(dict(reversed(groups.items()))) == (low, high)  # order does not matter
    with pytest.raises(ValueError, match="'b' must hold a non-empty list"):
        stratified_bootstrap_interval({"a": [1.0], "b": []})


def test_task_and_run_intervals_pick_their_method():
    assert is_binary([0.0, 100.0, 100.0]) and not is_binary([0.0, 50.0])
    interval, method = task_interval([100.0] * 5 + [0.0] * 5)
    assert method == "wilson" and interval == pytest.approx((23.659309, 76.340691), abs=1e-5)
    assert task_interval([0.0, 25.0, 100.0])[1] == "bootstrap"

    # Proportions over equal task sizes: the run's mean is the pooled proportion, 27/40.
    record = run_intervals({"a": [100.0] * 15 + [0.0] * 5, "b": [100.0] * 12 + [0.0] * 8})
    assert record["score_ci_method"] == "wilson"
    assert record["score_ci"] == pytest.approx([52.0177, 79.9155], abs=1e-3)
    assert record["ci_method"] == {"a": "wilson", "b": "wilson"} and set(record["tasks_ci"]) == {"a", "b"}
    assert record["ci"] == {"level": 0.95, "bootstrap_resamples": 2000, "seed": 0}
    # Unequal sizes or partial credit: the stratified bootstrap.
    assert run_intervals({"a": [100.0, 0.0], "b": [100.0, 0.0, 0.0]})["score_ci_method"] == "bootstrap"
    mixed = run_intervals({"a": [100.0, 0.0], "b": [50.0, 0.0]})
    assert mixed["score_ci_method"] == "bootstrap" and mixed["ci_method"] == {"a": "wilson", "b": "bootstrap"}


def test_paired_difference_resamples_the_per_sample_differences():
    # 40 samples per task; run a answers 4 more of task x than b, and the same otherwise.
    b = {"x": {str(i): 100.0 if i < 20 else 0.0 for i in range(40)}, "y": {str(i): 100.0 * (i % 2) for i in range(40)}}
    a = {"x": {**b["x"], **{str(i): 100.0 for i in range(20, 24)}}, "y": dict(b["y"])}
    result = paired_difference(a, b)
    assert result["tasks"]["x"]["difference"] == pytest.approx(10.0)
    assert result["tasks"]["y"] == {"difference": 0.0, "interval": [0.0, 0.0], "n": 40}  # same answers: no spread
    assert result["difference"] == pytest.approx(5.0)  # mean over tasks
    assert result["n"] == 80 and result["unpaired"] == 0
    low, high = result["interval"]
    assert 0.0 < low < 5.0 < high  # 4 of 80 samples differ, all one way: resolved
    # The two runs' own intervals (50 [35.2, 64.8] against 60 [44.6, 73.7] on task x) overlap widely; the paired
    # interval is the narrower test.
    own_b, own_a = run_intervals({"x": list(b["x"].values())}), run_intervals({"x": list(a["x"].values())})
    assert own_a["score_ci"][0] < own_b["score_ci"][1]
    x_low, x_high = result["tasks"]["x"]["interval"]
    assert x_low > 0 and x_high - x_low < own_a["score_ci"][1] - own_a["score_ci"][0]
    # Swapping the runs flips the sign.
    swapped = paired_difference(b, a)
    assert swapped["difference"] == pytest.approx(-5.0)
    assert swapped["interval"] == pytest.approx([-high, -low])


def test_paired_difference_pairs_by_id_and_counts_the_rest():
    a = {"x": {"1": 100.0, "2": 0.0, "3": 100.0}, "z": {"9": 100.0}}
    b = {"x": {"2": 100.0, "3": 100.0, "4": 0.0}}
    result = paired_difference(a, b)
    assert set(result["tasks"]) == {"x"} and result["n"] == 2  # ids 2 and 3 of task x
    assert result["unpaired"] == 3  # x/1, x/4 and z/9
    assert result["difference"] == pytest.approx(-50.0)
    with pytest.raises(ValueError, match="share no sample"):
        paired_difference({"x": {"1": 100.0}}, {"x": {"2": 100.0}})
