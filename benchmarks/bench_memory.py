"""KV memory measured from outside kvzap: what the cache holds, what a dense prefill costs at its peak, peak RSS.

Three measures, none of them asks kvzap (``benchmarks/outside.py``):

1. **Held by the cache**: every tensor storage (and NumPy array) reachable from the cache object, right after the
   prefill and after ``--decode`` greedy tokens, against the full cache of the same tokens (from the config).
2. **Peak during a dense prefill**: live non-weight tensor bytes sampled at every decoder layer's exit, minus the
   same samples of the same forward run without a cache (``use_cache=False``): what caching (and pruning) costs at
   that point. The largest difference is the peak KV-related memory.
3. **Peak RSS** of a whole job (``--rss-prompt`` prefill + ``--rss-decode`` decoded tokens), one fresh process per
   run (``bench_decode.py --peak-memory``), median of ``--rss-runs`` processes per mode: no press, kvzap compact,
   kvzap compact giving freed memory back by heap trims only, and not at all (``kvzap.heap``); then no press and
   kvzap compact again under ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc maps every tensor of 64 KiB or more on its
   own and unmaps it when freed, so RSS follows the live tensors: the comparison without the heap's fragmentation).

    python -m benchmarks.bench_memory --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --prefill 2048 8192 \
        --threshold -3.4 --decode 64 --rss-runs 5 --json research/heap-release/memory_release_variants.json

BENCHMARKS.md's headline memory table (``memory.json``) runs no press and kvzap compact only:
``--rss-variants none compact --rss-mmap-runs 0`` (``run_all.sh`` runs both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.common import cache_kwarg, load, meta, prompt_ids, write_results
from benchmarks.outside import LayerExitSampler, full_cache_bytes, model_storage_keys, reachable_bytes
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer

MODES = ("none", "masked", "compact")


def make_press(args, mode: str) -> DMSThresholdPress:
    scorer = KVzapScorer("mlp", surrogate=args.surrogate) if args.model else RandomScorer(seed=0)
    return DMSThresholdPress(scorer, threshold=args.threshold, decoding=True, storage=mode)


@torch.no_grad()
def measure(model, prompt: torch.Tensor, mode: str, baseline: dict[int, int], args) -> dict:
    """One prefill (sampled at every layer's exit) and ``args.decode`` greedy steps in ``mode``."""
    weights = model_storage_keys(model)
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    press = make_press(args, mode) if mode != "none" else None
    n = prompt.shape[1]
    with press(model) if press else contextlib.nullcontext(), LayerExitSampler(model) as sampler:
        logits = model(prompt, logits_to_keep=1, **{kw: cache}).logits
    row = {
        "mode": mode,
        "prefill_tokens": n,
        "full_bytes_prefill": full_cache_bytes(model.config, n, dtype=model.dtype),
    }
    row["evicted_after_prefill"] = press.compression_ratio if press else 0.0
    row["held_after_prefill"] = reachable_bytes(cache, weights).total
    row["prefill_peak_extra"] = max(b - baseline[i] for i, b in sampler.samples)
    token = logits[:, -1:].argmax(-1)
    with press(model) if press else contextlib.nullcontext():
        for step in range(args.decode):
            position = torch.tensor([[n + step]], device=model.device)
            token = model(token, position_ids=position, **{kw: cache}).logits[:, -1:].argmax(-1)
    row["full_bytes_decode"] = full_cache_bytes(model.config, n + args.decode, dtype=model.dtype)
    row["evicted_after_decode"] = press.compression_ratio if press else 0.0
    row["held_after_decode"] = reachable_bytes(cache, weights).total
    return row


# Peak-RSS variants: (press mode, bench_decode flags, extra environment).
RSS_VARIANTS = {
    "none": ("none", [], {}),
    "compact": ("compact", [], {}),
    # The same giving freed memory back by heap trims only (no pages), after every layer, and not at all: what
    # glibc alone does.
    "compact_trim_only": ("compact", ["--heap-release", "trim"], {}),
    "compact_trim_every_layer": ("compact", ["--heap-release", "trim_every_layer"], {}),
    "compact_no_heap_release": ("compact", ["--heap-release", "off"], {}),
}
# glibc serving every allocation of 64 KiB or more with its own mapping, unmapped on free: RSS then follows the live
# tensors, without the heap's fragmentation (the same runs under an allocator that returns freed memory at once).
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_rss(args, variant: str, env: dict[str, str] | None, n_runs: int) -> tuple[list[float], list[float]]:
    """Peak RSS (MB) and evicted share of ``n_runs`` fresh processes running prefill + decode in ``variant`` (a
    key of ``RSS_VARIANTS``), with ``env`` added to the environment."""
    mode, flags, extra_env = RSS_VARIANTS[variant]
    values, evicted = [], []
    for run in range(n_runs):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "peak.json"
            cmd = [sys.executable, "-m", "benchmarks.bench_decode", "--prefill", str(args.rss_prompt)]
            cmd += ["--decode", str(args.rss_decode), "--threshold", str(args.threshold), "--peak-memory", mode]
            cmd += ["--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype, "--json", str(out)]
            if args.model:
                cmd += ["--model", args.model]
            if args.surrogate:
                cmd += ["--surrogate", args.surrogate]
            cmd += flags
            environ = {**os.environ, "PYTHONPATH": ".", **extra_env, **(env or {})}
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=environ)
            result = json.loads(out.read_text())["results"][0]
        values.append(result["peak_rss_mb"])
        evicted.append(result["evicted_share"])
        print(f"  peak RSS, {variant}{' ' + str(env) if env else ''}, run {run}: {values[-1]:.0f} MB", flush=True)
    return values, evicted


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory (default: random SmolLM2-135M-sized)")
    parser.add_argument("--surrogate", default=None, help="KVzap-MLP surrogate dir (default: bundled)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048])
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threshold", type=float, default=0.44)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (live tensors are counted on every device)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rss-runs", type=int, default=5, help="fresh processes per mode for peak RSS (0: skip)")
    parser.add_argument("--rss-prompt", type=int, default=8192)
    parser.add_argument("--rss-decode", type=int, default=256)
    parser.add_argument(
        "--rss-variants", nargs="+", default=list(RSS_VARIANTS), choices=list(RSS_VARIANTS), help="peak-RSS runs"
    )
    parser.add_argument(
        "--rss-mmap-runs", type=int, default=None, help="processes per mode under the fixed mmap threshold (0: skip)"
    )
    parser.add_argument(
        "--rss-only", action="store_true", help="only the peak-RSS processes, added to the existing --json file"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.rss_only and not (args.json and Path(args.json).exists() and args.rss_runs):
        parser.error("--rss-only needs --rss-runs > 0 and an existing --json file (from an earlier full run).")

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    results = []
    for n in [] if args.rss_only else args.prefill:
        prompt = prompt_ids(tokenizer, n, model.config.vocab_size).to(model.device)
        with torch.no_grad(), LayerExitSampler(model) as base:
            model(prompt, use_cache=False, logits_to_keep=1)
        baseline = base.by_layer()
        for mode in args.modes:
            row = measure(model, prompt, mode, baseline, args)
            results.append(row)
            print(
                f"{n} tokens, {mode}: evicted {row['evicted_after_prefill']:.1%}, held after prefill "
                f"{row['held_after_prefill'] / row['full_bytes_prefill']:.3f} of the full cache, prefill peak "
                f"{row['prefill_peak_extra'] / row['full_bytes_prefill']:.3f}, held after {args.decode} tokens "
                f"{row['held_after_decode'] / row['full_bytes_decode']:.3f}",
                flush=True,
            )
    setup = meta(
        tool="kvzap",
        device=args.device,
        dtype=args.dtype,
        model=args.model or "random Llama, SmolLM2-135M sizes",
        threshold=args.threshold,
        decode_tokens=args.decode,
        num_layers=model.config.num_hidden_layers,
        rss_prompt=args.rss_prompt,
        rss_decode=args.rss_decode,
        rss_full_bytes=full_cache_bytes(model.config, args.rss_prompt + args.rss_decode, dtype=model.dtype),
    )
    # Written before the peak-RSS processes (minutes each), so that a stopped run keeps the figures above.
    if args.rss_only:
        data = json.loads(Path(args.json).read_text())
        data["meta"].update(setup)
        Path(args.json).write_text(json.dumps(data, indent=2))
    else:
        write_results(args.json, setup, results)
    if not args.rss_runs:
        return
    mmap_runs = args.rss_runs if args.rss_mmap_runs is None else args.rss_mmap_runs
    for key, env, variants, n_runs in (
        ("peak_rss", None, args.rss_variants, args.rss_runs),
        ("peak_rss_mmap", MMAP_ENV, ("none", "compact"), mmap_runs),
    ):
        for variant in variants if n_runs else ():
            runs, evicted = peak_rss(args, variant, env, n_runs)
            if args.json:  # after each variant (minutes each); a later run with other variants adds to them
                data = json.loads(Path(args.json).read_text())
                entry = {"runs_mb": runs, "median_mb": statistics.median(runs), "evicted_share": evicted}
                data[key] = {**data.get(key, {}), variant: entry, "env": env or {}}
                Path(args.json).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
