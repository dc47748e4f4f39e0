"""``kvzap harness data``: write the local files the kvzap task configs read, from ``kvzap evaluate``'s loaders.

One ``<dataset>.jsonl`` per dataset, one row per sample, the samples ``kvzap evaluate`` would run with the same
options (the offline needle generator, or RULER / LongBench / AIME read from local files with ``--dataset-path``):
each row holds the sample's fields plus ``benchmark`` and, for greedy datasets, ``kvzap_pipeline: true`` (the
kvzap model then answers it as ``kvzap evaluate`` does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["write_data", "main"]


def write_data(
    dataset: str,
    out: str | Path,
    tokenizer,
    *,
    tasks: list[str] | None = None,
    length: int | None = 4096,
    n_samples: int = 10,
    seed: int = 0,
    path: str | None = None,
    fraction: float = 1.0,
    haystack_file: str | None = None,
    max_context_length: int | None = None,
) -> Path:
    """Write ``<out>/<dataset>.jsonl`` and return its path (the arguments are ``kvzap evaluate``'s)."""
    from kvzap.evaluation.benchmarks import BENCHMARKS, LoadRequest

    if dataset not in BENCHMARKS:
        raise ValueError(f"Unknown dataset {dataset!r}: choose one of {', '.join(BENCHMARKS)}.")
    benchmark = BENCHMARKS[dataset]
    if benchmark.hub_id is not None and path is None:
        raise ValueError(
            f"{dataset} is read from local files here: pass --dataset-path (a file or directory in the format "
            f"of {benchmark.hub_id}, as `kvzap evaluate --dataset-path` takes it)."
        )
    chosen = tuple(tasks or benchmark.default_tasks)
    unknown = [t for t in chosen if t not in benchmark.tasks]
    if unknown:
        raise ValueError(
            f"Unknown task(s) of {dataset}: {', '.join(unknown)}; choose from {', '.join(benchmark.tasks)}."
        )
    request = LoadRequest(
        tasks=chosen,
        length=length if benchmark.uses_lengths else None,
        path=path,
        fraction=fraction,
        seed=seed,
        n_samples=n_samples,
        haystack_file=haystack_file,
        max_context_length=max_context_length,
    )
    samples = benchmark.load(request, tokenizer)
    target = Path(out).expanduser()
    target.mkdir(parents=True, exist_ok=True)
    file = target / f"{dataset}.jsonl"
    with file.open("w", encoding="utf-8") as handle:
        for sample in samples:
            row = {**sample, "benchmark": dataset, "kvzap_pipeline": not benchmark.sampled}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return file


def main(argv: list[str] | None = None, prog: str = "kvzap harness data") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="ruler_offline", help="ruler_offline (default), ruler, longbench, aime25")
    parser.add_argument("--out", required=True, help="directory to write <dataset>.jsonl into (the tasks' data_dir)")
    parser.add_argument("--model", default=None, help="whose tokenizer sizes the samples (default smollm2-135m)")
    parser.add_argument("--tasks", nargs="+", help="task names of the dataset (default: its defaults)")
    parser.add_argument("--length", type=int, default=4096, help="ruler_offline / ruler: prompt length in tokens")
    parser.add_argument("--n-samples", type=int, default=10, help="ruler_offline: samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset-path", help="ruler, longbench, aime25: the local file or directory to read")
    parser.add_argument("--fraction", type=float, default=1.0, help="share of each task's samples (local datasets)")
    parser.add_argument("--haystack-file", help="ruler_offline: text file for the real-text haystack")
    parser.add_argument("--max-context-length", type=int, help="longbench: truncate contexts in the middle")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from kvzap.models import resolve_model

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
        file = write_data(
            args.dataset,
            args.out,
            tokenizer,
            tasks=args.tasks,
            length=args.length,
            n_samples=args.n_samples,
            seed=args.seed,
            path=args.dataset_path,
            fraction=args.fraction,
            haystack_file=args.haystack_file,
            max_context_length=args.max_context_length,
        )
    except (ValueError, OSError) as error:
        print(f"{prog}: error: {error}", file=__import__("sys").stderr)
        return 2
    print(
        f"wrote {file}; run with --include_path {Path(__file__).resolve().parent / 'tasks'} "
        f'--metadata \'{{"data_dir": "{file.parent}"}}\''
    )
    return 0
