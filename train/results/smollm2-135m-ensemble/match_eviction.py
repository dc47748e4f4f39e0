"""Share of the KV cache a KVzap MLP press evicts on every fourth sample of the 2k needle suite (prefill only).

Finds the threshold at which two surrogates evict the same share, before comparing them on the suite at matched
eviction. Prints ``seed surrogate threshold mean-eviction`` per threshold.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/match_eviction.py --seed 0 --thresholds -3 -3.1 \\
        [--surrogate train/results/smollm2-135m-ensemble/HGpref/mlp]

Its helpers also serve ``allocation/allocation.py`` (the per-layer and per-head shares of the same prefill).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import kvzap.pipeline  # noqa: F401  (registers the kv-press-text-generation task)
from evaluation import ruler
from evaluation.presses import make_press
from kvzap.models import resolve_model

TASKS = ["niah_single", "niah_single_text", "niah_multikey", "niah_multiquery", "niah_multiquery_text"]


def load_pipeline(threads: int):
    """The SmolLM2 kv-press pipeline (float32, ``threads`` CPU threads)."""
    torch.set_num_threads(threads)
    path = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


def needle_samples(pipe, tasks, length: int, n_samples: int, seed: int, every: int) -> list[dict]:
    """Every ``every``-th sample of the suite's ``tasks`` (``n_samples`` each), in task order."""
    samples = [s for task in tasks for s in ruler.generate_task(task, pipe.tokenizer, length, n_samples, seed)]
    return samples[::every]


def prefill(pipe, sample: dict, threshold: float, surrogate: str | None):
    """Run ``sample``'s prefill (one generated token) under a fresh KVzap MLP press; return the press."""
    press = make_press("kvzap_mlp", threshold, surrogate=surrogate)
    pipe(
        sample["context"],
        question=sample["question"],
        answer_prefix=sample["answer_prefix"],
        press=press,
        max_new_tokens=1,
    )
    return press


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thresholds", type=float, nargs="+", required=True)
    parser.add_argument("--surrogate", default=None, help="MLP surrogate directory (default: the bundled one).")
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()
    pipe = load_pipeline(threads=1)
    samples = needle_samples(pipe, TASKS, args.length, 40, args.seed, every=4)
    for threshold in args.thresholds:
        evicted = [float(prefill(pipe, s, threshold, args.surrogate).sample_compression_ratios[0]) for s in samples]
        print(args.seed, args.surrogate, threshold, sum(evicted) / len(evicted), flush=True)
