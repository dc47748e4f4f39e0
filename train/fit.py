"""Fit KVzap surrogates (one model per layer) on collected (hidden state, log KVzip+ score) pairs.

- KVzap-Linear: scikit-learn ``Ridge()`` with its defaults (closed form), one multi-output fit per layer.
- KVzap-MLP: ``Linear(D, D/8) -> GELU -> Linear(D/8, H)`` trained with skorch: MSE, AdamW (lr 5e-3), batch 512,
  15 epochs, cosine learning-rate schedule (per batch), gradient clipping at 1.0 and a 5% validation split.

The fitted layers are copied into a :class:`kvzap.surrogates.KVzapSurrogate` and written with
``save_pretrained`` (the published ``nvidia/KVzap-*`` format). Quality is the paper's R^2: the squared Pearson
correlation between predicted and true log-scores, per layer and KV head, on held-out prompts.
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

__all__ = [
    "MLPConfig",
    "MODEL_TYPES",
    "fit_layer_linear",
    "fit_layer_mlp",
    "fit_surrogate",
    "pearson_r2",
    "evaluate_surrogate",
    "plot_r2",
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
    """

    hidden_dim: int | None = None
    lr: float = 5e-3
    batch_size: int = 512
    max_epochs: int = 15
    grad_clip: float = 1.0
    valid_fraction: float = 0.05
    weight_decay: float = 0.01
    seed: int = 0


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
    """Train ``Linear(D, hidden) -> GELU -> Linear(hidden, H)`` with skorch.

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
    from skorch import NeuralNetRegressor
    from skorch.callbacks import GradientNormClipping, LRScheduler
    from skorch.dataset import ValidSplit

    config = config or MLPConfig()
    if not 0 <= config.valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in [0, 1), got {config.valid_fraction}.")
    n, d = X.shape
    hidden = config.hidden_dim or max(1, d // 8)
    torch.manual_seed(config.seed)
    module = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, y.shape[1]))
    with torch.no_grad():
        # Log-scores sit around -5: starting the output bias at the mean spares the first epochs that offset.
        module[2].bias.copy_(torch.from_numpy(y.mean(axis=0)))
    n_fit = n - math.ceil(n * config.valid_fraction) if config.valid_fraction else n
    steps = config.max_epochs * math.ceil(n_fit / config.batch_size)
    net = NeuralNetRegressor(
        module,
        criterion=nn.MSELoss,
        optimizer=torch.optim.AdamW,
        optimizer__weight_decay=config.weight_decay,
        lr=config.lr,
        batch_size=config.batch_size,
        max_epochs=config.max_epochs,
        iterator_train__shuffle=True,
        train_split=ValidSplit(config.valid_fraction, random_state=config.seed) if config.valid_fraction else None,
        callbacks=[
            # Cosine decay stepped every batch, over the whole run.
            ("cosine", LRScheduler(policy=torch.optim.lr_scheduler.CosineAnnealingLR, T_max=steps, step_every="batch")),
            ("clip", GradientNormClipping(gradient_clip_value=config.grad_clip)),
        ],
        device="cpu",
        verbose=0,
    )
    net.fit(X, y)
    history = {
        "train_loss": [float(v) for v in net.history[:, "train_loss"]],
        "valid_loss": [float(v) for v in net.history[:, "valid_loss"]] if config.valid_fraction else [],
    }
    return net.module_.cpu().eval(), history


def _layer_arrays(X: torch.Tensor, y: torch.Tensor, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 numpy views of one layer: ``(N, D)`` and ``(N, H)``."""
    return X[:, layer].float().numpy(), y[:, layer].float().numpy()


