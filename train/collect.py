"""KVzip+ target collection: one forward pass of the "repeat" prompt per text, scored inside attention.

For a prompt ``x`` the model reads the chat ``user: x + "Repeat the previous context exactly."`` /
``assistant: x``. While it re-reads its own copy of ``x``, the attention that each repeated token pays
to the original tokens tells how much each original KV pair is needed to reconstruct the context.
KVzip+ normalises that attention by what the pair contributes to the output:

    s+_i = max_{j in repeat} a_ji * ||W_O^h v_i|| / ||h_j||        (per query head h)

then takes the max over the query heads of each GQA group, and ``log(s+)`` is the regression target.

The scores are computed by a registered attention function that runs the normal sdpa kernel for the
layer output and, on the side, the exact softmax rows of the repeated copy (normalised over every key
the row attends to) restricted to the columns of the original prompt, chunked over rows. Nothing else
(no ``output_attentions``, no eager attention over the full square) is materialised. That scoring is
:mod:`kvzap.kvzip` (shared with the KVzip+ oracle scorer of the library); this module samples positions and
writes the resumable, data-parallel shards.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

# The scoring itself lives in the library (kvzap.kvzip; the KVzip+ oracle scorer uses it too). Its names stay
# importable from here, the private ones included (tests and benchmarks reach into them).
from kvzap.kvzip import (
    REPEAT_INSTRUCTION,
    KVzipPlusOutput,
    RepeatPrompt,
    _kvzip_plus_log_scores,  # noqa: F401
    _scoring_context,  # noqa: F401
    _ScoringState,  # noqa: F401
    build_repeat_prompt,
    kvzip_plus_scores,
    scoring_attention,
)
from kvzap.kvzip import SCORING_ATTENTION_NAME as ATTENTION_NAME
from kvzap.layers import describe, prunable_layers

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_NAME",
    "REPEAT_INSTRUCTION",
    "KVzipPlusOutput",
    "RepeatPrompt",
    "build_repeat_prompt",
    "collect",
    "kvzip_plus_scores",
    "load_collection",
    "load_collections",
    "sample_positions",
    "scoring_attention",
]


# --------------------------------------------------------------------------------------------------------------
# Positions kept per prompt
# --------------------------------------------------------------------------------------------------------------


def sample_positions(prompt_len: int, n_tokens: int, seed: int) -> torch.Tensor:
    """Seeded random prompt positions (sorted, without replacement).

    Parameters
    ----------
    prompt_len : int
        Number of prompt tokens.
    n_tokens : int
        Positions wanted; all positions when the prompt is shorter.
    seed : int
        Seed of this draw (the collection uses ``seed + prompt index``, so the draw does not depend on which
        process handles the prompt).

    Returns
    -------
    torch.LongTensor
        ``(min(n_tokens, prompt_len),)`` positions in ``[0, prompt_len)``.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens}.")
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randperm(prompt_len, generator=generator)[:n_tokens]
    return positions.sort().values


# --------------------------------------------------------------------------------------------------------------
# Sharded, resumable, data-parallel collection
# --------------------------------------------------------------------------------------------------------------

MANIFEST_NAME = "manifest.json"
SETTINGS_NAME = "settings.json"


def shard_path(out_dir: Path, shard: int) -> Path:
    """File of shard number ``shard``."""
    return out_dir / f"shard-{shard:05d}.safetensors"


