"""How well predicted log-scores match the oracle's: R^2, kept-set overlaps and top recalls, per kind of text.

Quality is the paper's R^2 (:func:`pearson_r2`): the squared Pearson correlation between predicted and true
log-scores, per layer and KV head, on held-out prompts. R^2 over all pairs is not what a threshold sees: at high
compression only the top of the score distribution survives. :func:`kept_overlap` measures how much of the
oracle's kept set the surrogate keeps at 50%, 67% and 80% eviction, per head (top share of each prompt, layer and
head) and DMS-like (one threshold per layer over all heads and prompts), and :func:`top_recall` how many of the
oracle's very top pairs (top 1% and 5% of each layer) survive 80% and 90% eviction under one threshold per layer.
:func:`evaluate_surrogate` reports all of them, over all rows and per kind of text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

EVICTIONS = (0.5, 0.67, 0.8)

TOP_RECALL_EVICTIONS = (0.8, 0.9)

TOP_RECALL_SHARES = (0.01, 0.05)

__all__ = [
    "EVICTIONS",
    "TOP_RECALL_EVICTIONS",
    "TOP_RECALL_SHARES",
    "evaluate_surrogate",
    "kept_overlap",
    "pearson_r2",
    "predict_all",
    "top_recall",
]


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
        ``N`` kinds of text, one per row (see :func:`train.kinds.collection_kinds`): adds ``per_kind``.

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
