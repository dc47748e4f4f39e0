"""Fit one surrogate module per layer: KVzap-Linear (ridge) or KVzap-MLP (:mod:`train.mlp`).

:func:`fit_surrogate` fits from tensors already in memory; :func:`fit_by_layer_groups` reads collections a group
of layers at a time, so a large collection never has to fit in memory whole. The fitted layers are copied into a
:class:`kvzap.surrogates.KVzapSurrogate` (the published ``nvidia/KVzap-*`` format).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from .metrics import pearson_r2
from .mlp import MLPConfig, check_pairs, fit_layers_mlp

logger = logging.getLogger(__name__)

MODEL_TYPES = ("linear", "mlp")

__all__ = [
    "MODEL_TYPES",
    "check_model_types",
    "fit_by_layer_groups",
    "fit_layer_linear",
    "fit_surrogate",
    "layer_map",
]


def check_model_types(model_types: Sequence[str]) -> None:
    """Raise ValueError unless every name of ``model_types`` is one of :data:`MODEL_TYPES`."""
    for model_type in model_types:
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_types must be drawn from {MODEL_TYPES}, got {model_type!r}.")


def fit_layer_linear(X: np.ndarray, y: np.ndarray) -> nn.Linear:
    """Ridge regression (scikit-learn defaults) from hidden states to log-scores, as an ``nn.Linear``.

    Parameters
    ----------
    X : np.ndarray
        ``(N, D)`` float32 hidden states.
    y : np.ndarray
        ``(N, H)`` float32 log-scores.

    Returns
    -------
    nn.Linear
        ``Linear(D, H)`` holding the fitted coefficients and intercepts.
    """
    from sklearn.linear_model import Ridge

    ridge = Ridge().fit(X, y)
    linear = nn.Linear(X.shape[1], y.shape[1])
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(np.asarray(ridge.coef_, dtype=np.float32)).view(y.shape[1], -1))  # (H, D)
        linear.bias.copy_(torch.from_numpy(np.asarray(ridge.intercept_, dtype=np.float32)).view(-1))  # (H,)
    return linear


def layer_map(manifest: dict) -> dict:
    """``fit_surrogate``'s ``layers`` and ``n_model_layers`` from a collection's manifest (its settings)."""
    layers = manifest.get("layers")  # absent: every layer was collected
    return {"layers": layers, "n_model_layers": manifest["n_layers"] if layers is not None else None}


def _layer_arrays(
    X: torch.Tensor, y: torch.Tensor, layer: int, rows: torch.Tensor | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """float32 numpy arrays of one layer, ``(N, D)`` and ``(N, H)``, of all rows or of ``rows``."""
    if rows is not None:
        return X[rows, layer].float().numpy(), y[rows, layer].float().numpy()
    return X[:, layer].float().numpy(), y[:, layer].float().numpy()


def fit_surrogate(
    X: torch.Tensor,
    y: torch.Tensor,
    model_type: str,
    *,
    mlp_config: MLPConfig | None = None,
    rows: torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
    n_model_layers: int | None = None,
):
    """Fit one surrogate module per collected layer.

    Parameters
    ----------
    X : torch.Tensor
        ``(N, L, D)`` hidden states entering each attention layer.
    y : torch.Tensor
        ``(N, L, H)`` log KVzip+ scores.
    model_type : {"linear", "mlp"}
        Surrogate family.
    mlp_config : MLPConfig, optional
        MLP hyper-parameters.
    rows : torch.Tensor, optional
        ``(n,)`` indices of the rows to fit on (all by default); taken one layer at a time, so a subset of a
        large collection is never copied whole.
    layers, n_model_layers : optional
        The model layer of each of the ``L`` collected layers and the model's number of layers, when the
        collection left layers out (its settings' ``"layers"``: sliding-window layers, see :mod:`kvzap.layers`).
        The surrogate then has one module per model layer, those not collected untrained (zeros) and listed
        apart in its ``prunable_layers``. Default: the ``L`` collected layers are the model's.

    Returns
    -------
    surrogate : KVzapSurrogate
        With ``n_modules = L`` (or ``n_model_layers``), ``input_dim = D``, ``output_dim = H``.
    history : dict
        The MLP's training history (:func:`train.mlp.fit_layers_mlp`; all layers are fitted together); empty for
        linear.
    """
    check_pairs(X, y)
    n, n_layers, d = X.shape
    if rows is not None:
        n = rows.numel()
    mlp_config = mlp_config or MLPConfig()
    surrogate, layers = _empty_surrogate(model_type, d, y.shape[2], n_layers, mlp_config, layers, n_model_layers)
    start = time.perf_counter()
    fitted, history = _fit_modules(X, y, model_type, mlp_config, rows)
    for column, module in enumerate(fitted):
        surrogate.layers[layers[column]].load_state_dict(module.state_dict())
    logger.debug("%s: %d layers fitted on %d pairs in %.1f s", model_type, n_layers, n, time.perf_counter() - start)
    return surrogate.eval(), history


def _empty_surrogate(
    model_type: str,
    d: int,
    n_heads: int,
    n_layers: int,
    mlp_config: MLPConfig,
    layers: Sequence[int] | None,
    n_model_layers: int | None,
):
    """The surrogate :func:`fit_surrogate` fills in (untrained modules zeroed when layers were left out), and the
    model layer of each collected layer."""
    from kvzap.surrogates import KVzapSurrogate

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}.")
    hidden = None if model_type == "linear" else (mlp_config.hidden_dim or max(1, d // 8))
    if layers is None:
        layers, n_model_layers = list(range(n_layers)), n_layers
    elif n_model_layers is None or len(layers) != n_layers:
        raise ValueError(
            f"layers must name the model layer of each of the {n_layers} collected layers, with n_model_layers "
            f"the model's number of layers; got layers={list(layers)!r} and n_model_layers={n_model_layers!r}."
        )
    partial = list(layers) != list(range(n_model_layers))
    surrogate = KVzapSurrogate(
        input_dim=d,
        output_dim=n_heads,
        n_modules=n_model_layers,
        hidden_dim=hidden,
        prunable_layers=list(layers) if partial else None,
    )
    if partial:  # untrained modules: zeros, never random weights that look like a prediction
        with torch.no_grad():
            for parameter in surrogate.parameters():
                parameter.zero_()
    return surrogate, list(layers)


def _fit_modules(
    X: torch.Tensor, y: torch.Tensor, model_type: str, mlp_config: MLPConfig, rows: torch.Tensor | None = None
) -> tuple[list[nn.Module], dict]:
    """One fitted module per layer of ``X`` ``(N, L, D)`` and ``y`` ``(N, L, H)``, and the MLP's history."""
    from tqdm.auto import tqdm

    if model_type == "mlp":
        logger.info("Fitting %d MLP layers together on %d pairs", X.shape[1], len(y) if rows is None else len(rows))
        return fit_layers_mlp(X, y, mlp_config, rows=rows)
    fitted = [
        fit_layer_linear(*_layer_arrays(X, y, column, rows))
        for column in tqdm(range(X.shape[1]), desc="fit linear", unit="layer", disable=None)
    ]
    return fitted, {}


@torch.no_grad()
def _modules_r2(modules: Sequence[nn.Module], X: torch.Tensor, y: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """``(L, H)`` R^2 of one module per layer of ``X`` ``(N, L, D)`` against ``y`` ``(N, L, H)``."""
    prediction = torch.stack(
        [
            torch.cat([module(X[i : i + chunk, j].float()) for i in range(0, X.shape[0], chunk)])
            for j, module in enumerate(modules)
        ],
        dim=1,
    )  # (N, L, H)
    return pearson_r2(prediction, y.float())


def fit_by_layer_groups(
    train_dirs: Sequence[str | os.PathLike],
    model_types: Sequence[str],
    group_size: int | None = None,
    mlp_config: MLPConfig | None = None,
) -> tuple[dict, dict, dict]:
    """Fit surrogates on collections ``group_size`` collected layers at a time (None: all at once), each group read
    from disk alone.

    A surrogate has one module per layer, trained on that layer's pairs only, so the layers need not be in memory
    together: each group of layers is read (:func:`train.collect.load_collections` with ``layers``), fitted for
    every model type, and dropped before the next. Memory is that of ``group_size`` layers of hidden states (a
    2,000-prompt collection of a 30-layer model, ~40 GB in all, fits in 8 GB with groups of 5). The training is
    that of one fit of all layers (:func:`train.mlp.fit_layers_mlp`: each layer is initialised, batched, clipped and
    updated as if alone; the same validation rows), up to the order of floating-point sums.

    Returns
    -------
    surrogates : dict
        model type -> fitted ``KVzapSurrogate``.
    histories : dict
        model type -> the history :func:`fit_surrogate` returns (losses summed over all layers per epoch).
    extras : dict
        model type -> ``{"train_r2": mean R^2 on the training pairs, "fit_seconds": fitting time}``; and
        ``"manifests"``: the collections' manifests (with ``prompt_index``), ``"n_pairs"``: training rows.
    """
    from .collect import load_collections

    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive number of layers, got {group_size!r}.")
    mlp_config = mlp_config or MLPConfig()
    surrogates: dict = {}
    histories: dict = {}
    extras: dict = {t: {"fit_seconds": 0.0, "r2": []} for t in model_types}
    start, n_layers, manifests, n_pairs = 0, None, None, 0
    while n_layers is None or start < n_layers:
        stop = None if group_size is None else start + group_size
        X, y, group_manifests = load_collections(train_dirs, layers=slice(start, stop))  # each shard copied once
        if n_layers is None:  # the first group tells the shapes and the layers collected
            manifests, n_pairs = group_manifests, int(X.shape[0])
            mapping = layer_map(manifests[0])
            n_layers = len(mapping["layers"]) if mapping["layers"] is not None else manifests[0]["n_layers"]
            for model_type in model_types:
                surrogates[model_type] = _empty_surrogate(
                    model_type, X.shape[2], y.shape[2], n_layers, mlp_config, **mapping
                )
        logger.info(
            "Layers %d-%d of %d: X %s, y %s from %s",
            start,
            start + X.shape[1] - 1,
            n_layers,
            tuple(X.shape),
            tuple(y.shape),
            ", ".join(map(str, train_dirs)),
        )
        for model_type in model_types:
            began = time.perf_counter()
            fitted, history = _fit_modules(X, y, model_type, mlp_config)
            surrogate, layers = surrogates[model_type]
            for column, module in enumerate(fitted):
                surrogate.layers[layers[start + column]].load_state_dict(module.state_dict())
            extras[model_type]["fit_seconds"] += time.perf_counter() - began
            extras[model_type]["r2"].append(_modules_r2(fitted, X, y))
            merged = histories.setdefault(model_type, {})
            for key, value in history.items():
                if key in ("train_loss", "valid_loss"):  # summed over layers, per epoch
                    merged[key] = [a + b for a, b in zip(merged[key], value, strict=True)] if key in merged else value
                else:  # one value per layer
                    merged[key] = merged.get(key, []) + value
        start += X.shape[1]
        del X, y
    result = {t: surrogates[t][0].eval() for t in model_types}
    for model_type in model_types:
        extra = extras[model_type]
        extra["train_r2"] = float(torch.cat(extra.pop("r2")).mean())
    extras["manifests"], extras["n_pairs"] = manifests, n_pairs
    return result, histories, extras
