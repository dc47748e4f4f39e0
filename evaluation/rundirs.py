"""The files of a run directory, and how to read them back.

:mod:`evaluation.runner` writes one directory per run; the reports (:mod:`evaluation.compare`,
:mod:`evaluation.errors`, :mod:`evaluation.plots`) read them through this module only, so they never need the
runner. A run directory holds:

``config.json``
    The run's resolved settings (:func:`read_config`).
``samples.json``
    A fingerprint of every sample the run answers, by ``task/id`` (:func:`sample_fingerprints`,
    :func:`read_sample_fingerprints`).
``predictions.partial.jsonl``
    The rows of an unfinished run, one JSON object a line, appended as samples finish (:func:`read_partial`).
``predictions.csv``
    One row per sample, :data:`PREDICTION_COLUMNS` (:func:`read_predictions`).
``metrics.json``
    The run's scores with their 95% intervals (:func:`summarize_rows`); its presence marks the run as finished.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .intervals import run_intervals

__all__ = [
    "PARTIAL",
    "SAMPLES",
    "PREDICTION_COLUMNS",
    "sample_key",
    "sample_fingerprints",
    "read_partial",
    "read_predictions_csv",
    "read_predictions",
    "read_run",
    "read_config",
    "read_metrics",
    "read_sample_fingerprints",
    "sample_settings",
    "task_compression",
    "summarize_rows",
]

#: Rows of an unfinished run, one JSON object a line, appended as samples finish (deleted once the run is done).
PARTIAL = "predictions.partial.jsonl"
#: A run's fingerprint of every sample it answers, by sample key (written beside ``config.json``).
SAMPLES = "samples.json"
#: The columns of ``predictions.csv`` (``answers`` is a JSON list of str).
PREDICTION_COLUMNS = ("task", "id", "prediction", "answers", "score", "compression_ratio", "n_tokens")


def sample_key(sample: dict[str, Any]) -> str:
    """A sample's key in a run (``task/id``): what pairs the samples of two runs."""
    return f"{sample['task']}/{sample['id']}"


def sample_fingerprints(samples: Sequence[dict[str, Any]]) -> dict[str, str]:
    """A short hash of what each sample asks (context, question, answer prefix, answers), by sample key
    (``task/id``): two runs answered the same sample when their fingerprints of its key agree, whatever their
    settings say (:func:`evaluation.compare.compare_runs` reads them)."""
    fields = ("context", "question", "answer_prefix", "answers")
    return {
        sample_key(s): hashlib.sha256(json.dumps([s.get(f) for f in fields]).encode()).hexdigest()[:16] for s in samples
    }


def read_partial(path: Path) -> dict[str, dict[str, Any]]:
    """Rows an interrupted run already wrote, by sample key; a last line cut off by the interruption is dropped."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the process was killed while writing this line
        done[sample_key(row)] = row
    return done


def read_predictions_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a ``predictions.csv`` as written, every value a str (``answers`` still JSON)."""
    with Path(path).open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def read_predictions(run_dir: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows a run directory's predictions hold (every column; ``answers`` a list of str) and whether the run
    is finished: its ``predictions.csv``, else its ``predictions.partial.jsonl``; raises FileNotFoundError when the
    directory holds neither."""
    run_dir = Path(run_dir)
    finished = run_dir / "predictions.csv"
    if finished.is_file():
        rows = read_predictions_csv(finished)
        for row in rows:
            row["answers"] = json.loads(row["answers"])
        return rows, True
    partial = run_dir / PARTIAL
    if partial.is_file():
        return list(read_partial(partial).values()), False
    raise FileNotFoundError(
        f"{run_dir} holds no predictions.csv nor predictions.partial.jsonl: give a run directory of "
        "`python -m evaluation` (one per press, value and length, under <output-dir>/<model>/)."
    )


def read_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """The sample rows of a run directory (``task``, ``id``, ``score``, ``compression_ratio``) and whether the run
    is finished (:func:`read_predictions`)."""
    rows, finished = read_predictions(run_dir)
    return [_row(r) for r in rows], finished


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "task": row["task"],
        "id": str(row["id"]),
        "score": float(row["score"]),
        "compression_ratio": float(row["compression_ratio"]),
    }


def read_config(run: str | Path) -> dict[str, Any] | None:
    """A run directory's ``config.json``, or None when it has none (runs of older versions)."""
    path = Path(run) / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_metrics(run: str | Path) -> dict[str, Any] | None:
    """A run directory's ``metrics.json``, or None while the run is unfinished."""
    path = Path(run) / "metrics.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_sample_fingerprints(run: str | Path) -> dict[str, str] | None:
    """A run directory's ``samples.json`` (``task/id`` -> fingerprint of the sample's prompt and answers, written by
    :func:`sample_fingerprints`), or None when it has none (runs of older versions)."""
    path = Path(run) / SAMPLES
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def sample_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run's ``config.json`` that decide what its samples are, beyond their ids: the dataset,
    where it was read (``source``), the length and the context budget; for generated samples (``source`` None:
    the offline RULER generator) also the seed, the haystack text and the model, whose tokenizer fills the
    haystack; for samples truncated to ``max_context_length``, the model too. Settings a config lacks (runs of
    older versions) are left out."""
    keys = ["dataset", "source", "length", "max_context_length"]
    if config.get("source") is None:
        keys += ["seed", "haystack", "model"]
    elif config.get("max_context_length") is not None:
        keys.append("model")
    return {key: config[key] for key in keys if key in config}


def task_compression(rows: list[dict[str, Any]], tasks: Iterable[str]) -> dict[str, float]:
    """Mean compression ratio of each task's samples (``rows``: predictions with ``task`` and
    ``compression_ratio``)."""
    out = {}
    for task in tasks:
        ratios = [float(r["compression_ratio"]) for r in rows if r["task"] == task]
        out[task] = sum(ratios) / len(ratios)
    return out


def summarize_rows(rows: list[dict[str, Any]], tasks: Sequence[str]) -> dict[str, Any]:
    """The scores ``metrics.json`` holds, computed from a run's rows (``task``, ``score``, ``compression_ratio``).

    Per-task scores (mean of the sample scores, percent) of the ``tasks`` that have rows, their mean, the mean
    compression ratio (overall and per task: tasks of one run evict different shares, and a task is compared at its
    own), the sample counts and the 95% confidence interval of every score
    (:func:`evaluation.intervals.run_intervals`). Results pooled over seeds are computed the same way from all
    their runs' rows."""
    by_task = {}
    for task in tasks:
        scores = [r["score"] for r in rows if r["task"] == task]
        if scores:
            by_task[task] = scores
    per_task = {task: sum(scores) / len(scores) for task, scores in by_task.items()}
    ratios = [r["compression_ratio"] for r in rows]
    return {
        "score": sum(per_task.values()) / len(per_task),  # mean over tasks, as RULER and LongBench average
        "tasks": per_task,
        "compression_ratio": sum(ratios) / len(ratios),
        "tasks_compression_ratio": task_compression(rows, by_task),
        "n_predictions": len(rows),
        "tasks_n": {task: len(scores) for task, scores in by_task.items()},
        **run_intervals(by_task),
    }
