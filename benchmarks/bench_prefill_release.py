"""What giving dropped host memory back to the system costs a prefill: kvzap's ways (``kvzap.heap``) against none.

One process, the model loaded once, ``--runs`` runs of every mode alternating (so that machine noise hits them
alike), medians, and ratios against no press: the median of each run's ratio (``ratio_to_none``; the ratio of
the medians is kept as ``ratio_of_medians``). Modes: ``none`` (no press), and kvzap
compact with each way of ``benchmarks.common.HEAP_RELEASE``: ``pages`` (the default: the dropped pairs' own
pages, and a heap trim when resident memory outgrows the pools by 32 MiB), ``trim`` (the same trims, no pages),
``trim_every_layer`` (a trim after every layer), ``off`` (freed memory stays in the allocator). Prefill only
(``model(ids, logits_to_keep=1)`` with a cache, as ``generate`` prefills: full logits would add a vocabulary-sized
matmul per token that dilutes the ratios), DMS threshold press with the model's bundled KVzap-MLP (``--threshold
-3.4`` evicts ~2/3 of SmolLM2-135M's pairs); without ``--model``, a random-weight Llama sized like SmolLM2-135M with
random N(0, 1) scores (the default ``--threshold 0.44`` evicts ~67%)::

    python -m benchmarks.bench_prefill_release --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct \
        --threshold -3.4 --prefill 2048 8192 --runs 3 --json research/heap-release/prefill_release.json

Peak RSS of the same modes: ``bench_memory.py --rss-variants``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.common import HEAP_RELEASE, cache_kwarg, load, meta, prompt_ids, run_ratios, write_results
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer
from kvzap.heap import set_heap_release

MODES = ("none", *HEAP_RELEASE)


def make_press(args) -> DMSThresholdPress:
    # A random model has no trained surrogate: random scores stand in, as in bench_decode and bench_memory.
    scorer = KVzapScorer(model_type="mlp", surrogate=args.surrogate) if args.model else RandomScorer(seed=0)
    return DMSThresholdPress(scorer, threshold=args.threshold, decoding=True)


def one_run(model, mode: str, ids: torch.Tensor, press) -> float:
    """Seconds of one prefill of ``ids`` in ``mode``."""
    kwargs = {cache_kwarg(model): DynamicCache(config=model.config)}
    gc.collect()
    if mode != "none":
        set_heap_release(**HEAP_RELEASE[mode])
    try:
        start = time.perf_counter()
        with torch.no_grad(), press(model) if mode != "none" else contextlib.nullcontext():
            model(ids, logits_to_keep=1, **kwargs)  # as generate prefills: the last position's logits only
        return time.perf_counter() - start
    finally:
        set_heap_release()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory (default: random SmolLM2-135M-sized)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.44, help="DMS threshold (random scores: 0.44 ~ 67%%)")
    parser.add_argument("--surrogate", default=None, help="KVzap-MLP surrogate dir (default: bundled)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if "none" not in args.modes:
        parser.error("--modes must include none (the baseline of the ratios)")
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    press = make_press(args)
    results = []
    for n_tokens in args.prefill:
        ids = prompt_ids(tokenizer, n_tokens, model.config.vocab_size)
        for mode in args.modes[:2]:  # warm-up
            one_run(model, mode, ids, press)
        runs: dict[str, list[float]] = {mode: [] for mode in args.modes}
        for run in range(args.runs):
            for mode in args.modes:
                runs[mode].append(one_run(model, mode, ids, press))
                print(f"  {n_tokens} tokens, run {run}, {mode}: {runs[mode][-1]:.2f} s", flush=True)
        medians = {mode: statistics.median(values) for mode, values in runs.items()}
        row = {"prefill_tokens": n_tokens, "runs_s": runs, "median_s": medians}
        row["ratio_runs"] = {mode: run_ratios(runs[mode], runs["none"]) for mode in args.modes}
        row["ratio_to_none"] = {mode: statistics.median(row["ratio_runs"][mode]) for mode in args.modes}
        row["ratio_of_medians"] = {mode: medians[mode] / medians["none"] for mode in args.modes}
        print(f"{n_tokens} tokens: " + ", ".join(f"{m} {r:.3f}x" for m, r in row["ratio_to_none"].items()))
        results.append(row)
    write_results(
        args.json, meta(tool="kvzap", model=args.model or "random Llama, SmolLM2-135M sizes", runs=args.runs), results
    )
    return results


if __name__ == "__main__":
    main()
