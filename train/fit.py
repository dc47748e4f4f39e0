"""Fit KVzap surrogates (one model per layer) on collected (hidden state, log KVzip+ score) pairs, save them and
report their held-out quality: :func:`fit_and_save`, the job behind ``python -m train fit``.

- KVzap-Linear: scikit-learn ``Ridge()`` with its defaults (closed form), one multi-output fit per layer.
- KVzap-MLP: ``Linear(D, D/8) -> GELU -> Linear(D/8, H)`` trained with skorch: MSE, AdamW (lr 5e-3), batch 512,
  15 epochs, cosine learning-rate schedule (per batch), gradient clipping at 1.0 and a 5% validation split. All
  layers train in one fit (:func:`fit_layers_mlp`), each exactly as if it were fitted alone.

The fitted layers are copied into a :class:`kvzap.surrogates.KVzapSurrogate` and written with
``save_pretrained`` (the published ``nvidia/KVzap-*`` format). Quality is the paper's R^2 (squared Pearson
correlation per layer and KV head on held-out prompts), with kept-set overlaps and top recalls, per **kind** of
text (see :mod:`train.corpus`) of the held-out prompts.

The parts live apart, each importable from here as well:

- :mod:`train.mlp`: KVzap-MLP training (:class:`MLPConfig`, :func:`fit_layers_mlp`).
- :mod:`train.surrogate`: a surrogate per model type from tensors (:func:`fit_surrogate`) or from collections
  read a group of layers at a time (:func:`fit_by_layer_groups`).
- :mod:`train.metrics`: R^2, :func:`kept_overlap`, :func:`top_recall` and :func:`evaluate_surrogate`.
- :mod:`train.kinds`: kinds of the rows, :func:`evaluate_saved` and :func:`leave_kinds_out`.
- :mod:`train.plots`: :func:`plot_r2` and :func:`plot_kinds`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .kinds import collection_kinds, evaluate_saved, leave_kinds_out
from .metrics import (
    EVICTIONS,
    TOP_RECALL_EVICTIONS,
    TOP_RECALL_SHARES,
    evaluate_surrogate,
    kept_overlap,
    pearson_r2,
    predict_all,
    top_recall,
)
from .mlp import LayerwiseMLP, MLPConfig, TopWeightedMSELoss, fit_layer_mlp, fit_layers_mlp
from .plots import plot_kinds, plot_r2
from .surrogate import MODEL_TYPES, check_model_types, fit_by_layer_groups, fit_layer_linear, fit_surrogate

logger = logging.getLogger(__name__)

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
    "fit_and_save",
    "fit_by_layer_groups",
    "fit_layer_linear",
    "fit_layer_mlp",
    "fit_layers_mlp",
    "fit_surrogate",
    "kept_overlap",
    "leave_kinds_out",
    "pearson_r2",
    "plot_kinds",
    "plot_r2",
    "predict_all",
    "top_recall",
]


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

    check_model_types(model_types)
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
