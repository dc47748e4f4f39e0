"""kvzap side by side with what a user would pick instead: transformers' static and quantized caches.

For every prompt length, each run prefills the same prompt once per method (the methods alternate inside the run,
so that machine noise hits them alike) and greedily decodes ``--decode`` tokens. Measured for each: the KV bytes
held after the prefill and after decoding, from outside (``benchmarks/outside.py``: every tensor storage reachable
from the cache, wrapper tensors such as quanto's packed ones through their inner tensors), the prefill time (the
time to the first token's logits), and decode ms/token (the median step). Medians over ``--runs`` runs, and each
run's ratio to no press (``none``) of the same run.

Methods (``--methods``):

- ``none``: no press, transformers' dynamic cache (the baseline);
- ``static``: no press, transformers' static cache (preallocated for the prompt and the decoded tokens);
- ``quanto_int4``, ``quanto_int2``, ``hqq_int4``, ``hqq_int2``: transformers' ``QuantizedCache`` (optimum-quanto
  or HQQ backend, its defaults otherwise: groups of 64, the last 128 tokens kept in the model's dtype until
  they are flushed into the quantized states);
- ``kvzap``: ``DMSThresholdPress(KVzapScorer("mlp"))``, compact storage, pruning while decoding;
- ``kvzap_kv8``: the same with the kept pairs stored at 8 bits (``kv_bits=8``; presses refuse 4 bits, see
  ``research/kv-bits-4``).

A method that fails (a backend missing, or failing at some length) is recorded with its error and the others go
on. With ``--model DIR`` the prompt is real text and kvzap scores with the bundled surrogate; without it, a
random-weight Llama sized like SmolLM2-135M with random N(0, 1) scores (``--threshold 0.44``: ~2/3 evicted).

Example (the results file BENCHMARKS.md reads)::

    python -m benchmarks.bench_alternatives --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --threads 2 \\
        --prefill 2048 4096 8192 --threshold=-3.4 --decode 64 --runs 5 --json benchmarks/results/alternatives.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import traceback

import torch
from transformers import DynamicCache, QuantizedCache, StaticCache

from benchmarks.common import (
    HEAP_RELEASE,
    cache_kwarg,
    full_kv_bytes,
    load,
    medians,
    meta,
    prompt_ids,
    run_ratios,
    write_results,
)
from benchmarks.outside import model_storage_keys, reachable_bytes
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer
from kvzap.heap import set_heap_release

QUANTIZED = {
    "quanto_int4": ("quanto", 4),
    "quanto_int2": ("quanto", 2),
    "hqq_int4": ("hqq", 4),
    "hqq_int2": ("hqq", 2),
}
METHODS = ("none", "static", *QUANTIZED, "kvzap", "kvzap_kv8")
LABELS = {
    "none": "no press, dynamic cache",
    "static": "no press, static cache",
    "quanto_int4": "quantized cache, quanto int4",
    "quanto_int2": "quantized cache, quanto int2",
    "hqq_int4": "quantized cache, HQQ int4",
    "hqq_int2": "quantized cache, HQQ int2",
    "kvzap": "kvzap (KVzap-MLP, compact)",
    "kvzap_kv8": "kvzap, 8-bit storage",
}
_TIMED = ("decode_ms_per_token", "prefill_s")  # the figures whose per-run values and ratios are kept


def make_press(args, method: str) -> DMSThresholdPress:
    scorer = KVzapScorer("mlp", surrogate=args.surrogate) if args.model else RandomScorer(seed=0)
    extra = {"kv_bits": 8} if method == "kvzap_kv8" else {}
    return DMSThresholdPress(
        scorer, threshold=args.threshold, sliding_window_size=args.window, decoding=True, storage="compact", **extra
    )


def make_cache(model, method: str, max_len: int):
    """The empty cache a method prefills into (transformers' own, for every method but kvzap's)."""
    if method == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    if method in QUANTIZED:
        backend, nbits = QUANTIZED[method]
        return QuantizedCache(backend, model.config, nbits=nbits)
    return DynamicCache(config=model.config)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def one_run(model, method: str, prompt: torch.Tensor, args, weights: set) -> dict[str, float]:
    """Prefill ``prompt`` and decode ``args.decode`` tokens with ``method``; the timings and the bytes held."""
    press = make_press(args, method) if method.startswith("kvzap") else None
    device = model.device
    prompt = prompt.to(device)
    cache = make_cache(model, method, prompt.shape[1] + args.decode + 1)
    kw = cache_kwarg(model)
    out: dict[str, float] = {}
    with press(model) if press is not None else contextlib.nullcontext():
        _sync(device)
        start = time.perf_counter()
        token = model(prompt, logits_to_keep=1, **{kw: cache}).logits[:, -1:].argmax(-1)
        _sync(device)
        out["prefill_s"] = time.perf_counter() - start
        out["kv_bytes_after_prefill"] = reachable_bytes(cache, weights).total
        steps = []
        for _ in range(args.decode):
            start = time.perf_counter()
            token = model(token, **{kw: cache}).logits[:, -1:].argmax(-1)
            _sync(device)
            steps.append(time.perf_counter() - start)
        out["kv_bytes_after_decode"] = reachable_bytes(cache, weights).total
    out["decode_ms_per_token"] = 1000 * statistics.median(steps) if steps else float("nan")
    out["evicted_share"] = float(press.compression_ratio) if press is not None else 0.0
    return out


def _error(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def sweep(model, tokenizer, args) -> list[dict]:
    """One row per (length, method): medians of the runs, each run's values, and each run's ratio to ``none``."""
    weights = model_storage_keys(model)
    rows = []
    for n_tokens in args.prefill:
        prompt = prompt_ids(tokenizer, n_tokens, model.config.vocab_size)
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
        failed: dict[str, dict[str, str]] = {}
        for run in range(args.runs):
            # The order reverses every other run: drift over a run (heat, other processes) hits every method alike.
            for method in args.methods if run % 2 == 0 else args.methods[::-1]:
                if method in failed:
                    continue
                try:
                    s = one_run(model, method, prompt, args, weights)
                except Exception as error:  # noqa: BLE001  (recorded in the results: the other methods go on)
                    failed[method] = {"error": _error(error)}
                    print(f"  {n_tokens} tokens, {method}: FAILED {failed[method]['error']}", flush=True)
                    continue
                samples[method].append(s)
                print(
                    f"  {n_tokens} tokens, run {run}, {method}: prefill {s['prefill_s']:.2f} s, decode "
                    f"{s['decode_ms_per_token']:.1f} ms/token, KV {s['kv_bytes_after_prefill'] / 2**20:.1f} MiB, "
                    f"evicted {s['evicted_share']:.1%}",
                    flush=True,
                )
        full, full_decode = full_kv_bytes(model, n_tokens), full_kv_bytes(model, n_tokens + args.decode)
        base = samples.get("none") if "none" not in failed else None
        for method in args.methods:
            row = {
                "prefill_tokens": n_tokens,
                "method": method,
                "label": LABELS[method],
                "full_kv_bytes": full,
                "full_kv_bytes_after_decode": full_decode,
            }
            if method in failed:  # a method that fails at its first run is not run again at this length
                rows.append({**row, **failed[method]})
                continue
            row.update(medians(samples[method]))
            row.update({f"{key}_runs": [s[key] for s in samples[method]] for key in _TIMED})
            row["kv_share_after_prefill"] = row["kv_bytes_after_prefill"] / full
            row["kv_share_after_decode"] = row["kv_bytes_after_decode"] / full_decode
            if base:
                for key in _TIMED:
                    ratios = run_ratios([s[key] for s in samples[method]], [s[key] for s in base])
                    row[f"{key}_ratio_runs"] = ratios
                    row[f"{key}_ratio"] = statistics.median(ratios)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None, model=None) -> dict:
    """Run the sweep and write its results; ``model`` replaces the one ``--model`` would load (tests pass a tiny
    one: the prompt is then random ids)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model directory (default: random SmolLM2-135M-sized)")
    parser.add_argument("--surrogate", default=None, help="KVzap-MLP surrogate dir (default: bundled)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048], help="prompt lengths, e.g. 2048 4096 8192")
    parser.add_argument("--decode", type=int, default=64, help="greedy tokens decoded after the prefill")
    parser.add_argument("--runs", type=int, default=3, help="runs per method; medians are reported")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="METHOD")
    parser.add_argument("--threshold", type=float, default=0.44, help="kvzap's DMS threshold (BENCHMARKS: -3.4)")
    parser.add_argument("--window", type=int, default=128, help="kvzap's sliding window (always kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.decode < 1 or any(n < 1 for n in args.prefill):
        parser.error("--runs, --decode and every --prefill length must be positive")
    if len(set(args.methods)) != len(args.methods):
        parser.error(f"--methods names a method twice: {' '.join(args.methods)}")
    set_heap_release(**HEAP_RELEASE["pages"])
    torch.set_num_threads(args.threads)
    if model is None:
        model, tokenizer = load(args.model, args.device, args.dtype)
        name = args.model or "random Llama, SmolLM2-135M sizes"
    else:
        tokenizer, name = None, model.config._name_or_path or type(model).__name__
    setup = meta(
        tool="kvzap",
        model=name,
        device=args.device,
        dtype=args.dtype,
        decode_tokens=args.decode,
        runs=args.runs,
        threshold=args.threshold,
        window=args.window,
        decoding_pruning=True,
        methods=args.methods,
        labels={m: LABELS[m] for m in args.methods},
        num_layers=model.config.num_hidden_layers,
    )
    results = sweep(model, tokenizer, args)
    write_results(args.json, setup, results)
    if not args.json:
        print(json.dumps(results, indent=1))
    return {"meta": setup, "results": results}


if __name__ == "__main__":
    main()
