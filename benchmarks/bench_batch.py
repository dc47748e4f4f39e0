"""Throughput of a ragged batch: 8 prompts of mixed lengths, one at a time vs. batched, with and without KVzap.

Three ways, each prefilling the same prompts and greedily decoding ``--decode`` tokens per prompt:

- ``one_at_a_time``: KVzap (compact storage) on each prompt alone, one after the other;
- ``batched_none``: all prompts as one left-padded batch, no press (transformers' dense cache);
- ``batched_kvzap``: the same batch under KVzap (compact storage: each row pruned on its own, no padding stored).

Reported per way, medians over ``--runs`` runs (the ways alternate inside each run, so that machine noise hits
them alike; a short untimed warm-up of every way comes first):

- prefill seconds (summed over the prompts for one at a time);
- decode tokens/s: every row's decoded tokens over the decode wall time (the sum of the timed steps; for one at
  a time, all prompts' tokens over all prompts' decode time);
- KV bytes by the outside measure (:func:`benchmarks.outside.reachable_bytes`: every tensor storage reachable
  from the cache, weights excluded), after the prefill and after decoding, summed over the prompts' caches for
  one at a time (what holding all 8 conversations would take);
- the evicted share of the real pairs (padding is not counted), pooled over the prompts;
- speedups: each run's decode tokens/s divided by that of ``batched_none`` and of ``one_at_a_time`` *in the same
  run*, then the median over runs (``decode_vs_batched_none``, ``decode_vs_one_at_a_time``);
- ``same_tokens_as_one_at_a_time``: rows whose greedy tokens equal those of the prompt decoded alone under the
  same press (first run), a check that batching changed nothing but the speed.

Prompts: consecutive segments of one text, so that rows differ in content as well as length. With ``--model DIR``
the text is real (``kvzap.cli.demo_context``: Python documentation, about 23k tokens with the SmolLM2 tokenizer)
and the scorer is the model's KVzap-MLP surrogate; ``--threshold -3.4`` (the default with a model) evicts about
2/3 on SmolLM2-135M. Without a model, a random SmolLM2-sized Llama reads random ids with random N(0, 1) scores
(threshold 0.44: ~2/3 of the pairs leaving the window).

Example (the figures of BENCHMARKS.md; run on a quiet machine)::

    python -m benchmarks.bench_batch --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --threshold=-3.4 \
        --runs 3 --json benchmarks/results/batch.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.bench_decode import make_press
from benchmarks.common import _sync, cache_kwarg, full_kv_bytes, load, meta, prompt_ids, write_results
from benchmarks.outside import model_storage_keys, reachable_bytes
from kvzap import DMSThresholdPress

WAYS = ("one_at_a_time", "batched_none", "batched_kvzap")
LENGTHS = (1024, 3072, 1536, 4096, 2048, 1280, 3584, 2560)
# Timed figures reduced to medians over the runs; the others are the same in every run (or nearly: KV bytes).
TIMED = ("prefill_s", "decode_s", "decode_tok_s")
MEASURED = (*TIMED, "kv_bytes_after_prefill", "kv_bytes_after_decode", "evicted_share")


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, both ``(B, longest)``: the prompts left padded with zeros, as ``generate`` pads
    decoder-only models (the mask is 0 on padding)."""
    lengths = [p.shape[-1] for p in prompts]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        ids[row, width - n :] = p[0]
        mask[row, width - n :] = 1
    return ids, mask


