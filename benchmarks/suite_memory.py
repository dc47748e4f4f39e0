"""KV memory freed on the evaluation suite's own prompts, measured from outside, at each threshold of a sweep.

The accuracy tables report ``compression_ratio``: the share of the *prunable* pairs evicted (full-attention layers;
sliding-window layers are left alone). This script says what that means for the whole cache on the same prompts:
for each sample, a prefill and one decoded token without a press and under ``DMSThresholdPress(KVzapScorer)`` at
every threshold, then the bytes of every tensor storage reachable from each cache (``benchmarks.outside``, which
asks kvzap nothing). The reference is the no-press cache after one decoded token: before it, transformers'
sliding layers still hold a view of the whole prompt (BENCHMARKS.md, Gemma 3 section). The prefill is each
sample's context turn as the pipeline builds it (``kvzap.prompts.context_ids``: BOS and chat-template rule)::

    python -m benchmarks.suite_memory --model gemma3-270m --task niah_single --length 4096 \
        --thresholds -5.1 -3.6 -3.0 -2.7 -1.518

Prints one row per threshold: the share of prunable pairs evicted (``press.compression_ratio``), the cache's MB
and the share of the no-press cache freed (means over ``--n-samples``). With ``--json FILE`` the same rows go into
``FILE`` under ``tasks[TASK]``, beside the tasks an earlier run wrote there (one file for a sweep of tasks).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.common import cache_kwarg, meta
from benchmarks.outside import model_storage_keys, reachable_bytes
from evaluation.ruler import generate_task
from kvzap import DMSThresholdPress, KVzapScorer
from kvzap.models import load_model
from kvzap.prompts import context_ids


@torch.no_grad()
def cache_after_one_token(model, ids: torch.Tensor, weights: set) -> int:
    """Bytes reachable from a cache after prefilling ``ids`` and decoding one more token (weights excluded)."""
    cache = DynamicCache(config=model.config)
    kwarg = cache_kwarg(model)
    model(ids, logits_to_keep=1, **{kwarg: cache})
    model(ids[:, -1:], logits_to_keep=1, **{kwarg: cache})
    return reachable_bytes(cache, weights).total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="as `python -m evaluation --model`")
    parser.add_argument("--surrogate", default=None, help="KVzap-MLP surrogate directory (default: bundled)")
    parser.add_argument("--task", default="niah_single")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--n-samples", type=int, default=1)
    parser.add_argument("--thresholds", type=float, nargs="+", required=True)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--json", default=None, help="add this task's rows to this file (tasks[TASK])")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)
    weights = model_storage_keys(model)
    samples = generate_task(args.task, tokenizer, args.length, args.n_samples)
    prompts = [torch.tensor([context_ids(tokenizer, s["context"])[0]]) for s in samples]
    reference = [cache_after_one_token(model, ids, weights) for ids in prompts]
    print(
        f"{args.model}, {args.task} at {args.length} tokens ({', '.join(str(p.shape[1]) for p in prompts)} "
        f"prompt tokens), {len(prompts)} sample(s); no press: {statistics.mean(reference) / 1e6:.1f} MB"
    )
    print("| threshold | prunable pairs evicted | cache MB | share of the no-press cache freed |")
    print("|---|---|---|---|")
    rows = []
    for threshold in args.thresholds:
        ratios, sizes = [], []
        for ids in prompts:
            scorer = KVzapScorer(model_type="mlp", surrogate=args.surrogate)
            press = DMSThresholdPress(scorer, threshold=threshold, sliding_window_size=args.window)
            with press(model):
                sizes.append(cache_after_one_token(model, ids, weights))
            ratios.append(press.compression_ratio)
        freed = statistics.mean(1 - s / r for s, r in zip(sizes, reference, strict=True))
        row = dict(threshold=threshold, evicted_share=statistics.mean(ratios), cache_mb=statistics.mean(sizes) / 1e6)
        rows.append({**row, "freed_share": freed})
        print(f"| {threshold:g} | {row['evicted_share']:.1%} | {row['cache_mb']:.1f} | {freed:.1%} |")
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {"tasks": {}}
        data["meta"] = meta(tool="kvzap suite_memory", model=args.model, length=args.length, n_samples=len(prompts))
        data["meta"]["window"] = args.window
        data["tasks"][args.task] = {
            "prompt_tokens": [p.shape[1] for p in prompts],
            "no_press_mb": statistics.mean(reference) / 1e6,
            "results": rows,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
