"""RULER's scores: is each reference string in the prediction (case-insensitive)?

``string_match_all`` scores a sample by the share of its references found (needle, variable tracking, common and
frequent words tasks); ``string_match_part`` gives full marks if any reference is found (QA). Both average over
samples and are reported in percent, as RULER reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["string_match_all", "string_match_part", "sample_score", "METRICS"]


def _check(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if isinstance(predictions, str):
        raise TypeError("predictions must be a sequence of strings, one per sample, not a single string.")
    if len(predictions) != len(references):
        raise ValueError(f"Got {len(predictions)} predictions but {len(references)} reference lists.")
    for refs in references:
        if isinstance(refs, str) or not refs:
            raise ValueError("Each sample needs a non-empty list of reference strings.")


def _all(prediction: str, refs: Sequence[str]) -> float:
    text = prediction.lower()
    return sum(ref.lower() in text for ref in refs) / len(refs)


def _part(prediction: str, refs: Sequence[str]) -> float:
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in refs))


def _mean_percent(per_sample, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """100 x the mean of ``per_sample(prediction, references)`` over samples (0.0 for no samples)."""
    _check(predictions, references)
    if not predictions:
        return 0.0
    return 100.0 * sum(per_sample(p, r) for p, r in zip(predictions, references, strict=True)) / len(predictions)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the share of references contained in the prediction, in percent.

    Parameters
    ----------
    predictions : one generated string per sample.
    references : one non-empty list of reference strings per sample.

    Returns
    -------
    float in [0, 100]; 0.0 for no samples.
    """
    return _mean_percent(_all, predictions, references)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Share of samples whose prediction contains at least one reference, in percent.

    Parameters
    ----------
    predictions : one generated string per sample.
    references : one non-empty list of reference strings per sample.

    Returns
    -------
    float in [0, 100]; 0.0 for no samples.
    """
    return _mean_percent(_part, predictions, references)


#: Metric name (as in :class:`evaluation.ruler.TaskSpec`) -> corpus-level function.
METRICS = {"all": string_match_all, "part": string_match_part}


def sample_score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """Score one sample with its task's metric, in percent (0-100).

    Parameters
    ----------
    task : a task of :data:`evaluation.ruler.TASKS` (``qa`` uses ``part``, every other task ``all``).
    prediction : the generated answer.
    answers : the reference strings.
    """
    from evaluation.ruler import TASKS

    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    return METRICS[TASKS[task].metric]([prediction], [list(answers)])