@torch.no_grad()
def run_batch(model, prompts: list[torch.Tensor], n_decode: int, press: DMSThresholdPress | None) -> dict:
    """Prefill ``prompts`` (each ``(1, n_i)``) as one left-padded batch, then decode ``n_decode`` greedy tokens
    per row under ``press`` (None: no press).

    Returns prefill seconds, decode seconds (the timed steps) and tokens/s (``B * n_decode`` over them), KV bytes
    from outside after the prefill and after decoding, the evicted share of the real pairs, and ``tokens``: each
    row's ``n_decode`` decoded token ids (the token predicted by the prefill is fed first, as ``generate`` does).
    """
    device, kw = model.device, cache_kwarg(model)
    rows = len(prompts)
    ids, mask = (t.to(device) for t in left_padded(prompts))
    # Positions count real tokens only, so that a row's RoPE phases are those it has alone.
    position = (mask.cumsum(-1) - 1).clamp_min(0)
    # The decoding masks, made beforehand: no allocation or host work in the timed steps but the model's own.
    masks = [torch.cat([mask, mask.new_ones(rows, step + 1)], dim=-1) for step in range(n_decode)]
    cache, out, weights = DynamicCache(config=model.config), {}, model_storage_keys(model)
    tokens = []
    with press(model) if press is not None else contextlib.nullcontext():
        _sync(device)
        start = time.perf_counter()
        logits = model(ids, attention_mask=mask, position_ids=position, logits_to_keep=1, **{kw: cache}).logits
        token = logits[:, -1:].argmax(-1)  # (B, 1)
        _sync(device)
        out["prefill_s"] = time.perf_counter() - start
        out["kv_bytes_after_prefill"] = reachable_bytes(cache, weights).total
        position = position[:, -1:]
        steps = []
        for step in range(n_decode):
            start = time.perf_counter()
            position = position + 1
            logits = model(token, attention_mask=masks[step], position_ids=position, **{kw: cache}).logits
            token = logits[:, -1:].argmax(-1)
            _sync(device)
            steps.append(time.perf_counter() - start)
            tokens.append(token)
        out["kv_bytes_after_decode"] = reachable_bytes(cache, weights).total
        # Pooled over the rows' real pairs (padding is neither scored nor counted).
        out["evicted_share"] = press.compression_ratio if press is not None else 0.0
    out["decode_s"] = sum(steps)
    out["decode_tok_s"] = rows * n_decode / out["decode_s"]
    out["tokens"] = torch.cat(tokens, dim=-1).tolist() if tokens else [[] for _ in prompts]
    return out


def run_one_at_a_time(model, prompts: list[torch.Tensor], n_decode: int, press: DMSThresholdPress) -> dict:
    """Each prompt alone under ``press``, one after the other: seconds and bytes summed over the prompts."""
    total = {"prefill_s": 0.0, "decode_s": 0.0, "kv_bytes_after_prefill": 0, "kv_bytes_after_decode": 0}
    evicted, pairs, tokens = 0.0, 0, []
    for p in prompts:
        out = run_batch(model, [p], n_decode, press)
        for key in total:
            total[key] += out[key]
        # The share pools every layer's real pairs: weight each prompt by the pairs it wrote (prompt + decoded).
        seen = p.shape[-1] + n_decode
        evicted += out["evicted_share"] * seen
        pairs += seen
        tokens += out["tokens"]
    total["decode_tok_s"] = len(prompts) * n_decode / total["decode_s"]
    total["evicted_share"] = evicted / pairs
    total["tokens"] = tokens
    return total


def one_run(model, way: str, prompts: list[torch.Tensor], args) -> dict:
    """One way, once: ``one_at_a_time``, ``batched_none`` or ``batched_kvzap`` (a fresh press each time)."""
    if way == "one_at_a_time":
        return run_one_at_a_time(model, prompts, args.decode, make_press(args, "compact"))
    press = make_press(args, "compact") if way == "batched_kvzap" else None
    return run_batch(model, prompts, args.decode, press)


