"""Kinds of text: which kind each collected row is, saved surrogates evaluated per kind, and leave-kinds-out fits.

The kind of a prompt (see :mod:`train.corpus`) is read from the ``prompts.jsonl`` that ``python -m train collect``
writes (:func:`collection_kinds`). :func:`evaluate_saved` reports R^2 and kept-set overlaps per kind of saved
surrogates; :func:`leave_kinds_out` fits without one kind at a time and tests on that kind alone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .metrics import evaluate_surrogate
from .mlp import MLPConfig
from .plots import plot_kinds
from .surrogate import MODEL_TYPES, check_model_types, fit_surrogate, layer_map

logger = logging.getLogger(__name__)

__all__ = ["collection_kinds", "evaluate_saved", "leave_kinds_out"]


def collection_kinds(collection_dir: str | os.PathLike, prompt_index: torch.Tensor) -> list[str]:
    """Kind of text of every row of a collection, from the ``prompts.jsonl`` that ``python -m train collect`` writes.

    Line ``i`` of ``prompts.jsonl`` describes prompt ``i``; its ``kind`` field is used when present, else the
    kind of its corpus ``subset`` (:func:`train.corpus.kind_of`; a Hub dataset config is its own kind).

    Parameters
    ----------
    collection_dir : str or PathLike
        A collection folder (one split).
    prompt_index : torch.Tensor
        ``(N,)`` prompt of each row (``load_collection(...)[2]["prompt_index"]``).

    Returns
    -------
    list of str
        ``N`` kinds.
    """
    from .corpus import kind_of

    path = Path(collection_dir) / "prompts.jsonl"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: the kinds of the prompts of {collection_dir} are unknown; collect with "
            "`python -m train collect`, which writes it."
        )
    prompts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kinds = [p.get("kind") or kind_of(str(p.get("subset", ""))) for p in prompts]
    if prompt_index.numel() and int(prompt_index.max()) >= len(kinds):
        raise ValueError(
            f"{path} describes {len(kinds)} prompts but the collection has rows of prompt {int(prompt_index.max())}."
        )
    return [kinds[i] for i in prompt_index.tolist()]


def _load_with_kinds(
    dirs: Sequence[str | os.PathLike],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str], dict]:
    """Concatenate collections with the kind of every row and prompt numbers that stay distinct across them.

    Returns ``X (N, L, D)``, ``y (N, L, H)``, ``groups (N,)``, ``kinds`` (N names) and the first manifest.
    """
    from .collect import load_collections

    if not dirs:
        raise ValueError("Name at least one collection folder.")
    X, y, manifests = load_collections(dirs)
    groups, kinds, offset = [], [], 0
    for directory, manifest in zip(dirs, manifests, strict=True):
        prompt_index = manifest["prompt_index"]
        kinds += collection_kinds(directory, prompt_index)
        groups.append(prompt_index + offset)  # prompt 0 of the second collection is another prompt
        offset += int(manifest["n_prompts"])
    return X, y, torch.cat(groups), kinds, manifests[0]


def evaluate_saved(
    surrogates: dict[str, str | os.PathLike],
    collection_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
) -> dict:
    """Evaluate saved surrogates (e.g. the bundled ones) on collections: R^2 and kept-set overlaps per kind.

    Writes ``out_dir/eval.json`` and ``out_dir/kinds.png``.

    Parameters
    ----------
    surrogates : dict
        Name -> folder written by ``KVzapSurrogate.save_pretrained``.
    collection_dirs : sequence of str or PathLike
        Collections (with their ``prompts.jsonl``), concatenated.
    out_dir : str or PathLike
        Output folder.

    Returns
    -------
    dict
        The report written to ``eval.json``.
    """
    from kvzap.surrogates import KVzapSurrogate

    X, y, groups, kinds, manifest = _load_with_kinds(collection_dirs)
    report = {
        "model": manifest.get("model"),
        "collections": [str(d) for d in collection_dirs],
        "n_pairs": int(X.shape[0]),
        "n_prompts": int(torch.unique(groups).numel()),
        "surrogates": {},
    }
    for name, directory in surrogates.items():
        surrogate = KVzapSurrogate.from_pretrained(directory).eval()
        entry = {"path": str(directory), **evaluate_surrogate(surrogate, X, y, prompt_index=groups, kinds=kinds)}
        report["surrogates"][name] = entry
        logger.info("%s: R^2 %.3f on %d pairs", name, entry["mean_r2"], entry["n_pairs"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2))
    plot_kinds(report["surrogates"], out_dir / "kinds.png", title=f"Surrogates of {Path(str(report['model'])).name}")
    return report


def leave_kinds_out(
    train_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    test_dirs: Sequence[str | os.PathLike] = (),
    kinds: Sequence[str] | None = None,
    model_types: tuple[str, ...] = MODEL_TYPES,
    mlp_config: MLPConfig | None = None,
) -> dict:
    """Fit without one kind of text at a time and test on that kind alone.

    For each held-out kind ``K``: fit on the rows of ``train_dirs`` of every other kind, then evaluate on every
    row of kind ``K`` in ``train_dirs`` and ``test_dirs`` (none of them was seen, so both splits count).
    Writes ``out_dir/leave_kinds_out.json`` and ``out_dir/leave_kinds_out.png``; no surrogate is saved.

    Parameters
    ----------
    train_dirs : sequence of str or PathLike
        Training collections (with their ``prompts.jsonl``).
    out_dir : str or PathLike
        Output folder.
    test_dirs : sequence of str or PathLike
        Held-out collections whose rows of kind ``K`` join the test of ``K``.
    kinds : sequence of str, optional
        Kinds to hold out; all kinds of the training rows by default.
    model_types : tuple of str
        Surrogates to fit.
    mlp_config : MLPConfig, optional
        MLP hyper-parameters.

    Returns
    -------
    dict
        The report: per held-out kind, pair and prompt counts and, per surrogate type, R^2 and overlaps.
    """
    check_model_types(model_types)
    mlp_config = mlp_config or MLPConfig()
    # Training and test rows stay in two tensors: a collection of 300 prompts holds several GB of hidden states.
    X, y, groups, row_kinds, manifest = _load_with_kinds(list(train_dirs))
    labels = np.asarray(row_kinds)
    if test_dirs:
        X_t, y_t, groups_t, kinds_t, _ = _load_with_kinds(list(test_dirs))
        if X_t.shape[1:] != X.shape[1:] or y_t.shape[1:] != y.shape[1:]:
            raise ValueError("The test collections come from another model than the training collections.")
        groups_t = groups_t + int(groups.max()) + 1  # prompts of the test collections are other prompts
    else:
        X_t, y_t, groups_t, kinds_t = X[:0], y[:0], groups[:0], []
    labels_t = np.asarray(kinds_t) if kinds_t else np.asarray([], dtype=object)
    kinds = sorted(set(row_kinds)) if kinds is None else list(kinds)
    missing = sorted(set(kinds) - set(row_kinds) - set(kinds_t))
    if missing:
        raise ValueError(
            f"No rows of the kinds {missing} to test on; the collections hold {sorted(set(row_kinds) | set(kinds_t))}."
        )
    report = {
        "model": manifest.get("model"),
        "train_dirs": [str(d) for d in train_dirs],
        "test_dirs": [str(d) for d in test_dirs],
        "mlp_config": asdict(mlp_config),
        "kinds": {},
    }
    for kind in kinds:
        fit_rows = torch.from_numpy(np.flatnonzero(labels != kind))
        rows, rows_t = (
            torch.from_numpy(np.flatnonzero(labels == kind)),
            torch.from_numpy(np.flatnonzero(labels_t == kind)),
        )
        X_k, y_k = torch.cat([X[rows], X_t[rows_t]]), torch.cat([y[rows], y_t[rows_t]])  # (n_k, L, D), (n_k, L, H)
        groups_k = torch.cat([groups[rows], groups_t[rows_t]])
        if fit_rows.numel() == 0:
            raise ValueError(
                f"Holding out {kind!r} leaves no training rows: the training collections hold no other kind."
            )
        entry = {
            "n_train_pairs": int(fit_rows.numel()),
            "n_test_pairs": int(groups_k.numel()),
            "n_test_prompts": int(torch.unique(groups_k).numel()),
            "surrogates": {},
        }
        for model_type in model_types:
            start = time.perf_counter()
            surrogate, _ = fit_surrogate(X, y, model_type, mlp_config=mlp_config, rows=fit_rows, **layer_map(manifest))
            result = evaluate_surrogate(surrogate, X_k, y_k, prompt_index=groups_k)
            result["fit_seconds"] = round(time.perf_counter() - start, 1)
            entry["surrogates"][model_type] = result
            logger.info("held out %s: %s R^2 %.3f", kind, model_type, result["mean_r2"])
        report["kinds"][kind] = entry
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "leave_kinds_out.json").write_text(json.dumps(report, indent=2))
    by_type = {t: {"per_kind": {k: e["surrogates"][t] for k, e in report["kinds"].items()}} for t in model_types}
    plot_kinds(by_type, out_dir / "leave_kinds_out.png", title="Each kind held out of the fit, then tested alone")
    return report
