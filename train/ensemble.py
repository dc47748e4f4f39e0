"""Average several trained surrogates into one checkpoint of the published format.

The mean of K KVzap-MLPs is itself a KVzap-MLP: the K hidden layers side by side (hidden width the sum of theirs),
each member's output weights scaled by its weight, the output biases averaged. The mean of K KVzap-Linears is one
KVzap-Linear with the averaged weights. Both are exact (up to floating-point sums), so an ensemble loads, scores
and presses like any surrogate (``KVzapSurrogate.from_pretrained``), at the cost of a wider hidden layer.

Why: the MLPs fitted here overfit (train R^2 ~0.74 against ~0.64 held out at 300 prompts), and two of them fitted
on different prompts average to a better surrogate than either (``research/smollm2-135m-ensemble``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from kvzap.surrogates.kvzap_surrogate import KVzapSurrogate

ENSEMBLE_NAME = "ensemble.json"


def _shares(weights: Sequence[float] | None, n: int) -> list[float]:
    """``weights`` normalised to sum to 1 (equal when None), after checking there is one positive weight per member."""
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(f"Got {len(weights)} weights for {n} surrogates; give one per surrogate.")
    if any(not w > 0 for w in weights):
        raise ValueError(f"Weights must be positive, got {list(weights)}.")
    return [float(w) / sum(weights) for w in weights]


def average_surrogates(surrogates: Sequence[KVzapSurrogate], weights: Sequence[float] | None = None) -> KVzapSurrogate:
    """One surrogate predicting the weighted mean of the members' predictions.

    Parameters
    ----------
    surrogates : sequence of KVzapSurrogate
        Two or more surrogates of the same type (all MLP or all linear) for the same model (``input_dim``,
        ``output_dim``, ``n_modules`` and ``prunable_layers`` equal).
    weights : sequence of float, optional
        One positive weight per member, normalised to sum to 1; equal by default.

    Returns
    -------
    KVzapSurrogate
        float32, in eval mode. An MLP's ``hidden_dim`` is the sum of the members'.

    Raises
    ------
    ValueError
        If fewer than two surrogates are given, they differ in type or shape, or a weight is not positive.
    """
    if len(surrogates) < 2:
        raise ValueError(f"An ensemble needs at least two surrogates, got {len(surrogates)}.")
    first = surrogates[0]
    for i, member in enumerate(surrogates[1:], start=1):
        for field in ("model_type", "input_dim", "output_dim", "n_modules", "prunable_layers"):
            if getattr(member, field) != getattr(first, field):
                raise ValueError(
                    f"Surrogate {i} has {field}={getattr(member, field)!r} but surrogate 0 has "
                    f"{getattr(first, field)!r}: only surrogates of one type trained for the same model average."
                )
    w = _shares(weights, len(surrogates))

    states = [{k: v.detach().float() for k, v in member.state_dict().items()} for member in surrogates]
    hidden_dim = None if first.hidden_dim is None else sum(member.hidden_dim for member in surrogates)
    merged = KVzapSurrogate(
        first.input_dim, first.output_dim, first.n_modules, hidden_dim=hidden_dim, prunable_layers=first.prunable_layers
    )
    state = {}
    for i in range(first.n_modules):
        if hidden_dim is None:
            for name in (f"layers.{i}.weight", f"layers.{i}.bias"):
                state[name] = sum(wk * s[name] for wk, s in zip(w, states, strict=True))
        else:
            state[f"layers.{i}.0.weight"] = torch.cat([s[f"layers.{i}.0.weight"] for s in states])
            state[f"layers.{i}.0.bias"] = torch.cat([s[f"layers.{i}.0.bias"] for s in states])
            state[f"layers.{i}.2.weight"] = torch.cat(
                [wk * s[f"layers.{i}.2.weight"] for wk, s in zip(w, states, strict=True)], dim=1
            )
            state[f"layers.{i}.2.bias"] = sum(wk * s[f"layers.{i}.2.bias"] for wk, s in zip(w, states, strict=True))
    merged.load_state_dict(state)
    return merged.eval()


def ensemble(
    members: Sequence[str | os.PathLike], out: str | os.PathLike, weights: Sequence[float] | None = None
) -> dict:
    """Average the surrogates saved in ``members`` into ``out`` (``config.json`` + ``model.safetensors``).

    ``out/ensemble.json`` records each member's path, weight and the sha256 of its ``model.safetensors``.
    Everything is read and checked before anything is written.

    Returns
    -------
    dict
        The record written to ``ensemble.json``.
    """
    paths = [Path(m) for m in members]
    missing = [str(p) for p in paths if not (p / "model.safetensors").is_file()]
    if missing:
        raise ValueError(
            f"No model.safetensors in {', '.join(missing)}: give the directories of saved surrogates "
            "(e.g. OUT/mlp of `fit`)."
        )
    surrogates = [KVzapSurrogate.from_pretrained(p, local_files_only=True) for p in paths]
    merged = average_surrogates(surrogates, weights)
    record = {
        "model_type": merged.model_type,
        "hidden_dim": merged.hidden_dim,
        "members": [
            {
                "path": str(p),
                "weight": share,
                "sha256": hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest(),
            }
            for p, share in zip(paths, _shares(weights, len(paths)), strict=True)
        ],
    }
    out = merged.save_pretrained(out)
    (out / ENSEMBLE_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return record
