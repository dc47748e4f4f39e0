"""Time to the first answer token through the pipeline, as a user waits for it: no press against kvzap's prefills.

One process, the model loaded once; every run times each mode once (the order reverses every other run, so that
drift over a run hits every mode alike), medians of ``--runs`` runs and each run's ratio to no press. A mode
answers one question about the context with ``max_new_tokens=1``: the context's prefill, the question's
forward and the first answer token, which is what the user waits for. Modes:

- ``none``: no press (transformers' dynamic cache, sdpa);
- ``dense``: kvzap, the context prefilled in one forward (``prefill_chunk_size=None``, the paper's setting);
- ``chunk:N``: kvzap, the context prefilled in chunks of ``N`` tokens, each pruned before the next attends to it;
- ``auto``: kvzap with the pipeline's default (``prefill_chunk_size="auto"``: one forward for every press kvzap
  ships);
- ``plain:N``: no press, the context prefilled in chunks of ``N`` tokens: what chunking alone gives (on Gemma 3,
  transformers' sliding-window layers then read only their window and the chunk).

Without ``--model`` (a random SmolLM2-sized Llama, as ``benchmarks/run_gpu.sh`` runs it on a GPU machine, with
``--device`` and ``--dtype``), there is no tokenizer: each mode times the same prefill on token ids (chunked as the
pipeline chunks) and the first token's argmax, to the device's end of work.

With ``--breakdown`` (CPU only), one more profiled run of ``none`` and of the first kvzap mode splits the time of a
prefill chunk (the last one) and of a decoding step into: the projections and MLP (``weights``: matmuls with the
model's parameters), ``attention``, ``scoring`` (the press's scorer), ``bookkeeping`` (the press's hooks and the
cache's writes and evictions, minus their scoring and attention) and the rest of the wall time (``python and
other ops``). The scopes are timed with ``torch.profiler.record_function`` wrapped around kvzap's functions by this
script; the library is unchanged.

Example (the results file BENCHMARKS.md reads)::

    python -m benchmarks.bench_ttft --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --threads 2 \\
        --prefill 4096 8192 --modes none dense chunk:512 chunk:1024 chunk:2048 --runs 5 --breakdown \\
        --json benchmarks/results/ttft.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time

import torch
from transformers import pipeline

from benchmarks.common import _sync, load, meta, prompt_ids, run_ratios, write_results
from kvzap import DMSThresholdPress, KVzapScorer, RandomScorer
from kvzap.pipeline import _chunk_size

QUESTION = "What is the launch code mentioned in the text?"


def make_press(args) -> DMSThresholdPress:
    scorer = KVzapScorer("mlp", surrogate=args.surrogate) if args.model else RandomScorer(seed=0)
    return DMSThresholdPress(
        scorer, threshold=args.threshold, sliding_window_size=args.window, sink_size=args.sink_size
    )


def pressed(mode: str) -> bool:
    """Whether ``mode`` runs kvzap (``none`` and ``plain:N`` run no press)."""
    return mode != "none" and not mode.startswith("plain:")


def chunk_of(mode: str):
    if mode in ("dense", "none"):
        return None
    if mode == "auto":
        return "auto"
    return int(mode.split(":", 1)[1])


def one_run(pipe, context: str, mode: str, args) -> dict[str, float]:
    press = make_press(args) if pressed(mode) else None
    kwargs = {"prefill_chunk_size": chunk_of(mode)} if press is not None or chunk_of(mode) else {}
    if press is not None:
        kwargs["press"] = press
    start = time.perf_counter()
    pipe(context, question=QUESTION, max_new_tokens=1, **kwargs)
    seconds = time.perf_counter() - start
    return {"ttft_s": seconds, "evicted_share": float(press.compression_ratio) if press is not None else 0.0}


# --- breakdown ------------------------------------------------------------------------------------------------
_SCOPES = ("attention", "scoring", "bookkeeping")


_ATTENTION_KERNELS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "kvzap::paged_decode",
)
_WEIGHT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


@contextlib.contextmanager
def _scoped():
    """kvzap's attention, scorer and cache/hook functions wrapped in profiler scopes (restored on exit)."""
    import kvzap.compact
    import kvzap.presses.base
    import kvzap.presses.baseline_scorers
    import kvzap.presses.surrogate_scorer

    targets = [
        (kvzap.compact.CompactLayer, "attend", "attention"),
        (kvzap.presses.surrogate_scorer.SurrogateScorer, "score", "scoring"),
        (kvzap.presses.baseline_scorers.RandomScorer, "score", "scoring"),
        (kvzap.compact.CompactLayer, "update", "bookkeeping"),
        (kvzap.compact.CompactLayer, "evict", "bookkeeping"),
        (kvzap.compact.CompactLayer, "end_forward", "bookkeeping"),
        (kvzap.presses.base.BasePress, "_post_hook", "bookkeeping"),
    ]
    saved = []
    for owner, name, scope in targets:
        original = owner.__dict__.get(name)
        if original is None:
            raise AttributeError(f"{owner.__name__}.{name} is gone: update benchmarks/bench_ttft.py's scopes.")

        def wrapped(*a, __f=original, __s=scope, **k):
            with torch.profiler.record_function(f"kvzap::{__s}"):
                return __f(*a, **k)

        functools.update_wrapper(wrapped, original)
        setattr(owner, name, wrapped)
        saved.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _scopes_above(event) -> set[str]:
    names, parent = set(), event.cpu_parent
    while parent is not None:
        names.add(parent.name)
        parent = parent.cpu_parent
    return names


