"""Resident memory (``/proc/self/statm``) at every decoder layer's exit during a prefill, for one mode.

A diagnostic for the peak-RSS figures of ``bench_memory.py``: where the process's memory grows, layer by layer.
Run it in a fresh process per mode (the allocator's state is the process's), with and without
``MALLOC_MMAP_THRESHOLD_=65536`` or ``--heap-release off`` to tell the allocator from the tensors::

    python -m benchmarks.trace_rss --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --mode compact \
        --prefill 8192 --threshold -3.4

Each line: the layer, RSS at its exit (MB), the growth since the previous layer's exit. The model's weights
are memory-mapped from their safetensors file and count in RSS from the first forward that reads them, so the
first prefill also grows by each layer's weights (about 14 MB per layer on SmolLM2-135M, fp32).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import HEAP_RELEASE, load, peak_rss_mb, prefill_and_decode, prompt_ids, resident_mb
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer
from kvzap.heap import set_heap_release


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory (default: random SmolLM2-sized)")
    parser.add_argument("--mode", default="compact", choices=["none", "masked", "compact"])
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--decode", type=int, default=1, help="greedy tokens decoded after the prefill (at least 1)")
    parser.add_argument("--threshold", type=float, default=-3.4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--heap-release",
        choices=list(HEAP_RELEASE),
        default="pages",
        help="how dropped host memory goes back to the system (kvzap.heap; see benchmarks/common.py HEAP_RELEASE)",
    )
    parser.add_argument("--json", default=None, help="where to write the trace")
    args = parser.parse_args(argv)
    set_heap_release(**HEAP_RELEASE[args.heap_release])
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    prompt = prompt_ids(tokenizer, args.prefill, model.config.vocab_size)
    trace: list[tuple[int, float]] = []
    layers = model.model.layers
    hooks = [
        layer.register_forward_hook(
            lambda m, a, o, i=i: trace.append((i, resident_mb())) if len(trace) < len(layers) else None
        )
        for i, layer in enumerate(layers)
    ]
    press = None
    if args.mode != "none":
        scorer = KVzapScorer("mlp") if args.model else RandomScorer(seed=0)
        press = DMSThresholdPress(scorer, threshold=args.threshold, decoding=True, storage=args.mode)
    start = resident_mb()
    try:
        prefill_and_decode(model, prompt, args.decode, press(model) if press else None)
    finally:
        for hook in hooks:
            hook.remove()
    peak = peak_rss_mb()
    previous = start
    print(f"{args.mode}, {args.prefill} tokens: RSS {start:.0f} MB before the prefill")
    for i, mb in trace:
        print(f"layer {i:3d}  {mb:8.0f} MB  {mb - previous:+7.1f}")
        previous = mb
    print(f"peak RSS {peak:.0f} MB; after the run {resident_mb():.0f} MB")
    if args.json:
        payload = {"mode": args.mode, "prefill": args.prefill, "start_mb": start, "layers_mb": trace, "peak_mb": peak}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
