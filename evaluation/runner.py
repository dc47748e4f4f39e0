"""Run presses over RULER-style tasks and write predictions, metrics and the resolved config per run.

A *run* is one (press, threshold or compression ratio, target length). Its directory, named from those values and
a short hash of everything else that changes the results, holds ``predictions.csv``, ``metrics.json`` and
``config.json``; a run whose ``metrics.json`` exists is skipped, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from evaluation import ruler
from evaluation.metrics import METRICS
from evaluation.presses import PRESSES, make_press

logger = logging.getLogger(__name__)

__all__ = ["EvalConfig", "RunSpec", "load_config", "plan_runs", "run_evaluation", "build_parser", "main"]


@dataclass
class EvalConfig:
    """Everything a sweep depends on; defaults, then a YAML file, then command-line flags.

    Parameters
    ----------
    model : Hub id or local directory; None (or "default") loads kvzap's default model.
    presses : names from :data:`evaluation.presses.PRESSES`.
    thresholds : swept for threshold presses (KVzap); higher = more compression.
    compression_ratios : swept for top-k presses (random, key norm, recency).
    tasks : names from :data:`evaluation.ruler.TASKS`.
    lengths : target prompt lengths in tokens.
    n_samples : samples per task and length.
    max_context_length : contexts are truncated beyond this many tokens (None: no limit).
    max_new_tokens : overrides every task's generation budget when set.
    output_dir : where run directories are written.
    seed : generator seed (samples and random scorer).
    surrogate : KVzap surrogate directory or Hub id (None: bundled, else the published checkpoint).
    sliding_window_size, decoding : DMS options of the KVzap presses.
    haystack_file : text file for the real-text haystack (None: the Python reference, see evaluation.ruler).
    device : device to run on (None: the model's, or CPU for a loaded model).
    dtype : ``"float32"``, ``"bfloat16"`` or ``"float16"`` for a model loaded by the runner.
    """

    model: str | None = None
    presses: list[str] = field(default_factory=lambda: ["no_press", "kvzap_mlp"])
    thresholds: list[float] = field(default_factory=lambda: [-6.0, -5.0, -4.0, -3.0])
    compression_ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    tasks: list[str] = field(default_factory=lambda: list(ruler.DEFAULT_TASKS))
    lengths: list[int] = field(default_factory=lambda: [4096])
    n_samples: int = 10
    max_context_length: int | None = None
    max_new_tokens: int | None = None
    output_dir: str = "outputs/evaluation"
    seed: int = 0
    surrogate: str | None = None
    sliding_window_size: int = 128
    decoding: bool = False
    haystack_file: str | None = None
    device: str | None = None
    dtype: str = "float32"

    def validate(self) -> None:
        """Raise ``ValueError`` with a sentence for any bad value, before anything runs."""
        for name in self.presses:
            if name not in PRESSES:
                raise ValueError(f"Unknown press {name!r}; choose from {', '.join(PRESSES)}.")
        for task in self.tasks:
            if task not in ruler.TASKS:
                raise ValueError(f"Unknown task {task!r}; choose from {', '.join(ruler.TASKS)}.")
        if not self.presses or not self.tasks or not self.lengths:
            raise ValueError("presses, tasks and lengths must each name at least one value.")
        for ratio in self.compression_ratios:
            if not 0 <= ratio < 1:
                raise ValueError(f"Compression ratios must be in [0, 1), got {ratio}.")
        for length in self.lengths:
            if int(length) != length or length < 1:
                raise ValueError(f"Lengths must be positive integers, got {length}.")
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {self.n_samples}.")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}.")
        for name in ("max_context_length", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")


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
        if name in values and not isinstance(values[name], (list, tuple)):
            values[name] = [values[name]]
    if str(values.get("model")).lower() in ("none", "default"):
        values["model"] = None  # spelled out in YAML or on the command line: kvzap's default model
    config = EvalConfig(**values)
    config.thresholds = [float(v) for v in config.thresholds]
    config.compression_ratios = [float(v) for v in config.compression_ratios]
    config.lengths = [int(v) for v in config.lengths]
    config.validate()
    return config


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: a press at one threshold or compression ratio, at one target length."""

    press: str
    knob: str | None
    value: float | None
    length: int

    @property
    def label(self) -> str:
        """Readable part of the run directory name, e.g. ``kvzap_mlp__threshold-4__len4096``."""
        value = "" if self.knob is None else f"__{self.knob}{self.value:g}"
        return f"{self.press}{value}__len{self.length}"


def plan_runs(config: EvalConfig) -> list[RunSpec]:
    """Every (press, value, length) of the sweep, in a stable order (lengths outermost)."""
    runs = []
    for length in config.lengths:
        for name in config.presses:
            knob = PRESSES[name].knob
            values = [None] if knob is None else getattr(config, "thresholds" if knob == "threshold" else knob + "s")
            runs.extend(RunSpec(name, knob, value, length) for value in values)
    return runs


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def _model_name(config: EvalConfig, model: Any) -> str:
    if config.model is not None:
        return Path(str(config.model).rstrip("/")).name
    if model is None:
        try:
            from kvzap.models import DEFAULT_MODEL_NAME
        except ImportError:
            return "default"
        return DEFAULT_MODEL_NAME
    name = getattr(getattr(model, "config", None), "_name_or_path", "")
    return Path(str(name).rstrip("/")).name if name else "model"


def _run_record(config: EvalConfig, run: RunSpec, model_name: str) -> dict[str, Any]:
    """The resolved settings of one run, as written to ``config.json``."""
    return {
        "model": model_name,
        "press": run.press,
        "knob": run.knob,
        "value": run.value,
        "length": run.length,
        "tasks": list(config.tasks),
        "n_samples": config.n_samples,
        "seed": config.seed,
        "max_context_length": config.max_context_length,
        "max_new_tokens": config.max_new_tokens,
        "surrogate": config.surrogate if run.press.startswith("kvzap") else None,
        "sliding_window_size": config.sliding_window_size if run.knob == "threshold" else None,
        "decoding": config.decoding if run.knob == "threshold" else None,
        "haystack": config.haystack_file or ruler.default_text_source(),
        "dtype": config.dtype,
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
    per_task = {}
    for task in tasks:
        task_rows = [r for r in rows if r["task"] == task]
        metric = METRICS[ruler.TASKS[task].metric]
        per_task[task] = metric([r["prediction"] for r in task_rows], [r["answers"] for r in task_rows])
    ratios = [r["compression_ratio"] for r in rows]
    return {
        "score": sum(per_task.values()) / len(per_task),  # mean over tasks, as RULER averages
        "tasks": per_task,
        "compression_ratio": sum(ratios) / len(ratios),
        "n_predictions": len(rows),
    }


def _evaluate_run(pipe, config: EvalConfig, run: RunSpec, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # One press for the whole run: its per-sequence state lives in the cache and its statistics restart at each
    # prefill, while weights it loads (a KVzap surrogate) are loaded once.
    press = make_press(
        run.press,
        run.value,
        surrogate=config.surrogate,
        sliding_window_size=config.sliding_window_size,
        decoding=config.decoding,
        seed=config.seed,
    )
    rows = []
    for sample in tqdm(samples, desc=run.label, leave=False, unit="sample"):
        output = pipe(
            sample["context"],
            question=sample["question"],
            answer_prefix=sample["answer_prefix"],
            press=press,
            max_new_tokens=config.max_new_tokens or sample["max_new_tokens"],
            max_context_length=config.max_context_length,
        )
        prediction = output["answer"]
        metric = METRICS[ruler.TASKS[sample["task"]].metric]
        rows.append(
            {
                "task": sample["task"],
                "id": sample["id"],
                "prediction": prediction,
                "answers": sample["answers"],
                "score": metric([prediction], [sample["answers"]]),
                "compression_ratio": press.compression_ratio if press is not None else 0.0,
                "n_tokens": sample["n_tokens"],
            }
        )
    return rows


def run_evaluation(config: EvalConfig, model: Any = None, tokenizer: Any = None) -> list[dict[str, Any]]:
    """Run every (press, value, length) of ``config`` and write each run's files; skip finished runs.

    Parameters
    ----------
    config : the sweep.
    model, tokenizer : an already loaded model and tokenizer (tests pass tiny ones); when None they are loaded
        from ``config.model`` with :func:`kvzap.models.load_model`.

    Returns
    -------
    list of dict, one per run (finished now or before): ``{"run_dir", "press", "knob", "value", "length",
    "metrics", "skipped"}``.
    """
    config.validate()
    for name in config.presses:  # fail before loading anything if a press cannot run
        if not PRESSES[name].available:
            make_press(name, 0.0)
    if (model is None) != (tokenizer is None):
        raise ValueError("Pass both model and tokenizer, or neither.")
    model_name = _model_name(config, model)
    runs = plan_runs(config)
    pending = [r for r in runs if not (run_dir(config, r, model_name) / "metrics.json").exists()]
    results: list[dict[str, Any]] = []
    if pending and model is None:
        model, tokenizer = _load_model(config)
    pipe = None
    if pending:
        from transformers import pipeline

        import kvzap  # noqa: F401  (registers the pipeline task)

        pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)

    samples_by_length: dict[int, list[dict[str, Any]]] = {}
    for run in tqdm(runs, desc="runs", unit="run"):
        directory = run_dir(config, run, model_name)
        metrics_path = directory / "metrics.json"
        if metrics_path.exists():
            logger.info("Skipping %s: %s exists", run.label, metrics_path)
            metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
            results.append({"run_dir": str(directory), **dataclasses.asdict(run), "metrics": metrics, "skipped": True})
            continue
        if run.length not in samples_by_length:
            samples_by_length[run.length] = ruler.generate_samples(
                tokenizer, config.tasks, run.length, config.n_samples, config.seed, config.haystack_file
            )
        rows = _evaluate_run(pipe, config, run, samples_by_length[run.length])
        metrics = {**_summarize(rows, config.tasks), **dataclasses.asdict(run), "model": model_name}
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(
            json.dumps({**_run_record(config, run, model_name), "sweep": dataclasses.asdict(config)}, indent=2),
            encoding="utf-8",
        )
        _write_predictions(directory / "predictions.csv", rows)
        # Written last: its presence marks the run as finished.
        tmp = metrics_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(metrics, indent=2), encoding="utf-8")
        tmp.replace(metrics_path)
        logger.info("%s: score %.2f, compression %.3f", run.label, metrics["score"], metrics["compression_ratio"])
        results.append({"run_dir": str(directory), **dataclasses.asdict(run), "metrics": metrics, "skipped": False})
    return results


# --- command line ----------------------------------------------------------------------------------------------
def _split_commas(values: Sequence[str]) -> list[str]:
    return [v for value in values for v in value.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m evaluation`` / ``kvzap evaluate`` parser (unset flags keep the config's values)."""
    parser = argparse.ArgumentParser(
        prog="python -m evaluation",
        description="Accuracy vs compression of kvzap presses on RULER-style tasks. "
        "Subcommands: `plot` (or `summarize`) --results-dir DIR; anything else runs a sweep.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of settings (overridden by the flags below)")
    parser.add_argument("--model", help="Hub id or local directory ('default' or 'none': kvzap's default model)")
    parser.add_argument(
        "--press", "--presses", dest="presses", nargs="+", help=f"press names: {', '.join(PRESSES)} (comma or space)"
    )
    parser.add_argument("--threshold", "--thresholds", dest="thresholds", nargs="+", type=float)
    parser.add_argument("--compression-ratio", "--compression-ratios", dest="compression_ratios", nargs="+", type=float)
    parser.add_argument("--tasks", nargs="+", help=f"task names: {', '.join(ruler.TASKS)} (comma or space)")
    parser.add_argument("--lengths", nargs="+", type=int, help="target prompt lengths in tokens")
    parser.add_argument("--n-samples", dest="n_samples", type=int)
    parser.add_argument("--max-context-length", dest="max_context_length", type=int)
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    parser.add_argument("--output-dir", dest="output_dir")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--surrogate", help="KVzap surrogate directory or Hub id")
    parser.add_argument("--sliding-window-size", dest="sliding_window_size", type=int)
    parser.add_argument("--decoding", action="store_true", help="KVzap presses also prune during decoding")
    parser.add_argument("--haystack-file", dest="haystack_file", help="text file for the real-text haystack")
    parser.add_argument("--device")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    return parser


def config_from_args(argv: Sequence[str] | None) -> tuple[EvalConfig, bool]:
    """Parse a sweep's command line into a config (defaults < YAML < flags); also returns ``--verbose``."""
    args = vars(build_parser().parse_args(argv))
    verbose = bool(args.pop("verbose", False))
    path = args.pop("config", None)
    for name in ("presses", "tasks"):
        if name in args:
            args[name] = _split_commas(args[name])
    return load_config(path, **args), verbose


def _format_results(results: list[dict[str, Any]]) -> str:
    lines = [f"{'run':48s} {'score':>7s} {'compr.':>7s}"]
    for result in results:
        metrics = result["metrics"]
        label = RunSpec(result["press"], result["knob"], result["value"], result["length"]).label
        mark = " (cached)" if result["skipped"] else ""
        lines.append(f"{label:48s} {metrics['score']:7.2f} {metrics['compression_ratio']:7.3f}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m evaluation`` and ``kvzap evaluate``; returns the exit status.

    ``main(["plot", "--results-dir", DIR])`` (or ``summarize``) writes the plot and the table; any other arguments
    run a sweep (see ``--help``).
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plot", "summarize"):
        from evaluation.plots import main as plots_main

        return plots_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    try:
        config, verbose = config_from_args(argv)
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
    print(
        f"Results in {config.output_dir}; plot them with: python -m evaluation plot --results-dir {config.output_dir}"
    )
    return 0
