"""How alike surrogates rank the pairs of a collection, layer by layer: for every pair of surrogates, the share of
their kept sets in common when each head keeps its top ``--keep`` of the pairs (``train.fit.kept_overlap``'s
per-head rule, so what is compared is the ranking, not where the threshold falls), and the same against the KVzip+
targets. Printed per band of layers and written as JSON.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/recipe/agreement.py \\
        --collection outputs/needle_collect/test --out agreement.json \\
        B=kvzap/surrogates/bundled/SmolLM2-135M-Instruct/mlp R=outputs/s34/fitR/mlp ...
"""

import argparse
import itertools
import json

import torch

from kvzap.surrogates.kvzap_surrogate import KVzapSurrogate
from train.collect import load_collection
from train.fit import kept_overlap, predict_all

BANDS = {"0-6": range(0, 7), "7-14": range(7, 15), "15-29": range(15, 30)}


def per_layer_overlap(a: torch.Tensor, b: torch.Tensor, keep: float) -> torch.Tensor:
    """``(L,)``: per layer, the mean over heads of the share of the top ``keep`` pairs of ``a`` and ``b`` in common."""
    overlap = kept_overlap(a, b, evictions=[1.0 - keep])["per_head"]
    return torch.tensor(next(iter(overlap.values()))["per_layer"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collection", required=True, help="a finished `collect` folder (e.g. its test split)")
    parser.add_argument("--keep", type=float, default=0.25, help="share of each head's pairs kept (default 0.25)")
    parser.add_argument("--out", required=True)
    parser.add_argument("surrogates", nargs="+", help="NAME=DIR")
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y, _ = load_collection(args.collection)
    sets = {"oracle": y.float()}
    for item in args.surrogates:
        name, directory = item.split("=", 1)
        sets[name] = predict_all(KVzapSurrogate.from_pretrained(directory).eval(), X)
    report = {"collection": args.collection, "keep": args.keep, "n_pairs": int(X.shape[0]), "pairs": {}}
    for a, b in itertools.combinations(sets, 2):
        per_layer = per_layer_overlap(sets[a], sets[b], args.keep)
        bands = {band: round(float(per_layer[list(layers)].mean()), 4) for band, layers in BANDS.items()}
        report["pairs"][f"{a}~{b}"] = {"bands": bands, "per_layer": [round(float(v), 4) for v in per_layer]}
        print(f"{a:>8} ~ {b:<8}", "  ".join(f"{band} {value:.3f}" for band, value in bands.items()))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
