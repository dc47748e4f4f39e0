"""Fast KVzip gates (arXiv 2601.17668) distilled from KVzip scores.

Each layer's gate maps the hidden state of a token to a number in (0, 1) per KV head and is trained with binary
cross-entropy against the token's KVzip score (its max attention weight while the model repeats the prompt,
in [0, 1]). Defaults follow the paper: SGD with momentum 0.9, learning rate 0.2, 5,000 steps of 1,000 pairs.
The collection must hold the plain KVzip targets (``python -m train collect --with-kvzip``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from kvzap.surrogates.fastkvzip import FastKVzipGates

from .metrics import pearson_r2

logger = logging.getLogger(__name__)

__all__ = ["GateConfig", "fit_gates", "evaluate_gates", "fit_gates_and_save"]


@dataclass
class GateConfig:
    """Training settings of the gates (paper defaults)."""

    steps: int = 5000
    batch_size: int = 1000
    lr: float = 0.2
    momentum: float = 0.9
    gate_dim: int = 16
    n_sinks: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "gate_dim", "n_sinks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")


def _bce(gate: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The gate is a mean of softmax entries: clamp before the logs so saturated gates give finite losses.
    prob = gate(x).clamp(1e-6, 1 - 1e-6)  # (n, H)
    return nn.functional.binary_cross_entropy(prob, target)


def fit_gates(
    X: torch.Tensor, log_kvzip: torch.Tensor, n_groups: int, config: GateConfig | None = None
) -> tuple[FastKVzipGates, list[list[float]]]:
    """Train one gate per layer.

    Parameters
    ----------
    X : ``(N, n_layers, D)`` hidden states entering attention.
    log_kvzip : ``(N, n_layers, H)`` log KVzip scores (targets are ``exp`` of these, in [0, 1]).
    n_groups : query heads per KV head of the model.

    Returns
    -------
    The gates (eval mode, float32) and the training loss curve of each layer (every 100 steps).
    """
    config = config or GateConfig()
    n, n_layers, dim = X.shape
    if log_kvzip.shape[:2] != (n, n_layers):
        raise ValueError(f"X {tuple(X.shape)} and targets {tuple(log_kvzip.shape)} do not pair up.")
    n_heads = log_kvzip.shape[-1]
    gates = FastKVzipGates(dim, n_heads, n_groups, n_layers, config.gate_dim, config.n_sinks)
    generator = torch.Generator().manual_seed(config.seed)
    curves = []
    for layer in tqdm(range(n_layers), desc="gates", unit="layer"):
        gate = gates.layers[layer]
        x_all = X[:, layer].float()  # (N, D)
        target_all = log_kvzip[:, layer].float().exp().clamp(0, 1)  # (N, H)
        optimizer = torch.optim.SGD(gate.parameters(), lr=config.lr, momentum=config.momentum)
        curve = []
        for step in range(config.steps):
            index = torch.randint(0, n, (min(config.batch_size, n),), generator=generator)
            loss = _bce(gate, x_all[index], target_all[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                curve.append(loss.item())
        curves.append(curve)
    return gates.eval(), curves


@torch.no_grad()
def evaluate_gates(gates: FastKVzipGates, X: torch.Tensor, log_kvzip: torch.Tensor) -> dict:
    """Per-layer BCE and R^2 (squared Pearson) between ``log(gate)`` and the log KVzip score."""
    per_layer_r2, per_layer_bce = [], []
    for layer, gate in enumerate(gates.layers):
        x = X[:, layer].float()
        target = log_kvzip[:, layer].float()
        per_layer_bce.append(float(_bce(gate, x, target.exp().clamp(0, 1))))
        per_layer_r2.append(float(pearson_r2(gate.log_gate(x), target).mean()))
    return {
        "mean_r2": sum(per_layer_r2) / len(per_layer_r2),
        "mean_bce": sum(per_layer_bce) / len(per_layer_bce),
        "per_layer_r2": per_layer_r2,
        "per_layer_bce": per_layer_bce,
    }


def fit_gates_and_save(
    train_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    n_groups: int,
    test_dir: str | os.PathLike | None = None,
    config: GateConfig | None = None,
) -> dict:
    """Fit gates on collections made with ``with_kvzip=True``; write ``out_dir`` and ``out_dir/report.json``."""
    from .collect import load_collection, load_collections

    config = config or GateConfig()
    X, y, _ = load_collections(train_dirs, target="y_kvzip")  # each shard copied once
    gates, curves = fit_gates(X, y, n_groups, config)
    out_dir = Path(out_dir)
    gates.save_pretrained(out_dir)
    report = {"config": asdict(config), "n_train_pairs": int(X.shape[0]), "train": evaluate_gates(gates, X, y)}
    report["loss_curves"] = curves
    if test_dir is not None:
        X_test, y_test, _ = load_collection(test_dir, target="y_kvzip")
        report["test"] = evaluate_gates(gates, X_test, y_test)
        report["n_test_pairs"] = int(X_test.shape[0])
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report
