"""Fit KVzap surrogates (one model per layer) on collected (hidden state, log KVzip+ score) pairs.

- KVzap-Linear: scikit-learn ``Ridge()`` with its defaults (closed form), one multi-output fit per layer.
- KVzap-MLP: ``Linear(D, D/8) -> GELU -> Linear(D/8, H)`` trained with skorch: MSE, AdamW (lr 5e-3), batch 512,
  15 epochs, cosine learning-rate schedule (per batch), gradient clipping at 1.0 and a 5% validation split. All
  layers train in one fit (:func:`fit_layers_mlp`), each exactly as if it were fitted alone.

The fitted layers are copied into a :class:`kvzap.surrogates.KVzapSurrogate` and written with
``save_pretrained`` (the published ``nvidia/KVzap-*`` format). Quality is the paper's R^2: the squared Pearson
correlation between predicted and true log-scores, per layer and KV head, on held-out prompts.

R^2 over all pairs is not what a threshold sees: at high compression only the top of the score distribution
survives. :func:`kept_overlap` measures how much of the oracle's kept set the surrogate keeps at 50%, 67% and
80% eviction, per head (top share of each prompt, layer and head) and DMS-like (one threshold per layer over
all heads and prompts), and :func:`top_recall` how many of the oracle's very top pairs (top 1% and 5% of each
layer) survive 80% and 90% eviction under one threshold per layer. These metrics are reported per **kind** of
text (see :mod:`train.corpus`) of the held-out prompts, and :func:`leave_kinds_out` fits without one kind at a
time and tests on that kind alone.
``MLPConfig.top_weight`` optionally weights the loss of the pairs above a per-head quantile of the targets.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

MODEL_TYPES = ("linear", "mlp")

EVICTIONS = (0.5, 0.67, 0.8)

TOP_RECALL_EVICTIONS = (0.8, 0.9)

TOP_RECALL_SHARES = (0.01, 0.05)

__all__ = [
    "EVICTIONS",
    "TOP_RECALL_EVICTIONS",
    "TOP_RECALL_SHARES",
    "MLPConfig",
    "MODEL_TYPES",
    "LayerwiseMLP",
    "TopWeightedMSELoss",
    "collection_kinds",
    "evaluate_saved",
    "evaluate_surrogate",
    "fit_layer_linear",
    "fit_layer_mlp",
    "fit_layers_mlp",
    "fit_surrogate",
    "kept_overlap",
    "leave_kinds_out",
    "pearson_r2",
    "plot_kinds",
    "plot_r2",
    "top_recall",
]


@dataclass
class MLPConfig:
    """Training hyper-parameters of KVzap-MLP (defaults: the paper's).

    Attributes
    ----------
    hidden_dim : int or None
        Width of the hidden layer; ``None`` means ``D // 8``.
    lr : float
        AdamW learning rate.
    batch_size : int
        Mini-batch size.
    max_epochs : int
        Epochs; the cosine schedule decays to zero over all of them.
    grad_clip : float
        Gradient-norm clipping threshold.
    valid_fraction : float
        Share of the training pairs held out for skorch's validation loss (0 disables it).
    weight_decay : float
        AdamW weight decay (PyTorch's default).
    seed : int
        Seed of the initialisation, the shuffling and the validation split.
    top_weight : float
        Extra loss weight of the pairs whose target lies at or above the head's ``top_quantile`` of the training
        targets (weight ``1 + top_weight``; 0, the default, is the paper's plain MSE).
    top_quantile : float
        Where the top of each head's score distribution starts, in ``[0, 1)``.
    """

    hidden_dim: int | None = None
    lr: float = 5e-3
    batch_size: int = 512
    max_epochs: int = 15
    grad_clip: float = 1.0
    valid_fraction: float = 0.05
    weight_decay: float = 0.01
    seed: int = 0
    top_weight: float = 0.0
    top_quantile: float = 0.5


class TopWeightedMSELoss(nn.Module):
    """MSE in which the pairs at the top of each head's score distribution weigh ``1 + top_weight``.

    On ``(N, L, H)`` predictions of ``L`` layers fitted together (:func:`fit_layers_mlp`), each layer's weighted
    mean is taken on its own and the layers' losses are summed: each layer's gradient is the one it would get
    fitted alone.

    Parameters
    ----------
    thresholds : torch.Tensor
        ``(H,)`` (or ``(L, H)``, one row per layer) target value from which a pair counts as "top".
    top_weight : float
        Extra weight of the top pairs (non-negative); 0 gives the plain MSE.
    """

    def __init__(self, thresholds: torch.Tensor, top_weight: float):
        super().__init__()
        if top_weight < 0:
            raise ValueError(f"top_weight must be non-negative, got {top_weight}.")
        self.register_buffer("thresholds", torch.as_tensor(thresholds, dtype=torch.float32))
        self.top_weight = float(top_weight)

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Weighted mean squared error of ``(N, H)`` predictions and targets, or the sum over layers of the
        per-layer weighted means of ``(N, L, H)`` ones (a scalar)."""
        squared = (prediction - target).square()
        if self.top_weight == 0:
            return squared.mean() if squared.ndim == 2 else squared.mean(dim=(0, 2)).sum()
        weight = 1.0 + self.top_weight * (target >= self.thresholds).to(target.dtype)
        # Normalised by the total weight, so the loss stays on the scale of the MSE whatever the weight.
        if squared.ndim == 2:
            return (weight * squared).sum() / weight.sum()
        return ((weight * squared).sum(dim=(0, 2)) / weight.sum(dim=(0, 2))).sum()


class LayerwiseMLP(nn.Module):
    """``L`` independent ``Linear(D, hidden) -> GELU -> Linear(hidden, H)`` MLPs, one per layer, run as batched
    matrix products: ``(B, L, D)`` hidden states (any float dtype) -> ``(B, L, H)`` log-scores.

    Fitting a model's layers together costs about one layer's fit in Python overhead (the MLPs are tiny: their
    training is dominated by the fixed cost of each step, not by arithmetic). :meth:`layer` gives layer ``i`` in
    the checkpoint's layout (``nn.Sequential``, indices 0 and 2 linear).
    """

    def __init__(self, layers: Sequence[nn.Sequential]):
        super().__init__()
        self.weight1 = nn.Parameter(torch.stack([m[0].weight.detach() for m in layers]))  # (L, hidden, D)
        self.bias1 = nn.Parameter(torch.stack([m[0].bias.detach() for m in layers]))  # (L, hidden)
        self.weight2 = nn.Parameter(torch.stack([m[2].weight.detach() for m in layers]))  # (L, H, hidden)
        self.bias2 = nn.Parameter(torch.stack([m[2].bias.detach() for m in layers]))  # (L, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight1.dtype).transpose(0, 1)  # (L, B, D)
        hidden = nn.functional.gelu(torch.baddbmm(self.bias1.unsqueeze(1), x, self.weight1.transpose(1, 2)))
        return torch.baddbmm(self.bias2.unsqueeze(1), hidden, self.weight2.transpose(1, 2)).transpose(0, 1)

    def layer(self, i: int) -> nn.Sequential:
        """Layer ``i`` as ``Linear -> GELU -> Linear`` (a copy)."""
        (hidden, d), h = self.weight1.shape[1:], self.weight2.shape[1]
        module = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, h))
        with torch.no_grad():
            module[0].weight.copy_(self.weight1[i])
            module[0].bias.copy_(self.bias1[i])
            module[2].weight.copy_(self.weight2[i])
            module[2].bias.copy_(self.bias2[i])
        return module.eval()


class _Pairs(torch.utils.data.Dataset):
    """Rows ``rows`` (all by default) of ``X`` ``(N, L, D)`` and ``y`` ``(N, L, H)``, fetched a batch at a time
    (``__getitems__``: one gather per batch, no per-row collation) and never copied whole."""

    def __init__(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None = None):
        self.X, self.y, self.rows = X, y, rows

    def __len__(self) -> int:
        return self.X.shape[0] if self.rows is None else self.rows.numel()

    def __getitems__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        if self.rows is not None:
            index = self.rows[index]
        return self.X[index], self.y[index]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        X, y = self.__getitems__([i])
        return X[0], y[0]


def _batch_as_fetched(batch):
    """The DataLoader's collate function: :meth:`_Pairs.__getitems__` already returns a whole batch."""
    return batch


def _layer_gradient_clip(max_norm: float):
    """A skorch callback clipping the gradient norm of each layer of a :class:`LayerwiseMLP` on its own (as
    ``torch.nn.utils.clip_grad_norm_`` does for one layer's parameters fitted alone)."""
    from skorch.callbacks import Callback

    class LayerGradientClip(Callback):
        def on_grad_computed(self, net, named_parameters, **kwargs):
            grads = [p.grad for _, p in named_parameters if p.grad is not None]
            norms = torch.stack([g.detach().flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()  # (L,)
            coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.view(-1, *[1] * (g.dim() - 1)))

    return LayerGradientClip()


def pearson_r2(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared Pearson correlation along the first dimension.

    Parameters
    ----------
    prediction, target : torch.Tensor
        ``(N, ...)`` with the same shape.

    Returns
    -------
    torch.Tensor
        ``(...)`` float64 R^2 values (0 where a column is constant).
    """
    if prediction.shape != target.shape:
        raise ValueError(f"prediction and target must have the same shape, got {prediction.shape} and {target.shape}.")
    p = prediction.double() - prediction.double().mean(dim=0)
    t = target.double() - target.double().mean(dim=0)
    denominator = (p.square().sum(dim=0) * t.square().sum(dim=0)).sqrt()
    r = (p * t).sum(dim=0) / denominator.clamp_min(1e-30)
    return r.square()


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


def fit_layer_mlp(X: np.ndarray, y: np.ndarray, config: MLPConfig | None = None) -> tuple[nn.Sequential, dict]:
    """Train ``Linear(D, hidden) -> GELU -> Linear(hidden, H)`` with skorch (one layer: :func:`fit_layers_mlp`).

    Parameters
    ----------
    X : np.ndarray
        ``(N, D)`` float32 hidden states.
    y : np.ndarray
        ``(N, H)`` float32 log-scores.
    config : MLPConfig, optional
        Hyper-parameters; the paper's by default.

    Returns
    -------
    module : nn.Sequential
        The trained module (indices 0 and 2 are the linear layers, as in the checkpoint format).
    history : dict
        ``train_loss`` and ``valid_loss`` per epoch (``valid_loss`` empty without a validation split).
    """
    X_t, y_t = torch.as_tensor(np.asarray(X, dtype=np.float32)), torch.as_tensor(np.asarray(y, dtype=np.float32))
    modules, history = fit_layers_mlp(X_t[:, None], y_t[:, None], config)
    return modules[0], {"train_loss": history["train_loss"], "valid_loss": history["valid_loss"]}


def fit_layers_mlp(
    X: torch.Tensor, y: torch.Tensor, config: MLPConfig | None = None, rows: torch.Tensor | None = None
) -> tuple[list[nn.Sequential], dict]:
    """Train one ``Linear(D, hidden) -> GELU -> Linear(hidden, H)`` per layer, all layers in one skorch fit.

    The same training as fitting each layer alone, one after the other: each layer starts from the
    initialisation it would get alone (seeded by ``config.seed``), sees the same batches in the same order, gets
    its own loss's gradient (the loss is the sum of the layers' losses), its own gradient-norm clipping and its
    own AdamW update; only the order of floating-point sums differs. It runs the layers' steps as batched matrix
    products (:class:`LayerwiseMLP`): on 2 CPU cores, ~20x faster than a loop over layers.

    Parameters
    ----------
    X : torch.Tensor
        ``(N, L, D)`` hidden states (any float dtype; converted to float32 one batch at a time).
    y : torch.Tensor
        ``(N, L, H)`` log-scores.
    config : MLPConfig, optional
        Hyper-parameters; the paper's by default.
    rows : torch.Tensor, optional
        ``(n,)`` indices of the rows to fit on (all by default), never copied out of ``X``.

    Returns
    -------
    modules : list of nn.Sequential
        The ``L`` trained modules (indices 0 and 2 linear, as in the checkpoint format).
    history : dict
        ``train_loss`` and ``valid_loss`` per epoch (summed over layers; ``valid_loss`` empty without a validation
        split), and ``final_train_loss`` / ``final_valid_loss``: each layer's plain MSE on the training and
        validation pairs after training (``final_valid_loss`` None without a split).
    """
    from skorch import NeuralNetRegressor
    from skorch.callbacks import LRScheduler
    from skorch.dataset import ValidSplit
    from skorch.helper import predefined_split

    config = config or MLPConfig()
    if not 0 <= config.valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in [0, 1), got {config.valid_fraction}.")
    if config.top_weight < 0 or not 0 <= config.top_quantile < 1:
        raise ValueError(
            f"top_weight must be >= 0 and top_quantile in [0, 1), got {config.top_weight} and {config.top_quantile}."
        )
    X, y = torch.as_tensor(X), torch.as_tensor(y, dtype=torch.float32)
    if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2]:
        raise ValueError(f"Expected X (N, L, D) and y (N, L, H) with matching N and L, got {X.shape} and {y.shape}.")
    _, n_layers, d = X.shape
    y_fit = y if rows is None else y[rows]  # (n, L, H): small
    n = y_fit.shape[0]
    hidden = config.hidden_dim or max(1, d // 8)
    means = y_fit.mean(dim=0)  # (L, H)
    layers = []
    for layer in range(n_layers):
        torch.manual_seed(config.seed)  # each layer's initialisation, as if fitted alone
        module = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, y.shape[2]))
        with torch.no_grad():
            # Log-scores sit around -5: starting the output bias at the mean spares the first epochs that offset.
            module[2].bias.copy_(means[layer])
        layers.append(module)
    stacked = LayerwiseMLP(layers)
    n_fit = n - math.ceil(n * config.valid_fraction) if config.valid_fraction else n
    steps = config.max_epochs * math.ceil(n_fit / config.batch_size)
    if config.top_weight > 0:
        thresholds = torch.quantile(y_fit, config.top_quantile, dim=0)  # (L, H)
    else:
        thresholds = torch.zeros(y.shape[1:])
    dataset = _Pairs(X, y, rows)
    if config.valid_fraction:
        train, valid = ValidSplit(config.valid_fraction, random_state=config.seed)(dataset)
    else:
        train, valid = dataset, None
    net = NeuralNetRegressor(
        stacked,
        criterion=TopWeightedMSELoss,
        criterion__thresholds=thresholds,
        criterion__top_weight=config.top_weight,
        optimizer=torch.optim.AdamW,
        optimizer__weight_decay=config.weight_decay,
        lr=config.lr,
        batch_size=config.batch_size,
        max_epochs=config.max_epochs,
        iterator_train__shuffle=True,
        iterator_train__collate_fn=_batch_as_fetched,
        iterator_valid__collate_fn=_batch_as_fetched,
        train_split=predefined_split(valid) if valid is not None else None,
        callbacks=[
            # Cosine decay stepped every batch, over the whole run.
            ("cosine", LRScheduler(policy=torch.optim.lr_scheduler.CosineAnnealingLR, T_max=steps, step_every="batch")),
            ("clip", _layer_gradient_clip(config.grad_clip)),
        ],
        device="cpu",
        verbose=0,
    )
    net.fit(train, None)
    stacked = net.module_.cpu().eval()
    history = {
        "train_loss": [float(v) for v in net.history[:, "train_loss"]],
        "valid_loss": [float(v) for v in net.history[:, "valid_loss"]] if valid is not None else [],
        "final_train_loss": _layer_mse(stacked, train),
        "final_valid_loss": _layer_mse(stacked, valid) if valid is not None else [None] * n_layers,
    }
    return [stacked.layer(i) for i in range(n_layers)], history


def _layer_mse(module: LayerwiseMLP, pairs, chunk: int = 4096) -> list[float]:
    """Each layer's plain mean squared error over the pairs of ``pairs`` (a :class:`_Pairs` or a subset of one)."""
    total = None
    with torch.no_grad():
        for begin in range(0, len(pairs), chunk):
            X, y = pairs.__getitems__(list(range(begin, min(begin + chunk, len(pairs)))))
            squared = (module(X) - y).double().square().sum(dim=(0, 2))  # (L,)
            total = squared if total is None else total + squared
    count = len(pairs) * module.weight2.shape[1]
    return [float(v) / count for v in total]


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
        The MLP's training history (:func:`fit_layers_mlp`; all layers are fitted together); empty for linear.
    """
    if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2]:
        raise ValueError(f"Expected X (N, L, D) and y (N, L, H) with matching N and L, got {X.shape} and {y.shape}.")
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
    that of one fit of all layers (:func:`fit_layers_mlp`: each layer is initialised, batched, clipped and updated
    as if alone; the same validation rows), up to the order of floating-point sums.

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


def _check_scores(prediction: torch.Tensor, target: torch.Tensor) -> None:
    """Raise ValueError unless predicted and true log-scores are both ``(N, L, H)`` of one shape."""
    if prediction.shape != target.shape or prediction.ndim != 3:
        raise ValueError(
            f"prediction and target must both have shape (N, L, H), got {tuple(prediction.shape)} and "
            f"{tuple(target.shape)}."
        )


def kept_overlap(
    prediction: torch.Tensor,
    target: torch.Tensor,
    groups: torch.Tensor | None = None,
    evictions: Sequence[float] = EVICTIONS,
) -> dict:
    """How much of the oracle's kept set a surrogate keeps, at several eviction rates.

    Two rules are measured, each keeping the top ``1 - eviction`` share of the scores it ranks:

    - ``per_head``: within each group (a prompt), layer and KV head, the top share of its positions by predicted
      score against the top share by true score; ``|kept_pred & kept_true| / |kept_true|`` averaged over groups
      (each prompt weighs the same) and heads.
    - ``dms``: like one threshold per layer (the DMS rule, calibrated on these texts): the top share of all
      ``(position, head)`` pairs of the layer, pooled over groups and heads.

    A random ranking scores ``1 - eviction`` on both; the oracle itself scores 1.

    Collections hold a random sample of each prompt's positions, so the ranks are those within the sample.

    Parameters
    ----------
    prediction, target : torch.Tensor
        ``(N, L, H)`` predicted and true log-scores.
    groups : torch.Tensor, optional
        ``(N,)`` integer group (prompt index) of each row; ``None`` makes one group of all rows.
    evictions : sequence of float
        Eviction rates in ``(0, 1)``.

    Returns
    -------
    dict
        ``{"per_head": {rate: {"mean", "per_layer" [L]}}, "dms": {rate: {"mean", "per_layer" [L]}}}`` with the
        rates formatted as ``"0.5"``, ``"0.67"``, ``"0.8"``.
    """
    _check_scores(prediction, target)
    if any(not 0 < e < 1 for e in evictions):
        raise ValueError(f"evictions must lie in (0, 1), got {list(evictions)}.")
    n, n_layers, n_heads = target.shape
    if groups is None:
        groups = torch.zeros(n, dtype=torch.long)
    if groups.shape != (n,):
        raise ValueError(f"groups must have shape ({n},) (one group per row), got {tuple(groups.shape)}.")

    def top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
        """Boolean mask of the ``k`` largest values along dim 0 of ``scores``."""
        indices = scores.topk(k, dim=0).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(0, indices, True)

    def keep(count: int, eviction: float) -> int:
        return min(count, max(1, round((1 - eviction) * count)))

    result: dict[str, dict] = {"per_head": {}, "dms": {}}
    members = [torch.nonzero(groups == g).flatten() for g in torch.unique(groups)]
    for eviction in evictions:
        per_head = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        for rows in members:
            k = keep(rows.numel(), eviction)
            both = top_mask(prediction[rows].float(), k) & top_mask(target[rows].float(), k)  # (n_g, L, H)
            per_head += both.sum(dim=0).double() / k
        per_head /= len(members)
        dms = []
        for layer in range(n_layers):
            k = keep(n * n_heads, eviction)
            both = top_mask(prediction[:, layer].reshape(-1).float(), k) & top_mask(
                target[:, layer].reshape(-1).float(), k
            )
            dms.append(float(both.sum()) / k)
        key = f"{eviction:g}"
        result["per_head"][key] = {"mean": float(per_head.mean()), "per_layer": per_head.mean(dim=1).tolist()}
        result["dms"][key] = {"mean": float(np.mean(dms)), "per_layer": dms}
    return result


def top_recall(
    prediction: torch.Tensor,
    target: torch.Tensor,
    evictions: Sequence[float] = TOP_RECALL_EVICTIONS,
    shares: Sequence[float] = TOP_RECALL_SHARES,
) -> dict:
    """Share of the oracle's very top pairs that one threshold per layer keeps, at several eviction rates.

    For each layer, the ``(position, head)`` pairs of all rows are pooled (the DMS rule, as ``dms`` in
    :func:`kept_overlap`); the surrogate keeps its top ``1 - eviction`` share of them, and the recall is
    ``|kept & oracle top share| / |oracle top share|``. Where :func:`kept_overlap` asks how much of the whole kept
    set is right, this asks whether the few pairs that matter most (a needle's, say) survive. A random ranking
    scores ``1 - eviction``; the oracle scores 1 whenever ``share <= 1 - eviction``.

    Parameters
    ----------
    prediction, target : torch.Tensor
        ``(N, L, H)`` predicted and true log-scores.
    evictions : sequence of float
        Eviction rates in ``(0, 1)``.
    shares : sequence of float
        Top shares of the oracle's pairs, in ``(0, 1)``.

    Returns
    -------
    dict
        ``{eviction: {share: {"mean", "min", "per_layer" [L]}}}``, both keys formatted with ``:g`` (``"0.8"``,
        ``"0.01"``).
    """
    _check_scores(prediction, target)
    if any(not 0 < e < 1 for e in evictions) or any(not 0 < s < 1 for s in shares):
        raise ValueError(f"evictions and shares must lie in (0, 1), got {list(evictions)} and {list(shares)}.")
    n, n_layers, n_heads = target.shape
    count = n * n_heads

    def top_indices(scores: torch.Tensor, share: float) -> torch.Tensor:
        return scores.topk(min(count, max(1, round(share * count)))).indices

    recalls = {(e, s): [] for e in evictions for s in shares}
    for layer in range(n_layers):
        # Each layer's oracle top sets and kept sets, once each, then every (eviction, share) pair of them.
        oracle = {s: top_indices(target[:, layer].reshape(-1).float(), s) for s in shares}
        for eviction in evictions:
            kept = torch.zeros(count, dtype=torch.bool)
            kept[top_indices(prediction[:, layer].reshape(-1).float(), 1 - eviction)] = True
            for share in shares:
                recalls[eviction, share].append(float(kept[oracle[share]].float().mean()))
    return {
        f"{e:g}": {
            f"{s:g}": {"mean": float(np.mean(recalls[e, s])), "min": min(recalls[e, s]), "per_layer": recalls[e, s]}
            for s in shares
        }
        for e in evictions
    }


def _summary(prediction: torch.Tensor, target: torch.Tensor, groups: torch.Tensor | None) -> dict:
    """R^2 per layer and head, MSE, kept-set overlaps and top recalls of ``(N, L, H)`` predictions."""
    r2 = pearson_r2(prediction, target)  # (L, H)
    return {
        "mean_r2": float(r2.mean()),
        "per_layer": r2.mean(dim=1).tolist(),
        "per_head": r2.tolist(),
        "mse": float((prediction - target).square().mean()),
        "n_pairs": int(target.shape[0]),
        "n_prompts": None if groups is None else int(torch.unique(groups).numel()),
        "overlap": kept_overlap(prediction, target, groups),
        "top_recall": top_recall(prediction, target),
    }


@torch.no_grad()
def predict_all(surrogate, X: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
    """``(N, L, H)`` log-scores of ``surrogate`` for ``(N, L, D)`` hidden states of any float dtype, in batches.

    ``batch_size`` rows are copied to float32 at once; default: as many as fit in 256 MiB (about 3,900 rows of
    SmolLM2-135M's 30 layers; a fixed 65,536 rows took 4.5 GB).
    """
    if batch_size is None:
        batch_size = max(1024, (256 << 20) // (4 * X.shape[1] * X.shape[2]))
    return torch.cat([surrogate.forward_all(X[i : i + batch_size].float()) for i in range(0, X.shape[0], batch_size)])


@torch.no_grad()
def evaluate_surrogate(
    surrogate,
    X: torch.Tensor,
    y: torch.Tensor,
    batch_size: int | None = None,
    *,
    prompt_index: torch.Tensor | None = None,
    kinds: Sequence[str] | None = None,
) -> dict:
    """Held-out R^2 (squared Pearson) of a surrogate, per layer and KV head, kept-set overlaps, and both per kind.

    Parameters
    ----------
    surrogate : KVzapSurrogate
        Fitted surrogate.
    X : torch.Tensor
        ``(N, L, D)`` held-out hidden states.
    y : torch.Tensor
        ``(N, L, H)`` held-out log-scores.
    batch_size : int, optional
        Rows predicted at once (see :func:`predict_all`).
    prompt_index : torch.Tensor, optional
        ``(N,)`` prompt of each row: the per-head overlaps rank positions within each prompt (without it, over
        all rows).
    kinds : sequence of str, optional
        ``N`` kinds of text, one per row (see :func:`collection_kinds`): adds ``per_kind``.

    Returns
    -------
    dict
        ``mean_r2`` (over all layers and heads), ``per_layer`` ``[L]`` and ``per_head`` ``[L][H]``, ``mse``,
        ``n_pairs``, ``n_prompts``, ``overlap`` (see :func:`kept_overlap`), ``top_recall`` (see
        :func:`top_recall`) and, with ``kinds``, ``per_kind``: kind -> the same keys but ``per_head``.
    """
    predictions = predict_all(surrogate, X, batch_size)  # (N, L, H)
    y = y.float()
    result = _summary(predictions, y, prompt_index)
    if kinds is not None:
        if len(kinds) != X.shape[0]:
            raise ValueError(f"kinds must name the kind of each of the {X.shape[0]} rows, got {len(kinds)} names.")
        labels = np.asarray(kinds)
        result["per_kind"] = {}
        for kind in sorted(set(kinds)):
            rows = torch.from_numpy(np.flatnonzero(labels == kind))
            groups = None if prompt_index is None else prompt_index[rows]
            entry = _summary(predictions[rows], y[rows], groups)
            del entry["per_head"]  # per layer is enough per kind; the JSON stays readable
            result["per_kind"][kind] = entry
    return result


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


def plot_r2(results: dict[str, dict], path: str | os.PathLike, title: str = "") -> Path:
    """Plot per-layer held-out R^2 (mean over heads, with the min-max range over heads) of each surrogate.

    Parameters
    ----------
    results : dict
        Surrogate name -> the dict returned by :func:`evaluate_surrogate`.
    path : str or PathLike
        PNG file to write.
    title : str
        Figure title.

    Returns
    -------
    Path
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, result in results.items():
        per_head = np.asarray(result["per_head"])  # (L, H)
        layers = np.arange(per_head.shape[0])
        ax.plot(layers, per_head.mean(axis=1), marker="o", ms=3, label=f"{name} (mean {result['mean_r2']:.3f})")
        ax.fill_between(layers, per_head.min(axis=1), per_head.max(axis=1), alpha=0.2)
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out R$^2$ (squared Pearson)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bar_styles(names: Sequence[str], evictions: Sequence[float | None]) -> dict[tuple, dict]:
    """Colour and opacity of each ``(surrogate, eviction)`` bar series: one colour per surrogate (matplotlib's
    ``tab10`` cycle, then ``tab20``), lighter at higher eviction rates, so the series of several surrogates stay
    apart (a single colour cycle over every series repeated colours from the fourth surrogate on)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    alphas = np.linspace(1.0, 0.4, len(evictions)) if len(evictions) > 1 else [1.0]
    return {
        (name, eviction): {"color": cmap(i % cmap.N), "alpha": float(alpha)}
        for i, name in enumerate(names)
        for eviction, alpha in zip(evictions, alphas, strict=True)
    }


def plot_kinds(results: dict[str, dict], path: str | os.PathLike, title: str = "") -> Path:
    """Bar charts per kind of text: R^2, then the DMS-like and per-head kept-set overlaps at each eviction rate.

    Parameters
    ----------
    results : dict
        Surrogate name -> a dict with ``per_kind`` (see :func:`evaluate_surrogate`).
    path : str or PathLike
        PNG file to write.
    title : str
        Figure title.

    Returns
    -------
    Path
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    names = [name for name, result in results.items() if result.get("per_kind")]
    if not names:
        raise ValueError("results hold no `per_kind` entry to plot; evaluate with the kinds of the rows.")
    kinds = sorted({kind for name in names for kind in results[name]["per_kind"]})
    x = np.arange(len(kinds))
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.1 * len(kinds)) + 2.5, 10), sharex=True)
    panels = [
        ("R$^2$ (squared Pearson)", None),
        ("kept-set overlap, DMS-like", "dms"),
        ("overlap, per head", "per_head"),
    ]
    for ax, (label, rule) in zip(axes, panels, strict=True):
        rates = [None] if rule is None else list(EVICTIONS)
        series = [(name, eviction) for name in names for eviction in rates]
        styles = _bar_styles(names, rates)
        width = 0.8 / len(series)
        for i, (name, eviction) in enumerate(series):
            values = []
            for kind in kinds:
                entry = results[name]["per_kind"].get(kind)
                if entry is None:
                    values.append(np.nan)
                elif rule is None:
                    values.append(entry["mean_r2"])
                else:
                    values.append(entry["overlap"][rule][f"{eviction:g}"]["mean"])
            legend = name if eviction is None else f"{name}, {eviction:.0%} evicted"
            style = styles[name, eviction]
            ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=legend, **style)
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
        if rule is not None:  # a random ranking keeps 1 - eviction of the oracle's set
            for eviction in EVICTIONS:
                ax.axhline(1 - eviction, color="grey", lw=0.6, ls=":")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[-1].set_xticks(x, kinds, rotation=30, ha="right")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    for model_type in model_types:
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_types must be drawn from {MODEL_TYPES}, got {model_type!r}.")
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


