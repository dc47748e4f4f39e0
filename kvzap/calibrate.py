"""Threshold calibration: which threshold gives a target compression ratio on sample texts.

The threshold -> compression mapping depends on the model and its surrogate (the paper's tau in {-6..-3} for
Qwen3-8B does not carry over to other models). With dense prefill and no decoding-time pruning, a pair is
evicted iff it lies outside the final window and its score is below the threshold, so one forward per text
records every score and the whole curve follows without running the press again.

Only the layers the press prunes are calibrated (:mod:`kvzap.layers`): by default the sliding-window layers are
left out, as the press leaves them alone. With ``prune_sliding_layers=True`` they are counted the way the press
counts them: a pair that slid out of the layer's stored window before the press decided cannot be evicted (its
recorded score is ``+inf``), yet it counts among the pairs seen, as in ``press.compression_ratio``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvzap import _compat
from kvzap.cache import PrunableLayer
from kvzap.layers import describe
from kvzap.presses.base import BasePress, Scorer, check_number, check_scores
from kvzap.prompts import context_ids

logger = logging.getLogger(__name__)

__all__ = ["collect_scores", "compression_curve", "calibrate"]


@dataclass
class _ScoreRecorder(BasePress):
    """Records the scorer's prefill scores of every layer; evicts nothing."""

    scorer: Scorer = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.scores: dict[int, torch.Tensor] = {}

    def setup(self, model) -> None:
        self.scorer.setup(model)

    def process_layer(self, module: nn.Module, layer: PrunableLayer, hidden_states: torch.Tensor, prefill: bool):
        if not prefill:
            return False
        keys, q_len = layer.last_keys, hidden_states.shape[1]
        scores = self.scorer.score_new_pairs(module, layer, hidden_states)
        scores = check_scores(scores, self.scorer, module, (keys.shape[0], keys.shape[1], q_len))  # (B, H, T)
        scores = scores[0].float().cpu()  # (H, T)
        if isinstance(layer, _compat.DynamicSlidingWindowLayer):
            # The press's evict ignores positions no longer stored (slid out of the window during this forward).
            first_stored = layer.seen - layer.keys.shape[-2]
            scores[:, : max(first_stored - (layer.seen - scores.shape[-1]), 0)] = float("inf")
        self.scores[_compat.layer_index(module)] = scores
        return True


@torch.no_grad()
def collect_scores(
    model: PreTrainedModel,
    tokenizer,
    scorer: Scorer,
    texts: Sequence[str],
    max_tokens: int | None = None,
    *,
    prune_sliding_layers: bool = False,
) -> list[list[torch.Tensor]]:
    """Prefill scores of each text: ``result[text][j]`` is ``(kv_heads, tokens)`` for the ``j``-th layer the
    press prunes (:func:`kvzap.layers.prunable_layers`); ``+inf`` where the press cannot evict (see the module
    docstring).

    Raises
    ------
    ValueError
        When the model has no layer to prune (every layer uses a sliding window and ``prune_sliding_layers`` is
        False).
    """
    _check_objects(model, tokenizer, scorer)
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise ValueError("texts must be a non-empty list of strings.")
    wrong = sorted({type(t).__name__ for t in texts if not isinstance(t, str)})
    if wrong:
        raise TypeError(f"texts must hold strings only, got {', '.join(wrong)}.")
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise ValueError(f"texts {empty} are empty: there is nothing to calibrate on; pass texts with content.")
    max_tokens = check_number("max_tokens", max_tokens, integer=True, allow_none=True, minimum=1)
    recorder = _ScoreRecorder(scorer=scorer, prune_sliding_layers=prune_sliding_layers)
    result = []
    for text in tqdm(texts, desc="calibration texts", unit="text"):
        # The context as the pipeline prefills it (chat turn, BOS rule of kvzap.prompts): the scores the press sees.
        ids = torch.tensor([context_ids(tokenizer, text)[0][:max_tokens]], device=model.device)  # (1, T)
        recorder.scores = {}
        with recorder(model):
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        if not recorder.scores:
            raise ValueError(
                f"Nothing to calibrate: {describe(model)}, and a press leaves sliding-window layers alone by "
                "default (their memory is bounded already). Pass prune_sliding_layers=True (`kvzap calibrate "
                "--prune-sliding-layers`) to calibrate them, for a press built with prune_sliding_layers=True."
            )
        result.append([recorder.scores[i] for i in sorted(recorder.scores)])
    return result


