"""The runs of a sweep and the directory each one is written to.

A *run* (:class:`RunSpec`) is one (dataset, press, threshold or compression ratio, target length for the datasets
that have one). Its directory, ``<output_dir>/<model>/<label>__<hash>``, is named from those values and a short
hash of every other setting that changes the results (:func:`run_dir`), so that a sweep rerun with the same
settings finds its finished runs, and a run with other settings (another surrogate's weights, another seed) gets
a directory of its own. The same record, with the sweep that ran it, is the run's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvzap.presses.threshold import resolve_sink_size

from . import ruler
from .benchmarks import DEFAULT_DATASET
from .config import EvalConfig
from .presses import PRESSES, bundled_weights, weights_fingerprint

__all__ = ["RunSpec", "plan_runs", "surrogate_weights", "run_dir"]


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
    # As above: runs of one forward without sinks keep their directories.
    chunked = config.prefill_chunk_size is not None
    if run.knob == "threshold" and (chunked or config.sink_size is not None):
        record["sink_size"] = resolve_sink_size(config.sink_size, chunked)
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
