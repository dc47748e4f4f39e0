"""The datasets the evaluation runs on, by name: how to load their samples and how to score a prediction.

=================  ==========================================================================================
``ruler_offline``  RULER-style tasks generated offline at any length (:mod:`evaluation.ruler`); the default
``ruler``          RULER (Hsieh et al., 2024) as published on the Hub: ``simonjegou/ruler``, one configuration per
                   context length (``"4096"``, ``"8192"``, ...), 13 tasks
``longbench``      LongBench (:mod:`evaluation.longbench`): ``THUDM/LongBench``, one configuration per task
``aime25``         AIME 2025 (:mod:`evaluation.aime`): ``alessiodevoto/aime25``, sampled decoding
=================  ==========================================================================================

Every loader returns samples with the fields the runner uses: ``task``, ``id``, ``context``, ``question``,
``answer_prefix``, ``answers`` (list of str), ``max_new_tokens``, ``n_tokens`` (tokens of
``context + "\\n" + question + "\\n" + answer_prefix`` with the model's tokenizer) and, for LongBench,
``all_classes``.

Hub datasets are read with ``datasets.load_dataset(hub_id, configuration, split="test")``. With a local
``path`` the same rows are read from files in the same format, with ``datasets.load_dataset("json" or "parquet",
data_files=..., split="train")``: a directory holds one file per configuration, named after it
(``4096.jsonl`` for RULER, ``narrativeqa.jsonl`` for LongBench, ``aime25.jsonl``), and a single file is read for
every configuration (its rows are split by task with the ``task`` column, or ``dataset`` for LongBench).
LongBench's Hub repository is built by a loading script, which ``datasets`` 4 and later refuse; the loader then
reads the same files from the repository's ``data.zip`` archive instead.

``fraction`` keeps a share of each task's samples (at least one), chosen from the seed, in dataset order.
"""

from __future__ import annotations

import logging
import os
import random
import re
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import aime, longbench, ruler
from .metrics import METRICS, sample_score

logger = logging.getLogger(__name__)

__all__ = [
    "Benchmark",
    "LoadRequest",
    "BENCHMARKS",
    "DEFAULT_DATASET",
    "RULER_HUB_TASKS",
    "read_rows",
    "check_local_path",
    "local_data_file",
    "select_fraction",
    "count_tokens",
    "truncate_middle",
]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class LoadRequest:
    """What to load for one run.

    Parameters
    ----------
    tasks : task names of the benchmark.
    length : target context length (RULER configurations and the offline generator), None for the others.
    path : local file or directory used instead of the Hub (None: the Hub, or the generator).
    fraction : share of each task's samples kept, in (0, 1].
    seed : chooses the kept samples (and seeds the offline generator).
    n_samples : samples per task of the offline generator.
    haystack_file : real-text document of the offline generator.
    max_context_length : for benchmarks truncated in the middle (LongBench), the context token budget.
    """

    tasks: tuple[str, ...]
    length: int | None = None
    path: str | None = None
    fraction: float = 1.0
    seed: int = 0
    n_samples: int = 10
    haystack_file: str | None = None
    max_context_length: int | None = None


@dataclass(frozen=True)
class Benchmark:
    """One dataset of the evaluation.

    Parameters
    ----------
    name : registry key, also the ``dataset`` setting and the first part of run directory names.
    description : one line for ``--help`` and the README.
    tasks : every task name; ``default_tasks`` is the subset run when ``tasks`` is not set.
    load : ``load(request, tokenizer) -> samples``.
    score : ``score(sample, prediction) -> float`` in percent.
    hub_id : Hub dataset read when no local path is given (None: generated offline).
    uses_lengths : runs are made per target length (``lengths``).
    sampled : answers are sampled with ``model.generate`` and threshold presses prune during decoding
        (AIME); otherwise the ``kv-press-text-generation`` pipeline decodes greedily.
    truncation : ``"end"`` (the pipeline keeps the first ``max_context_length`` tokens) or ``"middle"`` (the
        loader keeps the first and last halves of the context, as LongBench does).
    configurations : ``configurations(tasks, length) -> names`` of the Hub configurations / local files read.
    """

    name: str
    description: str
    tasks: tuple[str, ...]
    default_tasks: tuple[str, ...]
    load: Callable[[LoadRequest, Any], list[dict[str, Any]]]
    score: Callable[[dict[str, Any], str], float]
    hub_id: str | None = None
    uses_lengths: bool = False
    sampled: bool = False
    truncation: str = "end"
    configurations: Callable[[Sequence[str], int | None], list[str]] | None = None


