"""``kvzap harness ...``: lm-eval's own command line with the ``kvzap`` model registered and kvzap's tasks found.

``kvzap harness --model_args press=kvzap_mlp,threshold=-3 --tasks kvzap_ruler_offline ...`` runs
``lm-eval run`` after checking, before any model is loaded: the kvzap model's arguments (unknown ones, a press
name, a threshold that is not a number, a local surrogate that does not fit the model) and, offline, that every
task reads local files or a dataset already in the ``datasets`` cache. ``--model`` defaults to ``kvzap`` and
kvzap's task configs are added to ``--include_path``. ``kvzap harness data ...`` writes those tasks' files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["main", "check_offline_tasks"]

_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", ""}


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _in_datasets_cache(dataset: str) -> bool:
    import datasets

    root = Path(datasets.config.HF_DATASETS_CACHE)
    return (root / dataset.replace("/", "___")).is_dir() or (Path(dataset).expanduser()).exists()


def check_offline_tasks(tasks: list[str], include_path: list[str], metadata: dict) -> None:
    """Raise ValueError for a task that would need the network: its dataset is on the Hub and not in the cache.

    kvzap's tasks are checked for their local file (``kvzap harness data`` writes it).
    """
    from lm_eval.tasks import TaskManager

    from .tasks import utils as task_utils

    manager = TaskManager(include_path=include_path)
    index = manager.task_index
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        entry = index.get(name)
        if entry is None:
            return  # lm-eval reports unknown names itself
        kind = str(getattr(entry.kind, "name", entry.kind)).lower()
        cfg = entry.cfg or {}
        if "group" in kind:
            for member in cfg.get("task", []):
                visit(member if isinstance(member, str) else member.get("task", ""))
            return
        if "tag" in kind:
            for other, e in index.items():
                if name in e.tags:
                    visit(other)
            return
        if cfg.get("custom_dataset") is not None:
            if name.startswith("kvzap_") and "dataset_kwargs" in cfg:
                benchmark = cfg["dataset_kwargs"]["benchmark"]
                file = task_utils.data_dir(metadata.get("data_dir")) / f"{benchmark}.jsonl"
                if not file.is_file():
                    raise ValueError(
                        f"The task {name} reads {file}, which does not exist: write it with `kvzap harness data "
                        f'--dataset {benchmark} --out {file.parent}`, or pass --metadata \'{{"data_dir": "DIR"}}\'.'
                    )
            return
        dataset = str(cfg.get("dataset_path") or "")
        if dataset not in _LOCAL_BUILDERS and not _in_datasets_cache(dataset):
            raise ValueError(
                f"The task {name} reads the dataset {dataset!r} from the Hub, and the network is off (HF_HUB_OFFLINE/"
                "HF_DATASETS_OFFLINE) with no copy in the datasets cache: run it once online, or use kvzap's offline "
                "tasks (kvzap_ruler_offline, ...)."
            )

    for task in tasks:
        visit(task)


def _pre_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=None)
    parser.add_argument("--model_args", "--model-args", dest="model_args", default=None)
    parser.add_argument("--tasks", "-t", default=None)
    parser.add_argument("--include_path", "--include-path", dest="include_path", default=None)
    parser.add_argument("--metadata", default=None)
    return parser


def prepare(argv: list[str]) -> list[str]:
    """lm-eval's argv for ``kvzap harness argv``, after the checks (ValueError when one fails)."""
    from lm_eval.utils import simple_parse_args_string

    from . import TASKS_DIR, check_model_args

    argv = list(argv)
    command = argv[0] if argv and argv[0] in ("run", "ls", "validate") else None
    rest = argv[1:] if command else argv
    if command in ("ls", "validate"):
        return [command, *rest, *(["--include_path", str(TASKS_DIR)] if "--include_path" not in rest else [])]
    known, _ = _pre_parser().parse_known_args(rest)
    if known.model is None:
        rest = ["--model", "kvzap", *rest]
    if not known.include_path:
        # lm-eval 0.4 scans one extra directory: kvzap's tasks, unless the user names their own.
        rest += ["--include_path", str(TASKS_DIR)]
    include = known.include_path or str(TASKS_DIR)
    metadata = {}
    if known.metadata:
        try:
            metadata = json.loads(known.metadata)
        except json.JSONDecodeError as error:
            raise ValueError(f"--metadata must be a JSON object, got {known.metadata!r} ({error}).") from None
    if (known.model or "kvzap") == "kvzap":
        args = simple_parse_args_string(known.model_args) if known.model_args else {}
        check_model_args(args)
    if known.tasks and _offline():
        names = [t for t in known.tasks.split(",") if t]
        check_offline_tasks(names, [include], metadata)
    return ["run", *rest]


def main(argv: list[str] | None = None, prog: str = "kvzap harness") -> int:
    """Entry point of ``kvzap harness`` and ``python -m kvzap.harness``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["data"]:
        from .data import main as data_main

        return data_main(argv[1:], prog=f"{prog} data")
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        argv = ["run", "--help"]
    try:
        lm_argv = prepare(argv)
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *lm_argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
