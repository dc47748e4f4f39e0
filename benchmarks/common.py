"""Shared pieces of the benchmarks: the model, the prompt, one timed prefill + decode, medians and metadata.

Imported by ``bench_decode.py`` (kvzap, newest transformers) and ``bench_kvpress.py`` (kvpress 0.5.5,
transformers 5.2.x, its own virtual environment), so both measure the same thing the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig

# A random-weight Llama with the sizes of SmolLM2-135M, for machines without the default model.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


# How dropped host memory goes back to the system (kvzap.heap.set_heap_release): the default (the dropped pairs'
# own pages, and a heap trim when resident memory outgrows the pools by 32 MiB), trims only, a trim after every
# layer (each trim makes the next layer fault its pages in again: the cost the default's rule avoids), or nothing
# (freed memory stays in the allocator).
HEAP_RELEASE = {
    "pages": {},
    "trim": {"pages": False},
    "trim_every_layer": {"min_bytes": 0, "pages": False},
    "off": {"min_bytes": None, "pages": False},
}


def load(path: str | None, device: str = "cpu", dtype: str = "float32"):
    """``(model, tokenizer or None)``: a local model directory, or the random SmolLM2-sized Llama."""
    torch_dtype = getattr(torch, dtype)
    if path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
        return model.to(device).eval(), AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), attn_implementation="sdpa")
    return model.to(device=device, dtype=torch_dtype).eval(), None


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_ids(tokenizer, n_tokens: int, vocab_size: int) -> torch.Tensor:
    """``(1, n_tokens)``: real documentation text when a tokenizer is given (the demo's), else random ids."""
    if tokenizer is None:
        return torch.randint(3, vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(n_tokens))
    from kvzap.cli import demo_context

    ids = tokenizer(demo_context(tokenizer, n_tokens + 200), return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"The benchmark text has only {ids.shape[1]} tokens, fewer than {n_tokens}.")
    return ids


def cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def prefill_and_decode(
    model,
    prompt: torch.Tensor,
    n_decode: int,
    applied=None,
    kv_bytes: Callable | None = None,
    chunk_size: int | None = None,
    prefilling: Callable | None = None,
):
    """Prefill ``prompt`` then greedily decode ``n_decode`` tokens inside the context manager ``applied``.

    With ``chunk_size``, the prompt is prefilled in chunks of that many tokens inside ``prefilling()`` (a
    press's :meth:`~kvzap.presses.base.BasePress.prefilling`, so that each chunk is pruned as prompt).
    Returns prefill seconds, decode tokens/s (inverse of the median step: robust to load spikes), the mean
    rate, and ``kv_bytes(cache)`` after the prefill and after decoding when given.
    """
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    out: dict[str, float] = {}
    device = model.device
    prompt = prompt.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with applied if applied is not None else contextlib.nullcontext():
        _sync(device)
        start = time.perf_counter()
        chunk = chunk_size or prompt.shape[1]
        with prefilling() if prefilling is not None and chunk < prompt.shape[1] else contextlib.nullcontext():
            for begin in range(0, prompt.shape[1], chunk):
                logits = model(prompt[:, begin : begin + chunk], logits_to_keep=1, **{kw: cache}).logits
        _sync(device)
        out["prefill_s"] = time.perf_counter() - start
        if kv_bytes is not None:
            out["kv_bytes_after_prefill"] = kv_bytes(cache)
        token = logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(n_decode):
            start = time.perf_counter()
            token = model(token, **{kw: cache}).logits[:, -1:].argmax(-1)
            _sync(device)
            steps.append(time.perf_counter() - start)
        if kv_bytes is not None:
            out["kv_bytes_after_decode"] = kv_bytes(cache)
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    out["decode_tok_s"] = 1.0 / statistics.median(steps)
    out["decode_tok_s_mean"] = len(steps) / sum(steps)
    return out, cache


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


_PAIRED = ("decode_tok_s", "prefill_s")  # timed figures whose per-run values and ratios sweep() keeps


def run_ratios(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Each run's figure over the baseline's figure of the same run. The modes alternate inside a run, so a slow
    stretch of the machine hits both: the median of these is robust to drift across runs, which the ratio of the
    two medians is not."""
    return [value / base for value, base in zip(values, baseline, strict=True)]


def sweep(model, tokenizer, args, modes: Sequence[str], one_run: Callable) -> list[dict]:
    """For every ``args.prefill`` length, ``args.runs`` runs of every mode (alternating, so that machine noise
    hits them alike) reduced to medians, with the timed figures' per-run values and, against ``none``, each run's
    ratio and their median (robust to drift across runs, which the ratio of the medians is not); with
    ``args.peak_memory``, one run of that mode (run it in a fresh process: the peak is the process's)."""
    results = []
    for n_tokens in args.prefill:
        prompt = prompt_ids(tokenizer, n_tokens, model.config.vocab_size)
        if args.peak_memory:
            row = one_run(model, args.peak_memory, prompt, args)
            row.update(mode=args.peak_memory, prefill_tokens=n_tokens, peak_rss_mb=peak_rss_mb())
            results.append(row)
            print(json.dumps(row))
            continue
        samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for run in range(args.runs):
            for mode in modes:
                samples[mode].append(one_run(model, mode, prompt, args))
                s = samples[mode][-1]
                print(
                    f"  {n_tokens} tokens, run {run}, {mode}: prefill {s['prefill_s']:.2f} s, "
                    f"decode {s['decode_tok_s']:.2f} tok/s, evicted {s['evicted_share']:.1%}",
                    flush=True,
                )
        row = {"prefill_tokens": n_tokens, "full_kv_bytes": full_kv_bytes(model, n_tokens)}
        for mode in modes:
            row.update({f"{mode}_{key}": value for key, value in medians(samples[mode]).items()})
            row.update({f"{mode}_{key}_runs": [s[key] for s in samples[mode]] for key in _PAIRED})
        if "none" in modes:  # each run's own ratio to no press (the modes alternate inside a run), and their median
            for mode in modes:
                for key in _PAIRED:
                    ratios = run_ratios([s[key] for s in samples[mode]], [s[key] for s in samples["none"]])
                    row[f"{mode}_{key}_ratio_runs"] = ratios
                    row[f"{mode}_{key}_ratio"] = statistics.median(ratios)
        results.append(row)
    return results


def write_results(path: str | None, setup: dict, results: list[dict]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": setup, "results": results}, indent=2))
        print(f"wrote {path}")


def full_kv_bytes(model, n_tokens: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * n_kv * n_tokens * head_dim * torch.finfo(model.dtype).bits // 8


def resident_mb() -> float:
    """Resident memory (MB) of this process now (Linux: ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """Peak resident memory (MB) of this process's own address space so far.

    Linux's ``VmHWM`` (``/proc/self/status``). Not ``getrusage().ru_maxrss``: Linux carries the parent's peak into
    a child across fork and exec, so a process started by a large one (``bench_memory.py`` after its own
    measures, ~2 GB) reports at least the parent's size whatever it used itself. Elsewhere, ``ru_maxrss`` (kB on
    Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    scale = 2**20 if sys.platform == "darwin" else 2**10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def _commit() -> str | None:
    """The checkout's short commit, ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def command_line() -> str:
    """How this process was started, as a reader would retype it (``python -m benchmarks.NAME ...``)."""
    script = Path(sys.argv[0])
    start = f"python -m benchmarks.{script.stem}" if script.parent.name == "benchmarks" else f"python {sys.argv[0]}"
    return " ".join([start, shlex.join(sys.argv[1:])]).strip()


def meta(**extra) -> dict:
    """What a reader needs to reproduce a results file: the software, the machine, and the date, commit and
    command of the run (BENCHMARKS.md prints them above every table)."""
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    return {
        **gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _commit(),
        "command": command_line(),
        **extra,
    }