def fit_and_save(
    train_dir: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    test_dir: str | os.PathLike | None = None,
    model_types: tuple[str, ...] = MODEL_TYPES,
    mlp_config: MLPConfig | None = None,
    layers_at_once: int | None = None,
) -> dict:
    """Fit surrogates on a collection, save them, and evaluate them on a held-out collection.

    Writes ``out_dir/<model_type>/`` (``KVzapSurrogate.save_pretrained``), ``out_dir/r2.json`` and
    ``out_dir/r2.png`` (the latter two only with ``test_dir``). When ``test_dir`` holds ``prompts.jsonl``, the
    report also has R^2 and kept-set overlaps per kind of text, plotted in ``out_dir/kinds.png``.

    Parameters
    ----------
    train_dir : str or PathLike, or a sequence of them
        Collection(s) (see :func:`train.collect.collect`) to fit on; several are concatenated (e.g. runs with
        different seeds).
    out_dir : str or PathLike
        Output folder.
    test_dir : str or PathLike, optional
        Held-out collection for R^2.
    model_types : tuple of str
        Surrogates to fit.
    mlp_config : MLPConfig, optional
        MLP hyper-parameters.
    layers_at_once : int, optional
        Read and fit this many layers at a time (:func:`fit_by_layer_groups`: the same training, memory in
        proportion); all layers at once by default.

    Returns
    -------
    dict
        The report written to ``r2.json`` (settings, sizes, R^2 per surrogate).
    """
    from .collect import load_collection

    for model_type in model_types:
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_types must be drawn from {MODEL_TYPES}, got {model_type!r}.")
    mlp_config = mlp_config or MLPConfig()
    out_dir = Path(out_dir)
    train_dirs = [train_dir] if isinstance(train_dir, (str, os.PathLike)) else list(train_dir)
    if not train_dirs:
        raise ValueError("train_dir must name at least one collection.")
    # One group of every layer by default; with layers_at_once, never all layers in memory.
    fitted, histories, extras = fit_by_layer_groups(train_dirs, model_types, layers_at_once, mlp_config)
    manifests, n_pairs = extras["manifests"], extras["n_pairs"]
    manifest = {**manifests[0], "n_prompts": sum(m["n_prompts"] for m in manifests)}
    test = load_collection(test_dir) if test_dir is not None else None
    test_kinds = None
    if test is not None and (Path(test_dir) / "prompts.jsonl").exists():
        test_kinds = collection_kinds(test_dir, test[2]["prompt_index"])
    report = {
        "model": manifest.get("model"),
        "train_dirs": [str(d) for d in train_dirs],
        "test_dir": None if test_dir is None else str(test_dir),
        "n_train_pairs": n_pairs,
        "n_train_prompts": manifest.get("n_prompts"),
        "n_test_pairs": None if test is None else int(test[0].shape[0]),
        "n_test_prompts": None if test is None else test[2].get("n_prompts"),
        "mlp_config": asdict(mlp_config),
        "layers_at_once": layers_at_once,
        "surrogates": {},
    }
    for model_type in model_types:
        surrogate, history = fitted[model_type], histories[model_type]
        surrogate.save_pretrained(out_dir / model_type)
        entry = {"fit_seconds": round(extras[model_type]["fit_seconds"], 1), "path": str(out_dir / model_type)}
        if model_type == "mlp":
            entry["final_train_loss"] = history["final_train_loss"]  # each layer's MSE after training
            entry["final_valid_loss"] = history["final_valid_loss"]
        if test is not None:
            entry.update(
                evaluate_surrogate(surrogate, test[0], test[1], prompt_index=test[2]["prompt_index"], kinds=test_kinds)
            )
            entry["train_r2"] = extras[model_type]["train_r2"]
            logger.info("%s: held-out mean R^2 %.3f (train %.3f)", model_type, entry["mean_r2"], entry["train_r2"])
        report["surrogates"][model_type] = entry
    out_dir.mkdir(parents=True, exist_ok=True)
    if test is not None:
        (out_dir / "r2.json").write_text(json.dumps(report, indent=2))
        title = f"KVzap surrogates of {Path(str(report['model'])).name}"
        plot_r2(report["surrogates"], out_dir / "r2.png", title=title)
        if test_kinds is not None:
            plot_kinds(report["surrogates"], out_dir / "kinds.png", title=title)
    else:
        (out_dir / "fit.json").write_text(json.dumps(report, indent=2))
    return report