def _write_shard(path: Path, rows: list[dict[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Concatenate per-prompt rows and write them atomically (temporary file + rename)."""
    from safetensors.torch import save_file

    tensors = {name: torch.cat([r[name] for r in rows]).contiguous() for name in rows[0]}
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def collect(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    out_dir: str | os.PathLike,
    *,
    n_tokens: int = 500,
    shard_size: int = 8,
    seed: int = 0,
    feature_dtype: torch.dtype = torch.float16,
    chunk_size: int = 64,
    accelerator=None,
    extra_settings: dict | None = None,
    with_kvzip: bool = False,
    prune_sliding_layers: bool = False,
) -> dict:
    """Collect (hidden state, KVzip+ log-score) pairs for a list of prompts, in resumable shards.

    Prompts are grouped in shards of ``shard_size`` consecutive prompts; shard ``k`` is handled by process
    ``k % num_processes``. A shard file is written atomically once all its prompts are done, so a rerun with
    the same settings skips finished shards. The main process writes ``manifest.json`` at the end.

    Each shard holds ``X`` ``(rows, n_layers, D)`` (``feature_dtype``), ``y`` ``(rows, n_layers, kv_heads)``
    float32, ``prompt_index`` and ``position`` ``(rows,)`` int64, with ``rows = sum(min(n_tokens, len))``.
    ``n_layers`` counts the layers a press prunes (:func:`kvzap.layers.prunable_layers`): sliding-window layers
    are left out by default, and ``settings.json`` then lists the model layers collected under ``"layers"``
    (absent: every layer, as in collections made before this field existed).

    Parameters
    ----------
    model, tokenizer
        The model to score (see :func:`kvzip_plus_scores`).
    prompts : sequence of sequences of int
        Token ids of each prompt (without special tokens).
    out_dir : str or PathLike
        Output directory.
    n_tokens : int, default 500
        Random prompt positions kept per prompt.
    shard_size : int, default 8
        Prompts per shard file.
    seed : int, default 0
        Seed of the position draws.
    feature_dtype : torch.dtype, default torch.float16
        Storage dtype of the hidden states.
    chunk_size : int, default 64
        See :func:`kvzip_plus_scores`.
    accelerator : accelerate.Accelerator, optional
        For data-parallel runs; ``None`` runs everything in this process.
    extra_settings : dict, optional
        Stored in ``settings.json`` (e.g. the data source) and checked on resume.
    with_kvzip : bool, default False
        Also store ``y_kvzip`` ``(rows, n_layers, kv_heads)``, the plain KVzip log-scores that Fast KVzip gates
        are distilled from.
    prune_sliding_layers : bool, default False
        Also collect the sliding-window layers (for surrogates serving presses with the same option).

    Returns
    -------
    dict
        The manifest (also written to ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    if shard_size < 1:
        raise ValueError(f"shard_size must be a positive integer, got {shard_size}.")
    out_dir = Path(out_dir)
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    is_main = rank == 0

    config = model.config
    layers = prunable_layers(model, prune_sliding_layers)
    if not layers:
        raise ValueError(
            f"Nothing to collect: {describe(model)}, and presses leave sliding-window layers alone by default. "
            "Pass prune_sliding_layers=True (`kvzap train collect --prune-sliding-layers`) to collect them, for "
            "presses built with prune_sliding_layers=True."
        )
    settings = {
        "model": str(getattr(config, "_name_or_path", "")),
        "n_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "n_prompts": len(prompts),
        "n_tokens": n_tokens,
        "shard_size": shard_size,
        "seed": seed,
        "feature_dtype": str(feature_dtype).removeprefix("torch."),
        "target": "log KVzip+ score" + (" and log KVzip score (y_kvzip)" if with_kvzip else ""),
        **({} if len(layers) == config.num_hidden_layers else {"layers": list(layers)}),
        **(extra_settings or {}),
    }
    settings_file = out_dir / SETTINGS_NAME
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if settings_file.exists():
            previous = json.loads(settings_file.read_text())
            if previous != settings:
                changed = sorted(k for k in settings.keys() | previous.keys() if previous.get(k) != settings.get(k))
                raise ValueError(
                    f"{out_dir} holds a collection made with other settings ({', '.join(changed)}); "
                    "use another output directory or delete it."
                )
        else:
            settings_file.write_text(json.dumps(settings, indent=2))
    if accelerator is not None:
        accelerator.wait_for_everyone()

    n_shards = math.ceil(len(prompts) / shard_size)
    mine = [k for k in range(n_shards) if k % world == rank]
    todo = [k for k in mine if not shard_path(out_dir, k).exists()]
    if len(todo) < len(mine):
        logger.info("Process %d: %d of its %d shards already done, resuming", rank, len(mine) - len(todo), len(mine))
    n_todo_prompts = sum(min(shard_size, len(prompts) - k * shard_size) for k in todo)
    progress = tqdm(total=n_todo_prompts, desc=f"collect[{rank}]", unit="prompt", position=rank, disable=None)
    start = time.perf_counter()
    for k in todo:
        rows = []
        for index in range(k * shard_size, min((k + 1) * shard_size, len(prompts))):
            prompt = torch.as_tensor(list(prompts[index]), dtype=torch.long)
            result = kvzip_plus_scores(
                model,
                tokenizer,
                prompt,
                return_hidden_states=True,
                chunk_size=chunk_size,
                return_kvzip=with_kvzip,
                layers=layers,
            )
            positions = sample_positions(prompt.numel(), n_tokens, seed + index)
            row = {
                "X": result.hidden_states[:, positions].transpose(0, 1).to(feature_dtype),  # (n, n_layers, D)
                "y": result.log_scores[:, :, positions].permute(2, 0, 1).float(),  # (n, n_layers, kv_heads)
                "prompt_index": torch.full((positions.numel(),), index, dtype=torch.long),
                "position": positions,
            }
            if with_kvzip:
                row["y_kvzip"] = result.log_kvzip[:, :, positions].permute(2, 0, 1).float()  # (n, n_layers, H)
            rows.append(row)
            progress.update(1)
        _write_shard(shard_path(out_dir, k), rows, {"shard": str(k), "process": str(rank)})
    progress.close()
    logger.info("Process %d collected %d prompts in %.1f s", rank, n_todo_prompts, time.perf_counter() - start)

    if accelerator is not None:
        accelerator.wait_for_everyone()
    manifest = _write_manifest(out_dir, settings, n_shards) if is_main else {}
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return manifest if is_main else json.loads((out_dir / MANIFEST_NAME).read_text())


def _write_manifest(out_dir: Path, settings: dict, n_shards: int) -> dict:
    """Describe the finished shards in ``manifest.json``."""
    from safetensors import safe_open

    shards = []
    for k in range(n_shards):
        path = shard_path(out_dir, k)
        if not path.exists():
            raise RuntimeError(f"Shard {path} is missing after collection; rerun the same command to resume.")
        with safe_open(str(path), framework="pt") as f:
            n_rows = f.get_slice("y").get_shape()[0]
        shards.append({"file": path.name, "rows": n_rows})
    manifest = {**settings, "n_rows": sum(s["rows"] for s in shards), "shards": shards}
    tmp = out_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out_dir / MANIFEST_NAME)
    return manifest


def _model_key(manifest: dict) -> tuple:
    """What collections concatenated together must share: the model and the layers collected."""
    layers = manifest.get("layers")
    return (
        manifest["model"],
        manifest["n_layers"],
        manifest["hidden_size"],
        manifest["kv_heads"],
        None if layers is None else tuple(layers),
    )


def load_collection(out_dir: str | os.PathLike, target: str = "y") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Read a finished collection: :func:`load_collections` of one folder, with its one manifest.

    Returns ``X`` ``(rows, n_layers, D)`` (storage dtype), ``y`` ``(rows, n_layers, kv_heads)`` (``target``: ``"y"``
    log KVzip+, or ``"y_kvzip"`` log KVzip) and the manifest with ``prompt_index`` ``(rows,)``.
    """
    X, y, (manifest,) = load_collections([out_dir], target=target)
    return X, y, manifest


def load_collections(
    out_dirs: Sequence[str | os.PathLike], target: str = "y", layers: slice | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Read finished collections into one ``X`` and one ``y``, in the order given.

    Each shard is read and copied once into tensors allocated for all the rows, then dropped: the peak is the
    result plus one shard (a collection of 300 prompts is ~5 GB of hidden states; concatenating loaded
    collections would hold every one of them twice). With ``layers``, only those collected layers are read from
    each shard (a slice of the stored tensors): the result, and the peak, shrink in proportion.

    Parameters
    ----------
    out_dirs : sequence of str or PathLike
        Directories written by :func:`collect`, for the same model and layers.
    target : ``"y"`` (log KVzip+, default) or ``"y_kvzip"`` (log KVzip, collected with ``with_kvzip=True``).
    layers : slice, optional
        The collected layers to read (positions along the layer axis of ``X``, e.g. ``slice(0, 10)``; step 1);
        all by default.

    Returns
    -------
    X : torch.Tensor
        ``(rows, n_layers, D)`` hidden states (storage dtype); ``n_layers`` is the number of ``layers`` read.
    y : torch.Tensor
        ``(rows, n_layers, kv_heads)`` float32 log-scores.
    manifests : list of dict
        Each collection's manifest, plus ``prompt_index`` ``(rows,)`` (that collection's own prompt numbers).
    """
    from safetensors import safe_open

    out_dirs = [Path(d) for d in out_dirs]
    if not out_dirs:
        raise ValueError("Name at least one collection folder.")
    if layers is None:
        layers = slice(None)
    elif not isinstance(layers, slice) or layers.step not in (None, 1):
        raise ValueError(f"layers must be a slice of consecutive collected layers, e.g. slice(0, 10), got {layers!r}.")
    manifests = []
    for out_dir in out_dirs:
        manifest_file = out_dir / MANIFEST_NAME
        if not manifest_file.exists():
            raise FileNotFoundError(f"{manifest_file} not found: the collection in {out_dir} is missing or unfinished.")
        manifests.append(json.loads(manifest_file.read_text()))
    if len({_model_key(m) for m in manifests}) > 1:  # refused before any shard is read
        raise ValueError(f"The collections {[str(d) for d in out_dirs]} come from different models (or layers).")
    total = sum(int(s["rows"]) for m in manifests for s in m["shards"])
    X = y = None
    row = 0
    for out_dir, manifest in zip(out_dirs, manifests, strict=True):
        prompt_index = []
        for shard in manifest["shards"]:
            with safe_open(str(out_dir / shard["file"]), framework="pt") as f:
                if target not in f.keys():
                    raise ValueError(
                        f"The collection in {out_dir} has no {target!r} targets; collect with `--with-kvzip` for "
                        "Fast KVzip gates."
                    )
                # A slice is read from the file alone: the other layers' bytes are never copied.
                X_part, y_part = f.get_slice("X")[:, layers], f.get_slice(target)[:, layers]
                prompt_index.append(f.get_tensor("prompt_index"))
            n = X_part.shape[0]
            if n != int(shard["rows"]):
                raise ValueError(
                    f"{out_dir / shard['file']} holds {n} rows where its manifest says {shard['rows']}: the "
                    "collection is damaged; collect it again."
                )
            if X is None:
                X = torch.empty((total, *X_part.shape[1:]), dtype=X_part.dtype)
                y = torch.empty((total, *y_part.shape[1:]), dtype=y_part.dtype)
            elif X_part.shape[1:] != X.shape[1:] or y_part.shape[1:] != y.shape[1:]:
                raise ValueError(
                    f"{out_dir} holds pairs of shape {tuple(X_part.shape[1:])} / {tuple(y_part.shape[1:])}, the "
                    f"first collection {tuple(X.shape[1:])} / {tuple(y.shape[1:])}: the collections come from "
                    "different models (or layers)."
                )
            X[row : row + n] = X_part
            y[row : row + n] = y_part
            row += n
            del X_part, y_part
        manifest["prompt_index"] = torch.cat(prompt_index)
    return X, y, manifests
