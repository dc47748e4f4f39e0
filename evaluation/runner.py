"""Run presses over a benchmark and write predictions, metrics and the resolved config per run.

:func:`run_evaluation` runs every run a config plans (:mod:`evaluation.config`, :mod:`evaluation.plan`) and writes
its directory (the files :mod:`evaluation.rundirs` describes and reads): ``config.json`` and ``samples.json``
first, ``predictions.csv``, then ``metrics.json`` (scores with their 95% confidence intervals,
:mod:`evaluation.intervals`) last. A run whose ``metrics.json`` exists is skipped, and an unfinished run keeps its
finished samples in ``predictions.partial.jsonl``, so an interrupted sweep resumes where it stopped, inside a run
too. ``batch_size`` contexts are prefilled together as one left-padded batch (:func:`plan_batches`), as the
pipeline's list of contexts does. The datasets (the offline RULER-style generator, RULER and LongBench from the Hub
or local files, AIME 2025) are described in :mod:`evaluation.benchmarks`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import aime
from .benchmarks import LoadRequest

# The sweep's settings and runs, importable from here too: the runner is where a sweep starts.
from .config import DEFAULT_LENGTH, DEFAULT_N_SAMPLES, EvalConfig, load_config
from .plan import RunSpec, _config_record, _model_name, plan_runs, run_dir, surrogate_weights
from .presses import CacheMethod, make_press
from .rundirs import (
    PARTIAL,
    PREDICTION_COLUMNS,
    SAMPLES,
    read_partial,
    sample_fingerprints,
    sample_key,
    summarize_rows,
)

logger = logging.getLogger(__name__)

__all__ = [
    "EvalConfig",
    "RunSpec",
    "load_config",
    "plan_runs",
    "plan_batches",
    "interleave_tasks",
    "run_evaluation",
    "run_dir",
    "surrogate_weights",
    "sample_fingerprints",
    "PARTIAL",
    "SAMPLES",
    "DEFAULT_LENGTH",
    "DEFAULT_N_SAMPLES",
]


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
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=PREDICTION_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**{c: row[c] for c in PREDICTION_COLUMNS}, "answers": json.dumps(row["answers"])})


def _make_run_press(config: EvalConfig, run: RunSpec):
    """The press of one run (None for the full cache, a :class:`~evaluation.presses.CacheMethod` for transformers'
    static and quantized caches); threshold presses prune while decoding when the dataset asks for it (aime25) or
    ``decoding`` is set."""
    decoding = bool(config.decoding_for(run.knob))
    try:
        press = make_press(
            run.press,
            run.value,
            surrogate=config.surrogate_for(run.press),
            sliding_window_size=config.sliding_window_size,
            decoding=decoding,
            seed=config.seed,
            sink_size=config.sink_size,
        )
    except ValueError as error:
        if decoding and config.benchmark.sampled:
            raise ValueError(f"{config.dataset} prunes while decoding, which {run.press} cannot: {error}") from error
        raise
    if isinstance(press, CacheMethod) and config.benchmark.sampled:
        raise ValueError(
            f"{run.press} is a cache, not a press: the evaluation answers with it through the pipeline's greedy "
            f"decoding, and {config.dataset} samples its answers with model.generate; run {run.press} on a "
            "greedy dataset (ruler, longbench), or pass cache_implementation to generate yourself."
        )
    return press


def _answer_with_cache(pipe, method: CacheMethod, sample: dict[str, Any], budget: int, max_context_length) -> str:
    """One sample answered as the pipeline answers it (same prompt, greedy decoding), into a fresh cache of
    ``method``'s kind and with no press: the pipeline's own forward, handed that cache."""
    inputs = pipe.preprocess(
        sample["context"], [sample["question"]], sample["answer_prefix"], max_context_length, False
    )
    room = inputs["context_ids"].shape[1] + inputs["question_ids"][0].shape[1] + budget
    cache = method.new_cache(pipe.model, room)
    answers = pipe._forward(inputs, press=None, max_new_tokens=budget, cache=cache)
    return pipe.postprocess(answers, single_question=True)["answer"]


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
    done = read_partial(partial) if partial is not None else {}
    index, count = config.shard_parts
    # This process's share: every count-th sample of the interleaved order, the same in every process (whatever
    # each has done), so that the shares cover the run once and each mixes every task.
    mine = interleave_tasks(samples)[index::count]
    todo = [s for s in mine if sample_key(s) not in done]
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
            done[sample_key(r)] = r
        if partial is not None:
            _append_partial(partial, new)

    budgets = [config.max_new_tokens or s["max_new_tokens"] for s in todo]
    progress = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=run.label, leave=False, unit="sample")
    if isinstance(press, CacheMethod):
        # A cache of the method's own kind for every sample, one sample at a time (the pipeline's batched prefill
        # builds its own dynamic cache); nothing is evicted.
        if config.batch_size > 1 and todo:
            logger.info("%s: %s answers one sample at a time (a cache of its own each)", run.label, run.press)
        for sample, budget in zip(todo, budgets, strict=True):
            prediction = _answer_with_cache(pipe, press, sample, budget, max_context_length)
            finish([row(sample, prediction, 0.0)])
            progress.update(1)
    elif benchmark.sampled or config.batch_size == 1:
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
        done.update(read_partial(partial))  # the other shares' rows, as far as their processes got
        left = sum(sample_key(s) not in done for s in samples)
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
    return [done[sample_key(s)] for s in samples]


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
            **summarize_rows(rows, config.task_list),
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
