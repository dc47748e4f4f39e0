"""How far can ONE linear map of the hidden state go on each kind of text? Bounds measured on the held-out pairs.

For each layer and KV head, an ordinary least-squares map (with an intercept and a 1e-3 ridge, relative to the
mean diagonal) from the hidden state to the log KVzip+ score, fitted on held-out collections themselves:

- ``in_kind``: fitted on one kind's pairs and scored on them (in-sample) and 3-fold by prompt (squared Pearson,
  the project's R^2, and 1 - SSE/SST).
- ``pooled``: ONE map fitted on the union of the kinds named, scored per kind on the very pairs it was fitted on
  (optimistic: a linear surrogate trained on other prompts can only do worse on these pairs, up to the ridge);
  also without math, and with ``--boost KIND W`` that kind's pairs weighted W in the least squares (without math).

R^2 is averaged over layers and heads, as everywhere in `train/`.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/linear_bounds.py --out OUT.json \\
        math=outputs/collect_math/test dialogue=outputs/collect_dialogue/test ...
"""

import argparse
import json
from pathlib import Path

import torch

from train.collect import load_collections
from train.fit import pearson_r2


def least_squares(
    X: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``(D + 1, H)`` weights (last row the intercept) minimising ``sum_i weight_i |[x_i 1] W - y_i|^2`` plus
    ``ridge * mean diag * |W|^2``."""
    Xa = torch.cat([X, torch.ones(len(X), 1, dtype=X.dtype)], dim=1)
    Xw = Xa if weight is None else Xa * weight[:, None]
    gram = Xw.T @ Xa
    gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=X.dtype)
    return torch.linalg.solve(gram, Xw.T @ y)


def predict(X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return X @ W[:-1] + W[-1]


def explained(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - SSE / SST per column."""
    return 1 - (target - prediction).square().sum(0) / (target - target.mean(0)).square().sum(0)


def in_kind(X: torch.Tensor, y: torch.Tensor, prompt_index: torch.Tensor, folds: int = 3) -> dict:
    prompts = prompt_index.unique()
    in_sample, cv_pearson, cv_explained = [], [], []
    for layer in range(X.shape[1]):
        Xl, yl = X[:, layer].double(), y[:, layer].double()
        in_sample.append(pearson_r2(predict(Xl, least_squares(Xl, yl)), yl))
        prediction = torch.empty_like(yl)
        for k in range(folds):
            test = torch.isin(prompt_index, prompts[k::folds])
            prediction[test] = predict(Xl[test], least_squares(Xl[~test], yl[~test]))
        cv_pearson.append(pearson_r2(prediction, yl))
        cv_explained.append(explained(prediction, yl))
    return {
        "in_sample": torch.stack(in_sample).mean().item(),
        "cv_by_prompt": torch.stack(cv_pearson).mean().item(),
        "cv_by_prompt_1_minus_sse_sst": torch.stack(cv_explained).mean().item(),
        "pairs": len(X),
        "prompts": len(prompts),
    }


def pooled(data: dict[str, tuple[torch.Tensor, torch.Tensor]], boost: tuple[str, float] | None = None) -> dict:
    sizes = [len(X) for X, _ in data.values()]
    weight = None
    if boost is not None:
        weight = torch.cat(
            [torch.full((n,), boost[1] if k == boost[0] else 1.0) for k, n in zip(data, sizes, strict=True)]
        )
    X = torch.cat([X for X, _ in data.values()])
    y = torch.cat([y for _, y in data.values()])
    per_kind = {kind: [] for kind in data}
    for layer in range(X.shape[1]):
        Xl, yl = X[:, layer].double(), y[:, layer].double()
        prediction = predict(Xl, least_squares(Xl, yl, weight=None if weight is None else weight.double()))
        for kind, p, t in zip(data, prediction.split(sizes), yl.split(sizes), strict=True):
            per_kind[kind].append(pearson_r2(p, t))
    return {
        "kinds": list(data),
        "boost": boost,
        "pairs": len(X),
        **{k: torch.stack(v).mean().item() for k, v in per_kind.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("collections", nargs="+", metavar="KIND=DIR", help="Held-out collection split per kind.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--boost", nargs=2, action="append", default=[], metavar=("KIND", "W"))
    args = parser.parse_args()
    kinds = dict(item.split("=", 1) for item in args.collections)
    everything, result = {}, {"in_kind": {}, "pooled": []}
    for kind, directory in kinds.items():
        X, y, (manifest,) = load_collections([directory])
        everything[kind] = (X, y)
        result["in_kind"][kind] = in_kind(X, y, manifest["prompt_index"])
        print(kind, result["in_kind"][kind], flush=True)
    result["pooled"].append(pooled(everything))
    print("pooled", result["pooled"][-1], flush=True)
    if "math" in everything:
        result["pooled"].append(pooled({k: v for k, v in everything.items() if k != "math"}))
        print("pooled without math", result["pooled"][-1], flush=True)
    for kind, w in args.boost:
        others = {k: v for k, v in everything.items() if k != "math"}
        result["pooled"].append(pooled(others, (kind, float(w))))
        print(f"pooled without math, {kind} x{w}", result["pooled"][-1], flush=True)
    args.out.write_text(json.dumps(result, indent=1))