def summarize(samples: dict[str, list[dict]]) -> list[dict]:
    """One row per way: medians over the runs, and speedups against the baselines of the same runs.

    ``samples[way][run]`` is :func:`one_run`'s output. A speedup is computed within each run (the ways of one run
    share the machine's state) and its median over runs is reported; a baseline that was not run gives none.
    """
    results = []
    for way, runs in samples.items():
        row: dict = {"way": way, "runs": len(runs)}
        row.update({key: statistics.median(r[key] for r in runs) for key in MEASURED})
        row["decode_tok_s_runs"] = [r["decode_tok_s"] for r in runs]
        for base in ("batched_none", "one_at_a_time"):
            if base in samples:
                ratios = [r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(runs, samples[base], strict=True)]
                row[f"decode_vs_{base}"] = statistics.median(ratios)
                ratios = [r["prefill_s"] / b["prefill_s"] for r, b in zip(runs, samples[base], strict=True)]
                row[f"prefill_vs_{base}"] = statistics.median(ratios)
        if way == "batched_kvzap" and "one_at_a_time" in samples:
            alone = samples["one_at_a_time"][0]["tokens"]
            row["same_tokens_as_one_at_a_time"] = sum(a == b for a, b in zip(runs[0]["tokens"], alone, strict=True))
        results.append(row)
    return results


def make_prompts(tokenizer, lengths: list[int], vocab_size: int) -> list[torch.Tensor]:
    """``(1, n)`` prompts of the given lengths: consecutive segments of one text (random ids without a
    tokenizer), so that rows differ in content, not only in length."""
    text = prompt_ids(tokenizer, sum(lengths), vocab_size)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [text[:, s : s + n] for s, n in zip(starts, lengths, strict=True)]


def measure(model, prompts: list[torch.Tensor], args) -> list[dict]:
    """A warm-up of every way on two short prompts (untimed), then ``args.runs`` runs of ``args.ways``."""
    warm = [p[:, : min(64, p.shape[-1])] for p in prompts[:2]]
    for way in args.ways:
        one_run(model, way, warm, argparse.Namespace(**{**vars(args), "decode": 2}))
    samples: dict[str, list[dict]] = {way: [] for way in args.ways}
    for run in range(args.runs):
        for way in args.ways:
            s = one_run(model, way, prompts, args)
            samples[way].append(s)
            print(
                f"  run {run}, {way}: prefill {s['prefill_s']:.2f} s, decode {s['decode_tok_s']:.2f} tok/s "
                f"({s['decode_s']:.2f} s), KV {s['kv_bytes_after_decode'] / 2**20:.1f} MiB, "
                f"evicted {s['evicted_share']:.1%}",
                flush=True,
            )
    return summarize(samples)


def main(argv: list[str] | None = None) -> list[dict]:
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
    # Pruning continues while decoding (the press of bench_decode.py, which reads this flag).
    parser.set_defaults(decoding=True)
    args = parser.parse_args(argv)
    if args.threshold is None:
        args.threshold = -3.4 if args.model else 0.44
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths must be positive token counts, got {args.lengths}.")
    if args.decode < 1 or args.runs < 1:
        parser.error(f"--decode and --runs must be at least 1, got {args.decode} and {args.runs}.")

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    try:
        prompts = make_prompts(tokenizer, args.lengths, model.config.vocab_size)
    except ValueError as error:
        parser.error(f"{error} The --lengths add up to {sum(args.lengths)} tokens: pass fewer or shorter prompts.")
    results = measure(model, prompts, args)
    for row in results:
        speed = ", ".join(f"{row[k]:.2f}x {k[10:]}" for k in row if k.startswith("decode_vs_"))
        print(
            f"{row['way']:>14}: prefill {row['prefill_s']:.2f} s, decode {row['decode_tok_s']:.2f} tok/s "
            f"({speed} in the same runs), KV {row['kv_bytes_after_decode'] / 2**20:.1f} MiB, "
            f"evicted {row['evicted_share']:.1%}"
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
        # The full dense cache of the prompts' own tokens (what one at a time would hold without a press, all
        # caches together), and of the left-padded batch (what batched_none holds).
        full_kv_bytes=sum(full_kv_bytes(model, n + args.decode) for n in args.lengths),
        full_kv_bytes_padded=len(args.lengths) * full_kv_bytes(model, max(args.lengths) + args.decode),
    )
    write_results(args.json, setup, results)
    return results


if __name__ == "__main__":
    main()
