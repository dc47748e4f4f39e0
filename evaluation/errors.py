"""``python -m evaluation errors RUN_DIR [RUN_DIR ...]``: how a run's needle answers went wrong.

A score says how many needles a run found, not why it missed the others, and the reasons call for different
explanations. Each number a ``niah_*`` sample asks for (of the offline RULER-style suite, :mod:`evaluation.ruler`)
ends in one of four outcomes:

``found``
    The number is in the answer (what the task's metric counts).
``other needle``
    It is not, but the answer holds the number of another needle of the same context, one the question did not ask
    for (a distractor of ``niah_multikey``): a needle was read, not the one asked for.
``garbled``
    Otherwise, the answer holds a number that is not any needle's but lies within two digit edits (Levenshtein) of
    the asked one: part of the needle survived.
``lost``
    Anything else: no trace of the needle.

The samples are regenerated from the run's ``config.json`` (task, length, seed, haystack) with the model's
tokenizer, and each must have the answers the run recorded. Unfinished runs are read from their
``predictions.partial.jsonl``.

With ``--by-position TOKENS`` each asked number is also counted by where its needle sits: the tokens of the
context before it, in bins of ``TOKENS`` (pass a chunked run's chunk size to see which chunk lost its needles;
the chat template's few tokens before the context are not counted).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import ruler
from .rundirs import read_config, read_predictions

__all__ = ["OUTCOMES", "classify_answer", "needle_errors", "format_errors", "main"]

OUTCOMES = ("found", "other needle", "garbled", "lost")
_NUMBER = re.compile(r"\d+")


def _edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def classify_answer(prediction: str, expected: str, answers: Sequence[str], needles: Sequence[str]) -> str:
    """The outcome (one of :data:`OUTCOMES`) of one asked number.

    Parameters
    ----------
    prediction : the generated answer.
    expected : the asked number whose outcome is wanted.
    answers : every number the sample asks for (a distractor is a needle not among them).
    needles : the numbers of every needle of the sample's context.
    """
    if expected.lower() in prediction.lower():
        return "found"
    numbers = _NUMBER.findall(prediction)
    if any(n in needles and n not in answers for n in numbers):
        return "other needle"
    if any(n not in needles and _edit_distance(n, expected) <= 2 for n in numbers):
        return "garbled"
    return "lost"


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's ``config.json``, checked to be a run of the offline RULER-style suite."""
    config = read_config(run_dir)
    if config is None:
        raise FileNotFoundError(f"{run_dir} has no config.json: give a run directory of `python -m evaluation`.")
    if config.get("dataset") != "ruler_offline":
        raise ValueError(
            f"{run_dir} is a run of {config.get('dataset')!r}; needle errors are defined for the offline "
            "RULER-style suite (--dataset ruler_offline) only."
        )
    return config


def _needle_position(tokenizer: Any, context: str, expected: str) -> int:
    """Tokens of ``context`` before the needle that holds the number ``expected``."""
    match = next(m for m in ruler.NEEDLE_PATTERN.finditer(context) if m.group(2) == expected)
    return len(tokenizer.encode(context[: match.start()], add_special_tokens=False))


def needle_errors(run_dir: str | Path, tokenizer: Any, bin_tokens: int | None = None) -> dict[str, Any]:
    """Count the outcomes of the asked numbers of a run's ``niah_*`` samples, per task.

    Parameters
    ----------
    run_dir : a run directory of ``python -m evaluation`` on ``ruler_offline``.
    tokenizer : the tokenizer of the run's model (it fits the samples to their length).
    bin_tokens : also count the outcomes by the position of each asked needle in the context, in bins of this many
        tokens (e.g. a chunked prefill's chunk size). None: not counted.

    Returns
    -------
    dict with ``run_dir``, ``press``, ``value``, ``compression`` (mean over the samples read), ``finished`` and
    ``tasks``: task -> ``{"samples", "answers", "outcomes": {outcome: count}}``; with ``bin_tokens``, each task
    also has ``"by_position"``: first token of a bin -> ``{outcome: count}`` (bins in order, empty ones left out).

    Raises
    ------
    ValueError
        If the run is not of the offline suite, holds no ``niah_*`` sample, or a regenerated sample's answers are
        not those the run recorded (another tokenizer, haystack or generator).
    """
    if bin_tokens is not None and (isinstance(bin_tokens, bool) or not isinstance(bin_tokens, int) or bin_tokens < 1):
        raise ValueError(f"bin_tokens must be a positive int (tokens per position bin) or None, got {bin_tokens!r}.")
    run_dir = Path(run_dir)
    config = run_config(run_dir)
    rows, finished = read_predictions(run_dir)
    rows = [r for r in rows if r["task"].startswith("niah")]
    if not rows:
        raise ValueError(f"{run_dir} holds no answered niah_* sample.")
    text = (config.get("sweep") or {}).get("haystack_file")
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_task.setdefault(row["task"], []).append(row)
    tasks: dict[str, dict[str, Any]] = {}
    for task, task_rows in sorted(by_task.items()):
        count = 1 + max(int(r["id"].rsplit("-", 1)[1]) for r in task_rows)
        samples = {
            s["id"]: s for s in ruler.generate_task(task, tokenizer, config["length"], count, config["seed"], text)
        }
        outcomes: Counter[str] = Counter()
        by_position: dict[int, Counter[str]] = {}
        for row in task_rows:
            sample = samples[row["id"]]
            if list(sample["answers"]) != list(row["answers"]):
                raise ValueError(
                    f"Sample {row['id']} regenerated with this tokenizer asks for {sample['answers']}, the run "
                    f"recorded {row['answers']}: pass the tokenizer of the run's model ({config.get('model')})."
                )
            needles = ruler.needle_values(sample["context"])
            for expected in sample["answers"]:
                outcome = classify_answer(row["prediction"], expected, sample["answers"], needles)
                outcomes[outcome] += 1
                if bin_tokens is not None:
                    start = _needle_position(tokenizer, sample["context"], expected) // bin_tokens * bin_tokens
                    by_position.setdefault(start, Counter())[outcome] += 1
        tasks[task] = {
            "samples": len(task_rows),
            "answers": sum(outcomes.values()),
            "outcomes": {o: outcomes[o] for o in OUTCOMES},
        }
        if bin_tokens is not None:
            tasks[task]["by_position"] = {
                start: {o: by_position[start][o] for o in OUTCOMES} for start in sorted(by_position)
            }
    return {
        "run_dir": str(run_dir),
        "press": config.get("press"),
        "value": config.get("value"),
        "compression": sum(float(r["compression_ratio"]) for r in rows) / len(rows),
        "finished": finished,
        "bin_tokens": bin_tokens,
        "tasks": tasks,
    }