# --- reading rows ------------------------------------------------------------------------------------------------
def local_data_file(path: str | os.PathLike, configuration: str) -> Path:
    """The local file holding ``configuration``: ``path`` itself if it is a file, else ``path/<configuration>``
    with a ``.jsonl``, ``.json`` or ``.parquet`` suffix.

    Raises
    ------
    FileNotFoundError : nothing there, with the names looked for.
    """
    root = Path(path)
    if root.is_file():
        return root
    if not root.is_dir():
        raise FileNotFoundError(f"No dataset file or directory at {root}.")
    candidates = [root / f"{configuration}{suffix}" for suffix in DATA_SUFFIXES]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"No data for {configuration!r} in {root}: expected one of {', '.join(c.name for c in candidates)}."
    )


def _load_local(file: Path):
    import datasets

    builder = "parquet" if file.suffix == ".parquet" else "json"
    return datasets.load_dataset(builder, data_files=str(file), split="train")


def read_rows(hub_id: str, configuration: str | None, path: str | os.PathLike | None) -> list[dict[str, Any]]:
    """Rows of one configuration, from the Hub (split ``test``) or from a local file of the same format.

    Parameters
    ----------
    hub_id : Hub dataset id.
    configuration : Hub configuration name (None: the dataset's default), also the local file's name.
    path : local file or directory (see :func:`local_data_file`); None reads the Hub.
    """
    if path is not None:
        file = local_data_file(path, configuration or Path(hub_id).name)
        logger.info("Reading %s", file)
        return _load_local(file).to_list()
    import datasets

    logger.info("Loading %s (%s) from the Hub", hub_id, configuration or "default")
    return datasets.load_dataset(hub_id, configuration, split="test").to_list()


def select_fraction(n: int, fraction: float, key: str) -> list[int]:
    """Indices of the kept samples of a task: ``max(1, round(fraction * n))`` of ``range(n)``, chosen by
    ``key`` (a string hashed by ``random``, so stable across runs), in increasing order."""
    if fraction >= 1 or n == 0:
        return list(range(n))
    k = max(1, round(fraction * n))
    return sorted(random.Random(key).sample(range(n), k))


def count_tokens(tokenizer: Any, sample: dict[str, Any]) -> int:
    """Prompt length as the pipeline feeds it (chat-template tokens excluded)."""
    text = f"{sample['context']}\n{sample['question']}\n{sample['answer_prefix']}"
    return len(tokenizer.encode(text, add_special_tokens=False))


