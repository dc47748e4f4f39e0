"""Where each surrogate's evictions fall: the evicted share per layer and KV head on the 2k needle suite.

At matched overall eviction, two surrogates can still spend it in different layers and heads. This script runs the
prefill of each needle sample under each surrogate's press (as ``match_eviction.py`` does) and keeps the press's
``head_compression_ratios`` (the share of each layer's and KV head's pairs evicted), per sample.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/allocation/allocation.py --seed 2 --out OUT.json \\
        B=bundled:-3 BHGpref=outputs/ens/BHGpref/mlp:-3.07
"""

import argparse
import importlib.util
import json
from pathlib import Path

# The prefill under a press and the needle samples are match_eviction.py's (a script, not a package: loaded by path).
_spec = importlib.util.spec_from_file_location("match_eviction", Path(__file__).parents[1] / "match_eviction.py")
match_eviction = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(match_eviction)


def parse_arm(text: str) -> tuple[str, str | None, float]:
    name, rest = text.split("=", 1)
    surrogate, threshold = rest.rsplit(":", 1)
    return name, None if surrogate == "bundled" else surrogate, float(threshold)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arms", nargs="+", help="NAME=DIR:THRESHOLD (DIR 'bundled' for the bundled MLP)")
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--n-samples", type=int, default=40)
    parser.add_argument("--tasks", nargs="+", default=match_eviction.TASKS)
    parser.add_argument("--every", type=int, default=1, help="keep every k-th sample (as match_eviction.py: 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pipe = match_eviction.load_pipeline(args.threads)
    samples = match_eviction.needle_samples(pipe, args.tasks, args.length, args.n_samples, args.seed, args.every)
    arms = [parse_arm(a) for a in args.arms]
    result = {"seed": args.seed, "length": args.length, "every": args.every, "arms": {}, "samples": []}
    for name, surrogate, threshold in arms:
        result["arms"][name] = {"surrogate": surrogate or "bundled", "threshold": threshold}
    for i, sample in enumerate(samples):
        row = {"task": sample["task"], "id": sample["id"], "heads": {}}
        for name, surrogate, threshold in arms:
            press = match_eviction.prefill(pipe, sample, threshold, surrogate)
            row["heads"][name] = [[round(float(v), 5) for v in layer] for layer in press.head_compression_ratios]
        result["samples"].append(row)
        if i % 10 == 0:
            print(i, sample["task"], sample["id"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f)
