"""Compare the harness's per-sample predictions and scores with `kvzap evaluate`'s (run.sh's two runs)."""

import csv
import json
import sys
from pathlib import Path

root = Path(sys.argv[1])
evaluate = {}
for file in (root / "evaluate").rglob("predictions.csv"):
    with file.open(encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            evaluate[row["id"]] = (row["prediction"], float(row["score"]))
harness = {}
for file in (root / "harness").rglob("samples_*.jsonl"):
    for line in file.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        harness[sample["doc"]["id"]] = (sample["resps"][0][0], float(sample["score"]))
shared = sorted(set(evaluate) & set(harness))
same_prediction = sum(evaluate[i][0] == harness[i][0] for i in shared)
same_score = sum(abs(evaluate[i][1] - harness[i][1]) < 1e-9 for i in shared)
print(f"samples: evaluate {len(evaluate)}, harness {len(harness)}, shared {len(shared)}")
print(f"same prediction: {same_prediction}/{len(shared)}   same score: {same_score}/{len(shared)}")
print(
    f"mean score: evaluate {sum(evaluate[i][1] for i in shared) / max(1, len(shared)):.2f}, "
    f"harness {sum(harness[i][1] for i in shared) / max(1, len(shared)):.2f}"
)