def format_errors(results: Sequence[dict[str, Any]]) -> str:
    """The outcomes as a Markdown table, one row per run and task (shares of the asked numbers, in %); runs
    counted by position (``bin_tokens``) get a row per position bin too, under their task's."""
    binned = any(result.get("bin_tokens") for result in results)
    out = [
        "| run | press | value | evicted | task |"
        + (" needle at tokens |" if binned else "")
        + " asked numbers | "
        + " | ".join(OUTCOMES)
        + " |",
        "|---|---|---|---|---|" + ("---|" if binned else "") + "---|" + "---|" * len(OUTCOMES),
    ]

    def row(head: str, where: str, counts: dict[str, int]) -> str:
        answers = sum(counts.values())
        shares = " | ".join(f"{100 * counts[o] / answers:.1f}" for o in OUTCOMES)
        return head + (f" {where} |" if binned else "") + f" {answers} | {shares} |"

    for result in results:
        name = Path(result["run_dir"]).name + ("" if result["finished"] else " (unfinished)")
        value = "-" if result["value"] is None else f"{result['value']:g}"
        size = result.get("bin_tokens")
        for task, entry in result["tasks"].items():
            head = f"| {name} | {result['press']} | {value} | {100 * result['compression']:.1f}% | {task} |"
            out.append(row(head, "all", entry["outcomes"]))
            for start, counts in entry.get("by_position", {}).items():
                out.append(row(head, f"{int(start)}-{int(start) + size - 1}", counts))
    return "\n".join(out) + "\n"


def _tokenizer_for(name: str | None):
    from transformers import AutoTokenizer

    try:
        from kvzap.models import resolve_model
    except ImportError:  # the default-model loader is optional: a Hub id or a local directory loads as is
        return AutoTokenizer.from_pretrained(name)
    return AutoTokenizer.from_pretrained(resolve_model(name))


def main(argv: list[str] | None = None, prog: str = "python -m evaluation errors") -> int:
    """``python -m evaluation errors RUN_DIR [RUN_DIR ...] [--tokenizer NAME] [--json]``; prints the table."""
    import sys

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of the offline suite")
    parser.add_argument(
        "--tokenizer",
        help="the runs' model (Hub id, local directory or short name) whose tokenizer regenerates the samples; "
        "default: the model each run's config.json names",
    )
    parser.add_argument(
        "--by-position",
        type=int,
        metavar="TOKENS",
        help="also count the outcomes by where each asked needle sits in the context, in bins of TOKENS tokens "
        "(a chunked run's chunk size shows which chunk lost its needles)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.by_position is not None and args.by_position < 1:
        parser.error(f"--by-position takes a positive number of tokens, got {args.by_position}.")
    tokenizers: dict[str | None, Any] = {}
    results = []
    try:
        for run_dir in args.run_dirs:
            config = run_config(run_dir)
            name = args.tokenizer or (config.get("sweep") or {}).get("model") or config.get("model")
            if name not in tokenizers:
                tokenizers[name] = _tokenizer_for(name)
            results.append(needle_errors(run_dir, tokenizers[name], args.by_position))
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2) if args.json else format_errors(results).rstrip("\n"))
    return 0
