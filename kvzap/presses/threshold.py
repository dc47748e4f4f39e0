"""The DMS threshold rule: where a token's fate is decided.

KVzap follows the inference strategy of Dynamic Memory Sparsification (arXiv 2506.05345): every new pair is
scored as it enters the cache; the most recent ``sliding_window_size`` tokens are always kept; when a token
leaves that window its pair is evicted if its score is strictly below ``threshold``, and the decision is never
revisited. In prefill the whole prompt is scored at once and evicted after that forward's attention (dense
prefill); with ``decoding=True`` the scores of generated (and question) tokens wait in a buffer until they
leave the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvzap.cache import PrunableLayer
from kvzap.presses.base import BasePress, Scorer

__all__ = ["DMSThresholdPress"]


@dataclass
class DMSThresholdPress(BasePress):
    """Evict KV pairs whose score is below a threshold once they leave a sliding window.

    Parameters
    ----------
    scorer : Scorer
        Gives each new pair a score (e.g. :class:`~kvzap.KVzapScorer`, a predicted log KVzip+ score).
    threshold : float
        Pairs with ``score < threshold`` are evicted. ``-inf`` evicts nothing. Higher = more compression.
    sliding_window_size : int, default 128
        Number of most recent tokens that are always kept.
    decoding : bool, default False
        Also prune tokens processed after the prefill (questions, generated tokens).

    The compression ratio is an outcome, not an input: read :attr:`compression_ratio` (and the per-layer,
    per-head and per-sample ratios) after a forward pass.
    """

    scorer: Scorer = None  # type: ignore[assignment]
    threshold: float | None = None
    sliding_window_size: int = 128
    decoding: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name, value) -> None:
        # `press.decoding = True` after construction must be checked as strictly as the constructor.
        if name == "decoding" and value and "scorer" in self.__dict__:
            self._check_decoding(self.scorer)
        super().__setattr__(name, value)

    @staticmethod
    def _check_decoding(scorer: Scorer) -> None:
        if not scorer.supports_decoding:
            raise ValueError(
                f"{type(scorer).__name__} cannot score tokens one at a time, so it cannot prune during decoding: "
                "use decoding=False."
            )

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.scorer, Scorer):
            raise TypeError(
                f"scorer must be a kvzap Scorer (e.g. KVzapScorer(model_type='mlp')), got {type(self.scorer).__name__}."
            )
        if self.threshold is None:
            raise ValueError("threshold is required, e.g. DMSThresholdPress(KVzapScorer(), threshold=-4).")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise TypeError(f"threshold must be a number, got {type(self.threshold).__name__}.")
        if math.isnan(self.threshold):
            raise ValueError("threshold is NaN; use a finite number, or -inf to evict nothing.")
        if isinstance(self.sliding_window_size, bool) or not isinstance(self.sliding_window_size, int):
            raise TypeError(f"sliding_window_size must be an int, got {type(self.sliding_window_size).__name__}.")
        if self.sliding_window_size < 0:
            raise ValueError(f"sliding_window_size must be >= 0, got {self.sliding_window_size}.")
        if self.decoding:
            self._check_decoding(self.scorer)

    @property
    def prunes_during_decoding(self) -> bool:
        return bool(self.decoding)

    def setup(self, model) -> None:
        self.scorer.setup(model)

    def process_layer(self, module: nn.Module, layer: PrunableLayer, hidden_states: torch.Tensor, prefill: bool):
        if not (prefill or self.decoding):
            return False  # decoding-time pruning is off: the window tokens of the prefill stay kept
        q_len = hidden_states.shape[1]
        scores = self.scorer.score_new_pairs(module, layer, hidden_states)  # (B, H, q)

        state = layer.press_state
        pending, start = state.get("pending"), state.get("pending_start")
        if pending is None or start + pending.shape[-1] != layer.seen - q_len:
            # A new sequence (its layer state is empty), or tokens went by unscored (decoding was off): those
            # stay kept, and the buffer restarts with this forward's tokens.
            pending, start = scores, layer.seen - q_len
        else:
            pending = torch.cat([pending, scores], dim=-1)  # (B, H, p + q)

        n_leaving = pending.shape[-1] - self.sliding_window_size
        if n_leaving > 0:
            # These tokens leave the window now: decide their fate once and for all.
            layer.evict(start, pending[..., :n_leaving] < self.threshold)
            pending, start = pending[..., n_leaving:], start + n_leaving
        state["pending"], state["pending_start"] = pending, start
        return True
