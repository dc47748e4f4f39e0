"""Shift a surrogate's output bias per layer and KV head so that, at its threshold, each head evicts the share of
pairs a reference surrogate evicts at the reference threshold, on the texts of a collection.

Pearson R^2 is blind to a constant added to a head's predictions, so the shifted surrogate keeps every R^2 of the
original: only where the press spends its evictions (which layers and heads) moves, onto the reference's.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/allocation/match_allocation.py \\
        --collection outputs/alloc_collect/test --reference kvzap/surrogates/bundled/SmolLM2-135M-Instruct/mlp:-3 \\
        --surrogate outputs/ens/HGpref/mlp:-3.08 --out outputs/HGpref_alloc/mlp
"""

import argparse
import hashlib
import json
from pathlib import Path

import torch

from kvzap.surrogates.kvzap_surrogate import KVzapSurrogate
from train.collect import load_collection
from train.fit import predict_all


def split(text: str) -> tuple[Path, float]:
    path, threshold = text.rsplit(":", 1)
    return Path(path), float(threshold)


def scores(surrogate: KVzapSurrogate, X: torch.Tensor) -> torch.Tensor:
    return predict_all(surrogate, X, batch_size=8192)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collection", required=True, help="a finished `collect` folder (its hidden states are used)")
    parser.add_argument("--reference", required=True, help="DIR:THRESHOLD of the surrogate whose allocation to copy")
    parser.add_argument("--surrogate", required=True, help="DIR:THRESHOLD of the surrogate to shift")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ref_dir, ref_tau = split(args.reference)
    sur_dir, sur_tau = split(args.surrogate)
    X, _, manifest = load_collection(args.collection)
    ref = KVzapSurrogate.from_pretrained(ref_dir, local_files_only=True).float().eval()
    sur = KVzapSurrogate.from_pretrained(sur_dir, local_files_only=True).float().eval()
    s_ref, s_sur = scores(ref, X), scores(sur, X)  # (N, L, H)
    share_ref = (s_ref < ref_tau).float().mean(0)  # (L, H)
    share_before = (s_sur < sur_tau).float().mean(0)
    # The shift puts the surrogate's share_ref-quantile of each head on its threshold.
    quantiles = torch.stack(
        [
            torch.stack([torch.quantile(s_sur[:, j, h], float(share_ref[j, h])) for h in range(s_sur.shape[2])])
            for j in range(s_sur.shape[1])
        ]
    )
    offsets = sur_tau - quantiles  # (L, H)
    state = {k: v.clone() for k, v in sur.state_dict().items()}
    for j, i in enumerate(sur.trained_layers):
        key = f"layers.{i}.2.bias" if sur.hidden_dim is not None else f"layers.{i}.bias"
        state[key] += offsets[j]
    sur.load_state_dict(state)
    share_after = (scores(sur, X) < sur_tau).float().mean(0)
    out = sur.save_pretrained(args.out)
    record = {
        "collection": args.collection,
        "pairs": len(X),
        "reference": {"path": str(ref_dir), "threshold": ref_tau},
        "surrogate": {
            "path": str(sur_dir),
            "threshold": sur_tau,
            "sha256": hashlib.sha256((sur_dir / "model.safetensors").read_bytes()).hexdigest(),
        },
        "offsets": [[round(float(v), 4) for v in row] for row in offsets],
        "evicted_reference": round(float(share_ref.mean()), 4),
        "evicted_before": round(float(share_before.mean()), 4),
        "evicted_after": round(float(share_after.mean()), 4),
        "max_abs_head_gap_before": round(float((share_before - share_ref).abs().max()), 4),
        "max_abs_head_gap_after": round(float((share_after - share_ref).abs().max()), 4),
    }
    (out / "allocation.json").write_text(json.dumps(record, indent=2) + "\n")
    print({k: v for k, v in record.items() if k != "offsets"})
