"""A surrogate made of two: the modules of ``--base`` in every layer but those named, where ``--donor``'s are used.

Used to find which layers' scores decide a needle result (a bisection over layers). The donor's output bias is
shifted by ``--donor-shift`` (its threshold minus the base's) so that one press threshold serves both. MLPs of
different widths are padded to the wider with zero units (a zero unit adds gelu(0) * 0 = 0: the same predictions).
``--donor-weight W`` below 1 blends instead of replacing: in the named layers the prediction is W * donor + (1 - W) *
base, exactly (those layers are taken from ``train.ensemble.average_surrogates`` of the two).

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/allocation/hybrid.py --base outputs/ens/HGpref/mlp \\
        --donor kvzap/surrogates/bundled/SmolLM2-135M-Instruct/mlp --donor-shift -0.08 --layers 0-14 --out OUT
"""

import argparse
import json

import torch

from kvzap.surrogates.kvzap_surrogate import KVzapSurrogate
from train.ensemble import average_surrogates


def parse_layers(text: str) -> list[int]:
    layers = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers += list(range(int(first), int(last or first) + 1))
    return sorted(set(layers))


def padded(state: dict, i: int, width: int) -> dict:
    w1, b1, w2 = state[f"layers.{i}.0.weight"], state[f"layers.{i}.0.bias"], state[f"layers.{i}.2.weight"]
    extra = width - w1.shape[0]
    return {
        f"layers.{i}.0.weight": torch.cat([w1, w1.new_zeros(extra, w1.shape[1])]),
        f"layers.{i}.0.bias": torch.cat([b1, b1.new_zeros(extra)]),
        f"layers.{i}.2.weight": torch.cat([w2, w2.new_zeros(w2.shape[0], extra)], dim=1),
        f"layers.{i}.2.bias": state[f"layers.{i}.2.bias"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--donor", required=True)
    parser.add_argument("--donor-shift", type=float, default=0.0)
    parser.add_argument("--donor-weight", type=float, default=1.0, help="donor's share in its layers (default 1)")
    parser.add_argument("--layers", required=True, help="donor layers, e.g. 0-14 or 3,7,20-22")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    base = KVzapSurrogate.from_pretrained(args.base, local_files_only=True).float()
    donor = KVzapSurrogate.from_pretrained(args.donor, local_files_only=True).float()
    if base.hidden_dim is None or donor.hidden_dim is None or base.n_modules != donor.n_modules:
        raise SystemExit("Both surrogates must be MLPs for the same model.")
    if not 0.0 < args.donor_weight <= 1.0:
        raise SystemExit(f"--donor-weight must be in (0, 1], got {args.donor_weight}.")
    layers = parse_layers(args.layers)
    with torch.no_grad():
        for module in donor.layers:
            module[2].bias += args.donor_shift
    if args.donor_weight < 1.0:  # the donor layers come from the weighted mean of the two
        donor = average_surrogates([base, donor], weights=[1.0 - args.donor_weight, args.donor_weight])
    width = max(base.hidden_dim, donor.hidden_dim)
    states = {"base": base.state_dict(), "donor": donor.state_dict()}
    merged = KVzapSurrogate(base.input_dim, base.output_dim, base.n_modules, hidden_dim=width)
    state = {}
    for i in range(base.n_modules):
        state.update(padded(states["donor" if i in layers else "base"], i, width))
    merged.load_state_dict(state)
    out = merged.eval().save_pretrained(args.out)
    record = {
        "base": args.base,
        "donor": args.donor,
        "donor_shift": args.donor_shift,
        "donor_weight": args.donor_weight,
        "donor_layers": layers,
    }
    (out / "hybrid.json").write_text(json.dumps(record, indent=2) + "\n")
    print(record)
