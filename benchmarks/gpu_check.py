"""Correctness of the compact cache on a GPU: compact vs masked storage, same decisions, same logits.

The test suite checks this on CPU for every supported family; this script repeats the check on a CUDA device
(tiny models of each family, batch 1 and 2, prefill + a multi-token question + greedy decoding with
decoding-time pruning), plus a SmolLM2-135M-sized random Llama at 4k tokens, and writes a JSON report.

    python -m benchmarks.gpu_check --device cuda --json benchmarks/results/gpu_check.json

Exits with status 1 when any comparison disagrees (different kept counts, or logits apart by 1e-3 or more).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import DynamicCache

from benchmarks.common import load, meta, write_results
from kvzap import _compat
from kvzap.compact import CompactLayer
from kvzap.layers import prunable_layers
from kvzap.presses import DMSThresholdPress, RandomScorer
from tests.conftest import random_ids, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma3_text"]


@torch.no_grad()
def run_steps(model, storage, ids, question, n_decode, threshold, window):
    press = DMSThresholdPress(
        RandomScorer(seed=0), threshold=threshold, sliding_window_size=window, decoding=True, storage=storage
    )
    cache = DynamicCache(config=model.config)
    kw = _compat.cache_kwarg_name(model)
    logits = []
    with press(model):
        logits.append(model(ids, **{kw: cache}).logits[:, -8:].float())
        logits.append(model(question, **{kw: cache}).logits.float())
        for _ in range(n_decode):
            logits.append(model(logits[-1][:, -1:].argmax(-1), **{kw: cache}).logits.float())
    # The layers the press prunes (sliding-window layers are left alone by default and keep transformers' class).
    kept = torch.stack([cache.layers[i].kept_counts() for i in prunable_layers(model)]).cpu()
    return logits, kept, press.compression_ratio, cache


def compare(model, device, batch, prefill, question, n_decode, threshold=0.0, window=4):
    ids = random_ids(batch, prefill, seed=1, vocab=model.config.vocab_size).to(device)
    q = random_ids(batch, question, seed=2, vocab=model.config.vocab_size).to(device)
    masked = run_steps(model, "masked", ids, q, n_decode, threshold, window)
    compact = run_steps(model, "compact", ids, q, n_decode, threshold, window)
    diff = max(float((a - b).abs().max()) for a, b in zip(masked[0], compact[0], strict=True))
    return {
        "batch": batch,
        "prefill": prefill,
        "compression_ratio": compact[2],
        "same_kept_counts": bool(torch.equal(masked[1], compact[1])),
        "compact_layers": sum(isinstance(layer, CompactLayer) for layer in compact[3].layers),
        "max_abs_logit_diff": diff,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the SmolLM2-sized model")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for family in FAMILIES:
        model = tiny_model(family).to(device)
        for batch in (1, 2):
            row = {"model": f"tiny {family}", **compare(model, device, batch, prefill=40, question=6, n_decode=5)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    model, _ = load(None, args.device, "float32")
    for batch in (1, 2):
        row = {
            "model": "random SmolLM2-135M-sized Llama",
            **compare(model, device, batch, prefill=args.prefill, question=32, n_decode=32, threshold=0.44, window=128),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = all(r["same_kept_counts"] and r["max_abs_logit_diff"] < 1e-3 for r in rows)
    print("compact == masked on", args.device, ":", ok)
    write_results(args.json, meta(tool="kvzap gpu_check", device=args.device), rows)
    if not ok:  # a failed check stops run_gpu.sh (set -e) instead of going on to speed figures of a wrong cache
        bad = [r for r in rows if not (r["same_kept_counts"] and r["max_abs_logit_diff"] < 1e-3)]
        raise SystemExit(f"compact and masked storage disagree on {args.device}: {json.dumps(bad)}")


if __name__ == "__main__":
    main()
