"""Decode speed, prefill time and KV memory: no press vs. KVzap with masked storage vs. compact storage.

For every prompt length, each run prefills the same prompt three ways (no press, masked, compact) and greedily
decodes ``--decode`` tokens; the modes alternate inside each run so that machine noise hits them alike, and the
results are medians over ``--runs`` runs (decode speed: the inverse of the median step time).

With ``--model DIR`` (e.g. the default model's cached copy) the prompt is real text and the scorer is the
model's KVzap surrogate (bundled, or ``--surrogate``); without it, a random-weight Llama sized like
SmolLM2-135M with random N(0, 1) scores (``--threshold 0.44`` evicts ~67% of the pairs leaving the window).
``--peak-memory MODE`` runs one mode once and reports the process's peak memory (run it in a fresh process).

Example::

    python benchmarks/bench_decode.py --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct \
        --prefill 2048 4096 8192 --threshold -4 --decode 64 --runs 3 --threads 2
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import HEAP_RELEASE, load, meta, prefill_and_decode, sweep, write_results
from benchmarks.outside import model_storage_keys, reachable_bytes
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer
from kvzap.heap import set_heap_release

MODES = ("none", "masked", "compact")


def make_press(args, mode: str) -> DMSThresholdPress:
    scorer = KVzapScorer("mlp", surrogate=args.surrogate) if args.model else RandomScorer(seed=0)
    return DMSThresholdPress(
        scorer, threshold=args.threshold, sliding_window_size=args.window, decoding=args.decoding, storage=mode
    )


def one_run(model, mode: str, prompt: torch.Tensor, args) -> dict[str, float]:
    press = make_press(args, mode) if mode != "none" else None
    out, cache = prefill_and_decode(
        model,
        prompt,
        args.decode,
        press(model) if press else None,
        # Measured from outside: every tensor storage and array reachable from the cache (weights excluded).
        kv_bytes=lambda c: reachable_bytes(c, model_storage_keys(model)).total,
        chunk_size=args.prefill_chunk,
        prefilling=press.prefilling if press else None,
    )
    out["evicted_share"] = press.compression_ratio if press else 0.0
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory (default: random SmolLM2-135M-sized)")
    parser.add_argument("--surrogate", default=None, help="KVzap-MLP surrogate dir (default: bundled)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048], help="prompt lengths, e.g. 2048 4096 8192")
    parser.add_argument("--decode", type=int, default=64, help="greedy tokens decoded after the prefill")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode; medians are reported")
    parser.add_argument("--threshold", type=float, default=0.44, help="DMS threshold (-inf: evict nothing)")
    parser.add_argument("--window", type=int, default=128, help="DMS sliding window (always kept)")
    parser.add_argument("--no-decoding", dest="decoding", action="store_false", help="prune the prompt only")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--prefill-chunk", type=int, default=None, help="prefill in chunks of this many tokens (pruned after each)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--peak-memory", choices=MODES, default=None, help="one run of one mode, peak RSS")
    parser.add_argument(
        "--heap-release",
        choices=list(HEAP_RELEASE),
        default="pages",
        help="how dropped host memory goes back to the system (kvzap.heap; see benchmarks/common.py HEAP_RELEASE)",
    )
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    set_heap_release(**HEAP_RELEASE[args.heap_release])

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    setup = meta(
        tool="kvzap",
        model=args.model or "random Llama, SmolLM2-135M sizes",
        device=args.device,
        dtype=args.dtype,
        decode_tokens=args.decode,
        runs=args.runs,
        threshold=args.threshold,
        window=args.window,
        decoding_pruning=args.decoding,
        prefill_chunk=args.prefill_chunk,
    )
    results = sweep(model, tokenizer, args, args.modes, one_run)
    write_results(args.json, setup, results)


if __name__ == "__main__":
    main()