def _check_objects(model, tokenizer, scorer) -> None:
    """Refuse a missing model, tokenizer or scorer before anything runs."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model must be a transformers PreTrainedModel (e.g. from kvzap.models.load_model()), got "
            f"{type(model).__name__}."
        )
    if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer must be the model's tokenizer (e.g. the second value of kvzap.models.load_model()), got "
            f"{type(tokenizer).__name__}."
        )
    if not isinstance(scorer, Scorer):
        raise TypeError(f"scorer must be a kvzap Scorer (e.g. KVzapScorer()), got {type(scorer).__name__}.")


def _check_scores_list(scores) -> None:
    """Refuse ``scores`` that are not :func:`collect_scores`'s output: texts of layers of ``(kv_heads, tokens)``."""
    if not isinstance(scores, (list, tuple)) or not scores:
        raise ValueError(
            "scores must be the non-empty output of collect_scores: one list of (kv_heads, tokens) tensors per text."
        )
    for i, layers in enumerate(scores):
        if not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError(f"scores[{i}] must be a non-empty list of (kv_heads, tokens) tensors, one per layer.")
        for j, layer in enumerate(layers):
            if not isinstance(layer, torch.Tensor) or layer.dim() != 2:
                raise ValueError(
                    f"scores[{i}][{j}] must be a (kv_heads, tokens) tensor, got "
                    f"{tuple(layer.shape) if isinstance(layer, torch.Tensor) else type(layer).__name__}."
                )
            if layer.shape[-1] != layers[0].shape[-1]:
                raise ValueError(
                    f"scores[{i}] holds layers of {layers[0].shape[-1]} and {layer.shape[-1]} tokens: every layer of "
                    "a text scores the same tokens."
                )


def compression_curve(
    scores: list[list[torch.Tensor]], thresholds: Sequence[float] | torch.Tensor, sliding_window_size: int = 128
) -> torch.Tensor:
    """Mean compression ratio (over texts, layers and heads, as ``press.compression_ratio``) per threshold.

    ``scores`` as :func:`collect_scores` returns them (``+inf`` marks pairs the press cannot evict).

    Returns
    -------
    Tensor ``(len(thresholds),)``.
    """
    sliding_window_size = check_number("sliding_window_size", sliding_window_size, integer=True, minimum=0)
    _check_scores_list(scores)
    if isinstance(thresholds, (str, bytes)):
        raise TypeError("thresholds must be a list of numbers (or a 1-D tensor), got a string.")
    try:
        thresholds = torch.as_tensor(thresholds, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"thresholds must be a list of numbers (or a 1-D tensor): {error}") from error
    if thresholds.dim() != 1:
        raise ValueError(f"thresholds must be 1-D (one threshold per entry), got shape {tuple(thresholds.shape)}.")
    if bool(torch.isnan(thresholds).any()):
        raise ValueError("thresholds holds NaN: a NaN threshold evicts nothing; pass numbers (or -inf).")
    per_text = []
    for layers in scores:
        n_tokens = layers[0].shape[-1]
        outside = max(n_tokens - sliding_window_size, 0)  # the window is never evicted
        ratios = []
        for layer_scores in layers:
            candidates = layer_scores[:, :outside].reshape(-1)  # (H * outside,)
            # evicted share for every threshold at once: count of candidate scores strictly below it
            counts = torch.searchsorted(candidates.sort().values, thresholds, side="left")
            ratios.append(counts.float() / layer_scores.numel())
        per_text.append(torch.stack(ratios).mean(0))
    return torch.stack(per_text).mean(0)


