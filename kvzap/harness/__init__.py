"""kvzap in lm-evaluation-harness: the ``kvzap`` model (registered with lm-eval when this package is imported),
the ``kvzap harness`` command line and offline task configs (``tasks/``, for ``--include_path``).

Needs the ``harness`` extra: ``pip install "kvzap[harness]"`` (lm-eval 0.4 with its ``hf`` extra). Guide:
docs/harness.md.
"""

from __future__ import annotations

from pathlib import Path

try:
    from .model import KVzapLM, check_model_args
except ModuleNotFoundError as error:  # pragma: no cover - depends on the installed extras
    if error.name is None or not error.name.startswith("lm_eval"):
        raise
    raise ModuleNotFoundError(
        "kvzap.harness needs lm-evaluation-harness: pip install 'kvzap[harness]' (lm-eval 0.4 with its hf extra).",
        name=error.name,
    ) from error

__all__ = ["KVzapLM", "TASKS_DIR", "check_model_args"]

#: The offline task configs, for lm-eval's ``--include_path``.
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
