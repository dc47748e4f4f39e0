"""KVzap-MLP training: ``Linear(D, D/8) -> GELU -> Linear(D/8, H)`` per layer, fitted with skorch.

The paper's recipe (:class:`MLPConfig`): MSE, AdamW (lr 5e-3), batch 512, 15 epochs, cosine learning-rate
schedule (per batch), gradient clipping at 1.0 and a 5% validation split. All layers train in one fit
(:func:`fit_layers_mlp`, run as batched matrix products by :class:`LayerwiseMLP`), each exactly as if it were
fitted alone. ``MLPConfig.top_weight`` optionally weights the loss of the pairs above a per-head quantile of the
targets (:class:`TopWeightedMSELoss`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["LayerwiseMLP", "MLPConfig", "TopWeightedMSELoss", "check_pairs", "fit_layer_mlp", "fit_layers_mlp"]


def check_pairs(X: torch.Tensor, y: torch.Tensor) -> None:
    """Raise ValueError unless ``X`` is ``(N, L, D)`` hidden states and ``y`` ``(N, L, H)`` log-scores of the same
    rows and layers."""
    if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2]:
        raise ValueError(f"Expected X (N, L, D) and y (N, L, H) with matching N and L, got {X.shape} and {y.shape}.")


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
    check_pairs(X, y)
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