def calibrate(
    model: PreTrainedModel,
    tokenizer,
    scorer: Scorer,
    texts: Sequence[str],
    target_compression: float,
    *,
    sliding_window_size: int = 128,
    max_tokens: int | None = None,
    scores: list[list[torch.Tensor]] | None = None,
    prune_sliding_layers: bool = False,
) -> float:
    """The smallest threshold whose mean prefill compression ratio on ``texts`` reaches ``target_compression``.

    Parameters
    ----------
    target_compression : share of KV pairs to evict, in [0, 1). Ratios above the share of pairs outside the
        sliding window cannot be reached: the threshold evicting every candidate is returned, with a warning.
    scores : reuse the output of :func:`collect_scores` to calibrate several targets without new forwards.
    prune_sliding_layers : calibrate for a press with the same option (ignored when ``scores`` is given: pass it
        to :func:`collect_scores`).

    Returns
    -------
    float: use it as ``DMSThresholdPress(scorer, threshold=..., sliding_window_size=...)``.
    """
    if isinstance(target_compression, bool) or not isinstance(target_compression, (int, float)):
        raise TypeError(f"target_compression must be a number in [0, 1), got {type(target_compression).__name__}.")
    if not 0 <= target_compression < 1:
        raise ValueError(f"target_compression must be in [0, 1), got {target_compression!r}.")
    sliding_window_size = check_number("sliding_window_size", sliding_window_size, integer=True, minimum=0)
    if scores is None:
        scores = collect_scores(model, tokenizer, scorer, texts, max_tokens, prune_sliding_layers=prune_sliding_layers)
    _check_scores_list(scores)
    # Only the pairs outside the window can be evicted: the threshold is calibrated on their scores.
    candidates = [s[:, : max(layers[0].shape[-1] - sliding_window_size, 0)] for layers in scores for s in layers]
    if not any(c.numel() for c in candidates):
        raise ValueError(
            f"Nothing to calibrate: no text is longer than the sliding window ({sliding_window_size} tokens), so "
            "the press would evict nothing whatever the threshold. Pass longer texts, or a smaller "
            "sliding_window_size (the one the press will use)."
        )
    # The curve is non-decreasing in the threshold: bisect between the lowest and highest evictable score.
    values = torch.cat([s.reshape(-1) for layers in scores for s in layers])
    values = values[values != float("inf")]
    if values.numel() == 0:
        raise ValueError("scores holds no score: pass the output of collect_scores on non-empty texts.")
    if bool(torch.isnan(values).any()):
        # NaN would make the bisection's bounds NaN and the returned threshold NaN.
        raise ValueError("scores holds NaN values: the scorer's weights are broken; calibrate with an intact scorer.")
    evictable = torch.cat([c.reshape(-1) for c in candidates])
    evictable = evictable[evictable != float("inf")]
    if evictable.numel() and bool((evictable == evictable[0]).all()) and 0 < target_compression:
        raise ValueError(
            f"Every score outside the window is the same ({float(evictable[0])!r}): no threshold evicts a share "
            "between none and all of them, so no target in between can be calibrated. Use a scorer that ranks "
            "the pairs (e.g. KVzapScorer), not a constant one."
        )
    lo, hi = float(values.min()), float(values.max()) + 1e-6
    reachable = float(compression_curve(scores, [hi], sliding_window_size)[0])
    if target_compression >= reachable:
        logger.warning(
            "A compression ratio of %.3f is out of reach with a window of %d tokens on these texts (max %.3f).",
            target_compression,
            sliding_window_size,
            reachable,
        )
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if float(compression_curve(scores, [mid], sliding_window_size)[0]) < target_compression:
            lo = mid
        else:
            hi = mid
    return hi
