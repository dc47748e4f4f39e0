"""Tabulate ``allocation.py``'s output: evicted share per layer (mean over KV heads and samples) for each arm, the
difference of each arm to the first, and the same on a chosen subset of samples.

    python train/results/smollm2-135m-ensemble/allocation/summarize.py OUT.json [--ids niah_multikey-2048-2 ...]
"""

import argparse
import json

import torch

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--ids", nargs="*", default=None, help="restrict to these sample ids")
    args = parser.parse_args()
    data = json.load(open(args.path))
    samples = [s for s in data["samples"] if not args.ids or s["id"] in args.ids]
    names = list(data["arms"])
    heads = {n: torch.tensor([s["heads"][n] for s in samples]) for n in names}  # (samples, layers, heads)
    first = names[0]
    print(f"{len(samples)} samples; arms: " + ", ".join(f"{n} {data['arms'][n]}" for n in names))
    print("overall evicted: " + ", ".join(f"{n} {heads[n].mean():.4f}" for n in names))
    print("layer | " + " | ".join(names) + " | " + " | ".join(f"{n}-{first}" for n in names[1:]))
    for layer in range(heads[first].shape[1]):
        vals = [float(heads[n][:, layer].mean()) for n in names]
        diffs = [v - vals[0] for v in vals[1:]]
        print(f"{layer:2d} | " + " | ".join(f"{v:.3f}" for v in vals) + " | " + " | ".join(f"{d:+.3f}" for d in diffs))
    for n in names[1:]:
        d = (heads[n] - heads[first]).mean(0)  # (layers, heads)
        flat = d.flatten()
        order = flat.abs().argsort(descending=True)[:8]
        top = ", ".join(f"L{int(i) // d.shape[1]}h{int(i) % d.shape[1]} {float(flat[i]):+.3f}" for i in order)
        print(f"{n}-{first}: mean |diff| per head {float(flat.abs().mean()):.4f}; largest: {top}")
