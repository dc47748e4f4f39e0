"""Functions the kvzap task configs name (``!function utils...``): read the local files that
``kvzap harness data`` writes, and score a prediction as ``kvzap evaluate`` scores it.

The data directory is ``--metadata '{"data_dir": "DIR"}'``, else ``$KVZAP_HARNESS_DATA``, else
``$KVZAP_CACHE_DIR/harness`` (``~/.cache/kvzap/harness``); it holds one ``<dataset>.jsonl`` per dataset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Where the task files are read from (see the module docstring)."""
    if data_dir:
        return Path(data_dir).expanduser()
    if os.environ.get("KVZAP_HARNESS_DATA"):
        return Path(os.environ["KVZAP_HARNESS_DATA"]).expanduser()
    from kvzap.models import default_cache_dir

    return default_cache_dir() / "harness"


def load_local(benchmark: str, task: str, data_dir: str | None = None, **_: Any):
    """The documents of one task: the rows of ``<data dir>/<benchmark>.jsonl`` whose ``task`` is ``task``."""
    import datasets

    file = globals()["data_dir"](data_dir) / f"{benchmark}.jsonl"
    if not file.is_file():
        raise FileNotFoundError(
            f"No local data for the kvzap task {benchmark}/{task}: {file} does not exist. Write it with "
            f"`kvzap harness data --dataset {benchmark} --out {file.parent}` (same model, length and samples as "
            'the run), or point --metadata \'{"data_dir": "DIR"}\' at the directory holding it.'
        )
    with file.open(encoding="utf-8") as handle:
        rows = [row for row in map(json.loads, handle) if row["task"] == task]
    if not rows:
        raise ValueError(f"{file} has no sample of the task {task!r}: write it with --tasks {task}.")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """The sample's score in percent, by the scorer of its dataset in ``kvzap evaluate``."""
    from kvzap.evaluation.benchmarks import BENCHMARKS

    return {"score": float(BENCHMARKS[doc["benchmark"]].score(doc, results[0]))}