def truncate_middle(tokenizer: Any, text: str, max_tokens: int) -> str:
    """LongBench's truncation: when ``text`` has more than ``max_tokens`` tokens, keep its first ``max_tokens // 2``
    and its last ``max_tokens - max_tokens // 2`` tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[len(ids) - (max_tokens - half) :], skip_special_tokens=True)
    return head + tail


def _by_task(
    rows: list[dict[str, Any]], column: str, tasks: Sequence[str], source: str
) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {task: [] for task in tasks}
    for row in rows:
        if column not in row:
            raise ValueError(f"The rows of {source} have no {column!r} column.")
        if row[column] in grouped:
            grouped[row[column]].append(row)
    empty = [task for task, task_rows in grouped.items() if not task_rows]
    if empty:
        raise ValueError(f"{source} has no sample of the task(s) {', '.join(empty)}.")
    return grouped


def _finish(samples: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    for sample in samples:
        sample["n_tokens"] = count_tokens(tokenizer, sample)
    return samples


# --- ruler_offline -----------------------------------------------------------------------------------------------
def _load_ruler_offline(request: LoadRequest, tokenizer: Any) -> list[dict[str, Any]]:
    return ruler.generate_samples(
        tokenizer, list(request.tasks), request.length, request.n_samples, request.seed, request.haystack_file
    )


def _score_ruler_offline(sample: dict[str, Any], prediction: str) -> float:
    return sample_score(sample["task"], prediction, sample["answers"])


# --- RULER from the Hub ------------------------------------------------------------------------------------------
RULER_HUB_ID = "simonjegou/ruler"
#: The 13 tasks of RULER's synthetic suite, as named in ``simonjegou/ruler``'s ``task`` column.
RULER_HUB_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
_CONTROL = re.compile(r"[\x00-\x1f]")


def _load_ruler_hub(request: LoadRequest, tokenizer: Any) -> list[dict[str, Any]]:
    source = request.path or f"{RULER_HUB_ID} ({request.length})"
    rows = read_rows(RULER_HUB_ID, str(request.length), request.path)
    columns = {"context", "question", "answer_prefix", "answer", "task", "max_new_tokens"}
    missing = columns - set(rows[0] if rows else columns)
    if missing:
        raise ValueError(f"The RULER rows of {source} lack the column(s) {', '.join(sorted(missing))}.")
    samples = []
    for task, task_rows in _by_task(rows, "task", request.tasks, source).items():
        keep = select_fraction(len(task_rows), request.fraction, f"{request.seed}/ruler/{request.length}/{task}")
        for index in keep:
            row = task_rows[index]
            answers = row["answer"]
            samples.append(
                {
                    "task": task,
                    "id": f"{task}-{request.length}-{index}",
                    "context": row["context"],
                    "question": row["question"],
                    "answer_prefix": row["answer_prefix"],
                    "answers": [answers] if isinstance(answers, str) else [str(a) for a in answers],
                    "max_new_tokens": int(row["max_new_tokens"]),
                }
            )
    return _finish(samples, tokenizer)


def _score_ruler_hub(sample: dict[str, Any], prediction: str) -> float:
    # RULER's post-processing: control characters become line breaks; the QA tasks score any reference found.
    text = _CONTROL.sub("\n", prediction.strip()).strip()
    metric = "part" if sample["task"].startswith("qa") else "all"
    return METRICS[metric]([text], [sample["answers"]])


# --- LongBench ---------------------------------------------------------------------------------------------------
def _longbench_archive_dir(hub_id: str, task: str) -> Path:
    """Extract ``data/<task>.jsonl`` from the Hub repository's ``data.zip`` (downloaded once, cached)."""
    import datasets
    from huggingface_hub import hf_hub_download

    archive = Path(hf_hub_download(hub_id, "data.zip", repo_type="dataset"))
    # Named after the archive's content (its cache blob), so a new upload is extracted afresh.
    target = Path(datasets.config.HF_DATASETS_CACHE) / "kvzap_longbench" / archive.resolve().name[:16]
    member = f"data/{task}.jsonl"
    if not (target / member).is_file():
        with zipfile.ZipFile(archive) as handle:
            if member not in handle.namelist():
                raise FileNotFoundError(f"{hub_id}'s data.zip has no {member}.")
            handle.extract(member, target)
    return target / "data"


def _read_longbench(task: str, path: str | None) -> tuple[list[dict[str, Any]], str]:
    if path is not None:
        return read_rows(longbench.HUB_ID, task, path), str(path)
    try:
        return read_rows(longbench.HUB_ID, task, None), f"{longbench.HUB_ID} ({task})"
    except (RuntimeError, ValueError) as error:
        message = str(error).lower()
        if "script" not in message and "trust_remote_code" not in message:
            raise
        logger.info("%s needs its loading script (%s): reading its data.zip instead", longbench.HUB_ID, error)
    directory = _longbench_archive_dir(longbench.HUB_ID, task)
    return read_rows(longbench.HUB_ID, task, directory), f"{longbench.HUB_ID} data.zip ({task})"