def _split(events, wall_s: float) -> dict[str, float]:
    """Seconds of each part of a profiled forward (see the module docstring). A scope nested in another (the
    scorer inside the press's hook) counts in the inner one only."""
    out = dict.fromkeys(("weights_s", "attention_s", "scoring_s", "bookkeeping_s"), 0.0)
    for event in events:
        above = _scopes_above(event)
        seconds = event.cpu_time_total / 1e6
        if event.name.startswith("kvzap::") and event.name[7:] in _SCOPES:
            scope = event.name[7:]
            if f"kvzap::{scope}" in above:
                continue  # counted by the outer call of the same scope
            if scope == "bookkeeping":
                if not above & {"kvzap::attention", "kvzap::scoring"}:
                    out["bookkeeping_s"] += seconds
            elif "kvzap::" + ("scoring" if scope == "attention" else "attention") not in above:
                out[f"{scope}_s"] += seconds
                if "kvzap::bookkeeping" in above:
                    out["bookkeeping_s"] -= seconds
        elif event.name in _ATTENTION_KERNELS and not above & {"kvzap::attention", "kvzap::scoring"}:
            out["attention_s"] += seconds  # transformers' sdpa (no press, a dense first forward)
            if "kvzap::bookkeeping" in above:
                out["bookkeeping_s"] -= seconds
        elif event.name in _WEIGHT_OPS and not above & {"kvzap::attention", "kvzap::scoring"}:
            if not any(n in above for n in _WEIGHT_OPS + _ATTENTION_KERNELS):
                out["weights_s"] += event.self_cpu_time_total / 1e6
    out["python_and_other_ops_s"] = max(0.0, wall_s - sum(out.values()))
    out["wall_s"] = wall_s
    return out


def _resolve_chunk(mode: str, press, n: int) -> int:
    """Tokens per prefill forward of ``mode``, as the pipeline resolves them (``n``: one forward)."""
    return _chunk_size(press, chunk_of(mode)) or n


def _prefill(model, ids: torch.Tensor, press, chunk: int, cache, profile_last: bool = False):
    """Prefill ``ids`` into ``cache`` in chunks of ``chunk`` tokens (each pruned before the next attends to it, as
    the pipeline does), under ``press`` when it is applied. Returns the last chunk's logits and, with
    ``profile_last``, the time split of that chunk."""
    from torch.profiler import ProfilerActivity, profile

    from kvzap import _compat

    n = ids.shape[1]
    bounds = list(range(0, n, chunk)) + [n]
    kw = _compat.cache_kwarg_name(model)
    split = None
    with press.prefilling() if press is not None and chunk < n else contextlib.nullcontext():
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            last = profile_last and i == len(bounds) - 2
            with profile(activities=[ProfilerActivity.CPU]) if last else contextlib.nullcontext() as prof:
                start = time.perf_counter()
                positions = torch.arange(a, b, device=ids.device)[None]
                logits = model(ids[:, a:b], position_ids=positions, logits_to_keep=1, **{kw: cache}).logits
                wall = time.perf_counter() - start
            if last:
                split = {**_split(prof.events(), wall), "tokens": b - a}
    return logits, split


def first_token_of_ids(model, ids: torch.Tensor, mode: str, args) -> dict[str, float]:
    """Without a tokenizer (a random model, e.g. on a GPU machine that has no weights): the context's prefill and
    the first token's argmax, timed to the device's end of work, as :func:`one_run` times the pipeline."""
    from kvzap import _compat

    press = make_press(args) if pressed(mode) else None
    _sync(ids.device)
    start = time.perf_counter()
    with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
        cache = _compat.new_dynamic_cache(model)
        logits, _ = _prefill(model, ids, press, _resolve_chunk(mode, press, ids.shape[1]), cache)
        logits[:, -1].argmax(-1).tolist()
    _sync(ids.device)
    seconds = time.perf_counter() - start
    return {"ttft_s": seconds, "evicted_share": float(press.compression_ratio) if press is not None else 0.0}