def fit_surrogate(
    X: torch.Tensor,
    y: torch.Tensor,
    model_type: str,
    *,
    mlp_config: MLPConfig | None = None,
):
    """Fit one surrogate module per layer.

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

    Returns
    -------
    surrogate : KVzapSurrogate
        With ``n_modules = L``, ``input_dim = D``, ``output_dim = H``.
    history : list of dict
        Per-layer training history (empty dicts for linear).
    """
    from tqdm.auto import tqdm

    from kvzap.surrogates import KVzapSurrogate

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}.")
    if X.ndim != 3 or y.ndim != 3 or X.shape[:2] != y.shape[:2]:
        raise ValueError(f"Expected X (N, L, D) and y (N, L, H) with matching N and L, got {X.shape} and {y.shape}.")
    n, n_layers, d = X.shape
    n_heads = y.shape[2]
    mlp_config = mlp_config or MLPConfig()
    hidden = None if model_type == "linear" else (mlp_config.hidden_dim or max(1, d // 8))
    surrogate = KVzapSurrogate(input_dim=d, output_dim=n_heads, n_modules=n_layers, hidden_dim=hidden)
    histories = []
    for layer in tqdm(range(n_layers), desc=f"fit {model_type}", unit="layer", disable=None):
        X_l, y_l = _layer_arrays(X, y, layer)
        start = time.perf_counter()
        if model_type == "linear":
            fitted, history = fit_layer_linear(X_l, y_l), {}
        else:
            fitted, history = fit_layer_mlp(X_l, y_l, mlp_config)
        surrogate.layers[layer].load_state_dict(fitted.state_dict())
        histories.append(history)
        logger.debug("Layer %d (%s) fitted on %d pairs in %.1f s", layer, model_type, n, time.perf_counter() - start)
    return surrogate.eval(), histories


@torch.no_grad()
def evaluate_surrogate(surrogate, X: torch.Tensor, y: torch.Tensor, batch_size: int = 65536) -> dict:
    """Held-out R^2 (squared Pearson) of a surrogate, per layer and KV head.

    Parameters
    ----------
    surrogate : KVzapSurrogate
        Fitted surrogate.
    X : torch.Tensor
        ``(N, L, D)`` held-out hidden states.
    y : torch.Tensor
        ``(N, L, H)`` held-out log-scores.
    batch_size : int
        Rows predicted at once (bounds memory).

    Returns
    -------
    dict
        ``mean_r2`` (over all layers and heads), ``per_layer`` ``[L]`` and ``per_head`` ``[L][H]``, ``mse``.
    """
    predictions = torch.cat(
        [surrogate.forward_all(X[i : i + batch_size].float()) for i in range(0, X.shape[0], batch_size)]
    )  # (N, L, H)
    r2 = pearson_r2(predictions, y.float())  # (L, H)
    return {
        "mean_r2": float(r2.mean()),
        "per_layer": r2.mean(dim=1).tolist(),
        "per_head": r2.tolist(),
        "mse": float((predictions - y.float()).square().mean()),
        "n_pairs": int(X.shape[0]),
    }


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


def fit_and_save(
    train_dir: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    test_dir: str | os.PathLike | None = None,
    model_types: tuple[str, ...] = MODEL_TYPES,
    mlp_config: MLPConfig | None = None,
) -> dict:
    """Fit surrogates on a collection, save them, and evaluate them on a held-out collection.

    Writes ``out_dir/<model_type>/`` (``KVzapSurrogate.save_pretrained``), ``out_dir/r2.json`` and
    ``out_dir/r2.png`` (the latter two only with ``test_dir``).

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
    parts = [load_collection(d) for d in train_dirs]
    if len({(p[2]["model"], p[2]["n_layers"], p[2]["hidden_size"], p[2]["kv_heads"]) for p in parts}) > 1:
        raise ValueError(f"The collections {[str(d) for d in train_dirs]} come from different models.")
    X = torch.cat([p[0] for p in parts])  # (N, L, D)
    y = torch.cat([p[1] for p in parts])  # (N, L, H)
    manifest = {**parts[0][2], "n_prompts": sum(p[2]["n_prompts"] for p in parts)}
    logger.info("Training pairs: X %s, y %s from %s", tuple(X.shape), tuple(y.shape), ", ".join(map(str, train_dirs)))
    test = load_collection(test_dir) if test_dir is not None else None
    report = {
        "model": manifest.get("model"),
        "train_dirs": [str(d) for d in train_dirs],
        "test_dir": None if test_dir is None else str(test_dir),
        "n_train_pairs": int(X.shape[0]),
        "n_train_prompts": manifest.get("n_prompts"),
        "n_test_pairs": None if test is None else int(test[0].shape[0]),
        "n_test_prompts": None if test is None else test[2].get("n_prompts"),
        "mlp_config": asdict(mlp_config),
        "surrogates": {},
    }
    for model_type in model_types:
        start = time.perf_counter()
        surrogate, history = fit_surrogate(X, y, model_type, mlp_config=mlp_config)
        surrogate.save_pretrained(out_dir / model_type)
        entry = {"fit_seconds": round(time.perf_counter() - start, 1), "path": str(out_dir / model_type)}
        if model_type == "mlp":
            entry["final_train_loss"] = [h["train_loss"][-1] for h in history]
            entry["final_valid_loss"] = [h["valid_loss"][-1] if h["valid_loss"] else None for h in history]
        if test is not None:
            entry.update(evaluate_surrogate(surrogate, test[0], test[1]))
            entry["train_r2"] = evaluate_surrogate(surrogate, X, y)["mean_r2"]
            logger.info("%s: held-out mean R^2 %.3f (train %.3f)", model_type, entry["mean_r2"], entry["train_r2"])
        report["surrogates"][model_type] = entry
    out_dir.mkdir(parents=True, exist_ok=True)
    if test is not None:
        (out_dir / "r2.json").write_text(json.dumps(report, indent=2))
        plot_r2(
            report["surrogates"], out_dir / "r2.png", title=f"KVzap surrogates of {Path(str(report['model'])).name}"
        )
    else:
        (out_dir / "fit.json").write_text(json.dumps(report, indent=2))
    return report
