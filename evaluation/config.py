"""The settings of a sweep (:class:`EvalConfig`): defaults, then a YAML file, then command-line flags.

Every setting is documented once, on :class:`EvalConfig`, and checked once, against the dataset it applies to:
:func:`load_config` layers the sources and :meth:`EvalConfig.validate` refuses any bad value with a sentence
before anything loads or runs. :mod:`evaluation.plan` turns a config into runs and run directories.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import aime, longbench
from .benchmarks import BENCHMARKS, DEFAULT_DATASET, Benchmark, check_local_path
from .presses import PRESSES

__all__ = ["EvalConfig", "load_config", "DEFAULT_N_SAMPLES", "DEFAULT_LENGTH"]


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
    sink_size : first tokens a threshold press never evicts (None: the press's default, 4 in a chunked prefill and
        none in one forward; see :data:`kvzap.presses.threshold.SINK_SIZE`).
    haystack_file : text file for the real-text haystack of ``ruler_offline`` (None: the Python reference).
    device : device to run on (None: the model's, or CPU for a loaded model).
    dtype : ``"float32"``, ``"bfloat16"`` or ``"float16"`` for a model loaded by the runner.
    batch_size : contexts prefilled together, as one left-padded batch of the pipeline (greedy datasets; the
        answers are those of batch 1). Samples are sorted by context length (and grouped by token budget, which
        a batch shares) so that padding stays small; presses that cannot prune a padded batch (top-k, the KVzip+
        oracle) and chunked prefills batch contexts of equal length only. Not part of a run's identity: a sweep
        may resume with another batch size.
    shard : ``"K/N"``: this process answers the K-th of N interleaved shares of every run's samples (samples K,
        K + N, ... in the order :func:`evaluation.runner.interleave_tasks` gives), so that N processes started by
        hand on one ``output_dir`` (two cores, two GPUs, two machines sharing a disk) split one run. They append to
        the same ``predictions.partial.jsonl``; whichever answers a run's last sample writes its results. Not part
        of a run's identity (the answers do not depend on it). ``accelerate launch`` splits a sweep's runs instead:
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
    sink_size: int | None = None
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
        if self.sink_size is not None and self.sink_size < 0:
            raise ValueError(f"sink_size must be a non-negative integer, got {self.sink_size}.")
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
