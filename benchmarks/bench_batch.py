"""Throughput of a ragged batch: 8 prompts of mixed lengths, one at a time vs. batched, with and without KVzap.

Three ways, each prefilling the same prompts and greedily decoding ``--decode`` tokens per prompt:

- ``one_at_a_time``: KVzap (compact storage) on each prompt alone, one after the other;
- ``batched_none``: all prompts as one left-padded batch, no press (transformers' dense cache);
- ``batched_kvzap``: the same batch under KVzap (compact storage: each row pruned on its own, no padding stored).

Reported per way (medians over ``--runs`` runs, the ways alternating inside each run): prefill seconds (summed
over the prompts for one at a time), decode tokens/s (tokens of all rows per second of decoding; the inverse of
the median step time times the batch for batches), and KV bytes by the outside measure
(:func:`benchmarks.outside.reachable_bytes`, summed over the prompts' caches for one at a time) after the
prefill and after decoding, with the full cache of the prompts' own lengths for reference.

With ``--model DIR`` the prompts are real text (``kvzap.cli.demo_context`` cut at each length) and the scorer is
the model's KVzap-MLP surrogate; ``--threshold -3.4`` evicts about 2/3 on SmolLM2-135M. Without it, a random
SmolLM2-sized Llama with random N(0, 1) scores (threshold 0.44: ~2/3 of the pairs leaving the window).

Example::

    python benchmarks/bench_batch.py --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --threshold -3.4 \
        --json benchmarks/results/batch.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.common import _sync, cache_kwarg, full_kv_bytes, load, meta, prompt_ids, write_results
from benchmarks.outside import model_storage_keys, reachable_bytes
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer

WAYS = ("one_at_a_time", "batched_none", "batched_kvzap")
LENGTHS = (1024, 3072, 1536, 4096, 2048, 1280, 3584, 2560)


def make_press(args) -> DMSThresholdPress:
    scorer = KVzapScorer("mlp", surrogate=args.surrogate) if args.model else RandomScorer(seed=0)
    return DMSThresholdPress(scorer, threshold=args.threshold, sliding_window_size=args.window, decoding=True)


@torch.no_grad()
def run_batch(model, prompts: list[torch.Tensor], n_decode: int, press: DMSThresholdPress | None) -> dict:
    """Prefill ``prompts`` as one left-padded batch, then decode ``n_decode`` greedy tokens per row."""
    device, kw = model.device, cache_kwarg(model)
    lengths = [p.shape[-1] for p in prompts]
    width, rows = max(lengths), len(prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - lengths[b] :], mask[b, width - lengths[b] :] = p[0], 1
    ids, mask = ids.to(device), mask.to(device)
    position = (mask.cumsum(-1) - 1).clamp_min(0)
    # The decoding masks, made beforehand: no allocation or host work in the timed steps but the model's own.
    masks = [torch.cat([mask, mask.new_ones(rows, step + 1)], dim=-1) for step in range(n_decode)]
    cache, out, weights = DynamicCache(config=model.config), {}, model_storage_keys(model)
    with press(model) if press is not None else contextlib.nullcontext():
        _sync(device)
        start = time.perf_counter()
        logits = model(ids, attention_mask=mask, position_ids=position, logits_to_keep=1, **{kw: cache}).logits
        _sync(device)
        out["prefill_s"] = time.perf_counter() - start
        out["kv_bytes_after_prefill"] = reachable_bytes(cache, weights).total
        token, position = logits[:, -1:].argmax(-1), position[:, -1:]
        steps = []
        for step in range(n_decode):
            start = time.perf_counter()
            position = position + 1
            logits = model(token, attention_mask=masks[step], position_ids=position, **{kw: cache}).logits
            token = logits[:, -1:].argmax(-1)
            _sync(device)
            steps.append(time.perf_counter() - start)
        out["kv_bytes_after_decode"] = reachable_bytes(cache, weights).total
        out["evicted_share"] = press.compression_ratio if press is not None else 0.0
    out["decode_tok_s"] = rows / statistics.median(steps)
    out["decode_tok_s_mean"] = rows * len(steps) / sum(steps)
    return out


def run_one_at_a_time(model, prompts: list[torch.Tensor], n_decode: int, press: DMSThresholdPress) -> dict:
    """Each prompt alone under ``press``: times and bytes summed over the prompts."""
    total: dict[str, float] = {}
    steps_s = 0.0
    evicted, tokens = 0.0, 0
    for p in prompts:
        out = run_batch(model, [p], n_decode, press)
        for key in ("prefill_s", "kv_bytes_after_prefill", "kv_bytes_after_decode"):
            total[key] = total.get(key, 0) + out[key]
        steps_s += n_decode / out["decode_tok_s_mean"]
        evicted += out["evicted_share"] * p.shape[-1]
        tokens += p.shape[-1]
    total["decode_tok_s"] = len(prompts) * n_decode / steps_s  # every token of every prompt, one after the other
    total["decode_tok_s_mean"] = total["decode_tok_s"]
    total["evicted_share"] = evicted / tokens
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory (default: random SmolLM2-135M-sized)")
    parser.add_argument("--surrogate", default=None, help="KVzap-MLP surrogate dir (default: bundled)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths in tokens")
    parser.add_argument("--decode", type=int, default=64, help="greedy tokens decoded per prompt")
    parser.add_argument("--runs", type=int, default=3, help="runs per way; medians are reported")
    parser.add_argument("--threshold", type=float, default=None, help="DMS threshold (default -3.4 / 0.44)")
    parser.add_argument("--window", type=int, default=128, help="DMS sliding window (always kept)")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    if args.threshold is None:
        args.threshold = -3.4 if args.model else 0.44
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths must be positive token counts, got {args.lengths}.")

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    longest = prompt_ids(tokenizer, max(args.lengths), model.config.vocab_size)
    # One text cut at each length (real text with a tokenizer): rows differ in length, not in kind.
    prompts = [longest[:, :n] for n in args.lengths]
    samples: dict[str, list[dict]] = {way: [] for way in args.ways}
    for _ in range(args.runs):
        for way in args.ways:
            if way == "one_at_a_time":
                samples[way].append(run_one_at_a_time(model, prompts, args.decode, make_press(args)))
            else:
                press = make_press(args) if way == "batched_kvzap" else None
                samples[way].append(run_batch(model, prompts, args.decode, press))
    results = []
    for way, runs in samples.items():
        row = {"way": way, **{key: statistics.median(r[key] for r in runs) for key in runs[0]}}
        results.append(row)
        print(
            f"{way:>14}: prefill {row['prefill_s']:.2f} s, decode {row['decode_tok_s']:.1f} tok/s, KV "
            f"{row['kv_bytes_after_decode'] / 2**20:.1f} MiB, evicted {row['evicted_share']:.1%}"
        )
    setup = meta(
        tool="kvzap",
        model=args.model or "random Llama, SmolLM2-135M sizes",
        device=args.device,
        dtype=args.dtype,
        lengths=args.lengths,
        decode_tokens=args.decode,
        runs=args.runs,
        threshold=args.threshold,
        window=args.window,
        full_kv_bytes=sum(full_kv_bytes(model, n + args.decode) for n in args.lengths),
    )
    write_results(args.json, setup, results)


if __name__ == "__main__":
    main()
