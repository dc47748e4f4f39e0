"""Accuracy-vs-compression evaluation of kvzap presses on long-context benchmarks.

``python -m evaluation --press no_press kvzap_mlp --threshold -5 -4 --lengths 4096`` runs a sweep on the offline
RULER-style suite; ``--dataset ruler|longbench|aime25`` runs a standard benchmark (from the Hub, or from local
files with ``--dataset-path``); ``python -m evaluation plot --results-dir outputs/evaluation`` plots it.
See ``evaluation/README.md``.

Which file holds what, each importing only files named before it:

Datasets and scoring
    ``ruler.py`` (the offline RULER-style generator), ``metrics.py`` (the tasks' metrics), ``longbench.py`` and
    ``aime.py`` (their prompts and scoring), ``benchmarks.py`` (the registry of datasets and their loaders),
    ``intervals.py`` (bootstrap confidence intervals, paired differences), ``presses.py`` (the registry of press
    factories and surrogate fingerprints).
Reading run directories
    ``rundirs.py``: the files of a run directory (``config.json``, ``samples.json``, ``predictions.csv``,
    ``predictions.partial.jsonl``, ``metrics.json``), how to read them, and the scores a run's rows give.
Running
    ``config.py`` (a sweep's settings, validated), ``plan.py`` (its runs and their directory names and hashes),
    ``runner.py`` (answering and scoring the samples, writing each run directory).
Reports, reading run directories only (never the runner)
    ``compare.py`` (paired difference of two runs), ``errors.py`` (how needle answers went wrong),
    ``collect.py`` (every run below a directory, pooled over seeds, against the full cache), ``summary.py``
    (its markdown table and CSV), ``plots.py`` (its figures and ``plot``), ``tables.py`` (the tables of
    docs/accuracy.md, printed from the committed runs).
Command line
    ``cli.py`` (``python -m evaluation`` and ``kvzap evaluate``: a sweep, or a report), ``__main__.py``.
"""

from .benchmarks import BENCHMARKS, DEFAULT_DATASET, Benchmark, LoadRequest
from .cli import main
from .config import EvalConfig, load_config
from .metrics import (
    best_over_references,
    boxed_match,
    last_boxed,
    sample_score,
    string_match_all,
    string_match_part,
)
from .presses import PRESSES, PressNotAvailableError, make_press
from .ruler import DEFAULT_TASKS, TASKS, generate_samples, generate_task
from .runner import run_evaluation

__all__ = [
    "DEFAULT_TASKS",
    "TASKS",
    "generate_samples",
    "generate_task",
    "string_match_all",
    "string_match_part",
    "sample_score",
    "best_over_references",
    "last_boxed",
    "boxed_match",
    "BENCHMARKS",
    "DEFAULT_DATASET",
    "Benchmark",
    "LoadRequest",
    "PRESSES",
    "PressNotAvailableError",
    "make_press",
    "EvalConfig",
    "load_config",
    "run_evaluation",
    "main",
]