def _load_longbench(request: LoadRequest, tokenizer: Any) -> list[dict[str, Any]]:
    samples = []
    for task in request.tasks:
        rows, source = _read_longbench(task, request.path)
        if request.path is not None and Path(request.path).is_file():
            rows = _by_task(rows, "dataset", [task], source)[task]  # one file for every task: LongBench's column
        if not rows:
            raise ValueError(f"{source} has no sample of the task {task}.")
        for index in select_fraction(len(rows), request.fraction, f"{request.seed}/longbench/{task}"):
            sample = longbench.build_sample(task, rows[index], index)
            if request.max_context_length is not None:
                sample["context"] = truncate_middle(tokenizer, sample["context"], request.max_context_length)
            samples.append(sample)
    return _finish(samples, tokenizer)


def _score_longbench(sample: dict[str, Any], prediction: str) -> float:
    return longbench.score(sample["task"], prediction, sample["answers"], sample.get("all_classes"))


# --- AIME 2025 ---------------------------------------------------------------------------------------------------
def _load_aime(request: LoadRequest, tokenizer: Any) -> list[dict[str, Any]]:
    # Locally: the file given, or aime25.jsonl (.json, .parquet) in the directory given.
    rows = read_rows(aime.HUB_ID, None, request.path)
    if not rows:
        raise ValueError(f"No AIME problem in {request.path or aime.HUB_ID}.")
    keep = select_fraction(len(rows), request.fraction, f"{request.seed}/aime25")
    return _finish([aime.build_sample(rows[i], i) for i in keep], tokenizer)


def _score_aime(sample: dict[str, Any], prediction: str) -> float:
    return aime.score(prediction, sample["answers"])


#: Every dataset of the evaluation, by name.
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "ruler_offline",
            "RULER-style tasks generated offline at any length (no download)",
            tuple(ruler.TASKS),
            ruler.DEFAULT_TASKS,
            _load_ruler_offline,
            _score_ruler_offline,
            uses_lengths=True,
        ),
        Benchmark(
            "ruler",
            f"RULER from the Hub ({RULER_HUB_ID}, one configuration per length: 4096, 8192, ...)",
            RULER_HUB_TASKS,
            RULER_HUB_TASKS,
            _load_ruler_hub,
            _score_ruler_hub,
            hub_id=RULER_HUB_ID,
            uses_lengths=True,
            configurations=lambda tasks, length: [str(length)],
        ),
        Benchmark(
            "longbench",
            f"LongBench ({longbench.HUB_ID}), 16 English and code tasks by default, 5 Chinese ones on request",
            tuple(longbench.TASKS),
            longbench.ENGLISH_TASKS,
            _load_longbench,
            _score_longbench,
            hub_id=longbench.HUB_ID,
            truncation="middle",
            configurations=lambda tasks, length: list(tasks),
        ),
        Benchmark(
            "aime25",
            f"AIME 2025 ({aime.HUB_ID}), sampled decoding, threshold presses prune while decoding",
            (aime.TASK,),
            (aime.TASK,),
            _load_aime,
            _score_aime,
            hub_id=aime.HUB_ID,
            sampled=True,
            configurations=lambda tasks, length: [aime.TASK],
        ),
    )
}

#: The dataset of a sweep that names none.
DEFAULT_DATASET = "ruler_offline"


def check_local_path(benchmark: Benchmark, path: str, tasks: Sequence[str], lengths: Sequence[int | None]) -> None:
    """Raise ``ValueError`` unless ``path`` holds a file for every configuration the sweep reads."""
    if benchmark.configurations is None:
        raise ValueError(f"The dataset {benchmark.name!r} is generated offline: dataset_path does not apply.")
    root = Path(path)
    if root.is_file() and benchmark.uses_lengths and len(lengths) > 1:
        raise ValueError(
            f"{root} is one file, so it holds one length: pass a directory with one file per length "
            f"({', '.join(f'{length}.jsonl' for length in lengths)}) or a single length."
        )
    for length in lengths:
        for configuration in benchmark.configurations(tasks, length):
            try:
                local_data_file(root, configuration)
            except FileNotFoundError as error:
                raise ValueError(str(error)) from None
