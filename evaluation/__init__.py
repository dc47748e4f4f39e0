"""Offline accuracy-vs-compression evaluation of kvzap presses on RULER-style tasks.

``python -m evaluation --press no_press kvzap_mlp --threshold -5 -4 --lengths 4096`` runs a sweep;
``python -m evaluation plot --results-dir outputs/evaluation`` plots it. See ``evaluation/README.md``.
"""

from evaluation.metrics import sample_score, string_match_all, string_match_part
from evaluation.presses import PRESSES, PressNotAvailableError, make_press
from evaluation.ruler import DEFAULT_TASKS, TASKS, generate_samples, generate_task
from evaluation.runner import EvalConfig, load_config, main, run_evaluation

__all__ = [
    "DEFAULT_TASKS",
    "TASKS",
    "generate_samples",
    "generate_task",
    "string_match_all",
    "string_match_part",
    "sample_score",
    "PRESSES",
    "PressNotAvailableError",
    "make_press",
    "EvalConfig",
    "load_config",
    "run_evaluation",
    "main",
]
