"""How alike surrogates rank the pairs of a collection, layer by layer: for every pair of surrogates, the share of
one's kept set the other keeps when each head keeps its top ``--keep`` of the pairs (a per-head quantile, so what is
compared is the ranking, not where the threshold falls), and the same against the KVzip+ targets. Printed per band
of layers and written as JSON.

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

BANDS = {"0-6": range(0, 7), "7-14": range(7, 15), "15-29": range(15, 30)}


@torch.no_grad()
def predict(directory: str, X: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """``(N, L, H)`` predicted log-scores of the surrogate saved in ``directory``."""
    surrogate = KVzapSurrogate.from_pretrained(directory).eval()
    return torch.cat([surrogate.forward_all(X[i : i + chunk].float()) for i in range(0, len(X), chunk)])


def kept(scores: torch.Tensor, keep: float) -> torch.Tensor:
    """Boolean ``(N, L, H)``: the pairs at or above each (layer, head)'s ``1 - keep`` quantile."""
    cut = torch.quantile(scores.float(), 1.0 - keep, dim=0, keepdim=True)
    return scores >= cut


def overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(L,)``: per layer, the mean over heads of the share of ``a``'s kept pairs that ``b`` keeps too."""
    return ((a & b).sum(0).float() / a.sum(0).clamp(min=1).float()).mean(-1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collection", required=True, help="a finished `collect` folder (e.g. its test split)")
    parser.add_argument("--keep", type=float, default=0.25, help="share of each head's pairs kept (default 0.25)")
    parser.add_argument("--out", required=True)
    parser.add_argument("surrogates", nargs="+", help="NAME=DIR")
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y, _ = load_collection(args.collection)
    sets = {"oracle": kept(y, args.keep)}
    for item in args.surrogates:
        name, directory = item.split("=", 1)
        sets[name] = kept(predict(directory, X), args.keep)
    report = {"collection": args.collection, "keep": args.keep, "n_pairs": int(X.shape[0]), "pairs": {}}
    for a, b in itertools.combinations(sets, 2):
        per_layer = overlap(sets[a], sets[b])
        bands = {band: round(float(per_layer[list(layers)].mean()), 4) for band, layers in BANDS.items()}
        report["pairs"][f"{a}~{b}"] = {"bands": bands, "per_layer": [round(float(v), 4) for v in per_layer]}
        print(f"{a:>8} ~ {b:<8}", "  ".join(f"{band} {value:.3f}" for band, value in bands.items()))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