def breakdown(model, ids: torch.Tensor, mode: str, args) -> dict[str, dict[str, float]]:
    """Profile the last prefill chunk (or the whole prefill: ``none``, ``dense``) and one decoding step (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from kvzap import _compat

    press = make_press(args) if pressed(mode) else None
    cache = _compat.new_dynamic_cache(model)
    kw = _compat.cache_kwarg_name(model)
    parts = {}
    with torch.no_grad(), _scoped(), press(model) if press is not None else contextlib.nullcontext():
        chunk = _resolve_chunk(mode, press, ids.shape[1])
        logits, parts["prefill_chunk"] = _prefill(model, ids, press, chunk, cache, profile_last=True)
        token = logits[:, -1:].argmax(-1)
        for _ in range(3):  # warm steps
            token = model(token, **{kw: cache}).logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            model(token, **{kw: cache})
            wall = time.perf_counter() - start
        parts["decode_step"] = _split(prof.events(), wall)
    return parts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local model directory (default: a random SmolLM2-sized Llama)")
    parser.add_argument("--surrogate", help="KVzap-MLP surrogate directory (default: the bundled one)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--modes", nargs="+", default=["none", "dense", "chunk:1024"])
    parser.add_argument("--threshold", type=float, default=None, help="default: -3 with --model, else 0.44")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument(
        "--sink-size", type=int, default=None, help="first tokens never evicted (default: the press's, 4 in chunks)"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup-tokens", type=int, default=4096, help="prompt length of the untimed warm-up")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--breakdown", action="store_true", help="the time split of a chunk and a step (CPU only)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.breakdown and args.device != "cpu":
        parser.error("--breakdown splits CPU time (profiled CPU operations); leave it out with --device cuda")
    for mode in args.modes:
        kind, _, size = mode.partition(":")
        if mode not in ("none", "dense", "auto") and not (kind in ("chunk", "plain") and size.isdigit()):
            parser.error(f"unknown mode {mode!r}: none, dense, auto, chunk:N or plain:N")
    if "none" not in args.modes:
        parser.error("--modes must include none (the baseline of the ratios)")
    if args.threshold is None:
        args.threshold = -3.0 if args.model else 0.44
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    # With a tokenizer, through the pipeline as a user asks; without one (the random model), the same prefill on
    # token ids.
    pipe = None if tokenizer is None else pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)

    def runner(n_tokens: int):
        ids = prompt_ids(tokenizer, n_tokens, model.config.vocab_size).to(args.device)
        if pipe is None:
            return ids, functools.partial(first_token_of_ids, model, ids)
        return ids, functools.partial(one_run, pipe, tokenizer.decode(ids[0], skip_special_tokens=True))

    # Warm-up (kernel builds, allocator), untimed: every mode once on a prompt of --warmup-tokens (at most the
    # shortest --prefill), which runs the same code as the timed prompts without a full prefill of the longest one.
    _, warm = runner(min(args.warmup_tokens, *args.prefill))
    for mode in args.modes:
        warm(mode, args)
    results = []
    for n_tokens in args.prefill:
        ids, run_mode = runner(n_tokens)
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
        for run in range(args.runs):
            for mode in args.modes if run % 2 == 0 else args.modes[::-1]:
                samples[mode].append(run_mode(mode, args))
                s = samples[mode][-1]
                print(f"  {n_tokens} tokens, run {run}, {mode}: {s['ttft_s']:.2f} s, evicted {s['evicted_share']:.1%}")
        row: dict = {"prefill_tokens": n_tokens}
        base = [s["ttft_s"] for s in samples["none"]]
        for mode in args.modes:
            times = [s["ttft_s"] for s in samples[mode]]
            ratios = run_ratios(times, base)
            row[mode] = {
                "ttft_s": statistics.median(times),
                "ttft_s_runs": times,
                "ratio_to_none": statistics.median(ratios),
                "ratio_runs": ratios,
                "evicted_share": statistics.median(s["evicted_share"] for s in samples[mode]),
            }
            print(f"{n_tokens} tokens, {mode}: {row[mode]['ttft_s']:.2f} s, x{row[mode]['ratio_to_none']:.2f}")
        if args.breakdown:
            kvzap_modes = [m for m in args.modes if pressed(m)]
            row["breakdown"] = {m: breakdown(model, ids, m, args) for m in ["none", *kvzap_modes[-1:]]}
        results.append(row)
    info = meta(
        threshold=args.threshold,
        window=args.window,
        sink_size=args.sink_size,
        runs=args.runs,
        device=args.device,
        dtype=args.dtype,
    )
    write_results(args.json, info, results)


if __name__ == "__main__":
    main()
