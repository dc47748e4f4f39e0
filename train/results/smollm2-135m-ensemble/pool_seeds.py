"""Paired difference A - B of two surrogates' needle runs, pooled over two seeds (400 samples instead of 200).

`python -m evaluation compare` pairs two runs of the same samples and refuses runs of different seeds (their sample
ids coincide). This pools each surrogate's seed-0 and seed-1 runs, keying every sample by seed and id, and
bootstraps the difference with `evaluation.intervals.paired_difference` (stratified by task).

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/pool_seeds.py A_SEED0 A_SEED1 B_SEED0 B_SEED1
"""

import argparse
import csv
from pathlib import Path

from evaluation.intervals import paired_difference


def load(run: Path, seed: int) -> dict[str, dict[str, float]]:
    """task -> "seed:id" -> score of one run's ``predictions.csv``."""
    scores: dict[str, dict[str, float]] = {}
    with open(run / "predictions.csv", newline="") as f:
        for row in csv.DictReader(f):
            scores.setdefault(row["task"], {})[f"{seed}:{row['id']}"] = float(row["score"])
    return scores


def pooled(seed0: Path, seed1: Path) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = {}
    for seed, run in enumerate((seed0, seed1)):
        for task, scores in load(run, seed).items():
            merged.setdefault(task, {}).update(scores)
    return merged


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs=4, metavar="RUN", help="A seed 0, A seed 1, B seed 0, B seed 1.")
    args = parser.parse_args()
    result = paired_difference(pooled(*args.runs[:2]), pooled(*args.runs[2:]))
    low, high = result["interval"]
    print(f"A - B: {result['difference']:+.2f} [{low:+.2f}, {high:+.2f}], {result['n']} paired samples")
    for task, row in result["tasks"].items():
        print(f"  {task}: {row['difference']:+.2f} [{row['interval'][0]:+.2f}, {row['interval'][1]:+.2f}]")
