"""Accuracy-vs-compression evaluation of kvzap presses on long-context benchmarks.

``python -m evaluation --press no_press kvzap_mlp --threshold -5 -4 --lengths 4096`` runs a sweep on the offline
RULER-style suite; ``--dataset ruler|longbench|aime25`` runs a standard benchmark (from the Hub, or from local
files with ``--dataset-path``); ``python -m evaluation plot --results-dir outputs/evaluation`` plots it.
See ``evaluation/README.md``.
"""

from .benchmarks import BENCHMARKS, DEFAULT_DATASET, Benchmark, LoadRequest
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
from .runner import EvalConfig, load_config, main, run_evaluation

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
