"""A fixed-ratio baseline: evict the lowest-scoring share of the prompt's pairs, per KV head, after prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kvzap.cache import PrunableLayer
from kvzap.presses.base import BasePress, Scorer, as_number, check_scores

__all__ = ["TopKPress"]


@dataclass
class TopKPress(BasePress):
    """Keep the ``1 - target_compression`` highest-scoring pairs of every (sequence, KV head) after prefill.

    Parameters
    ----------
    scorer : Scorer
    target_compression : float in [0, 1)
        Share of the prompt's pairs to evict in each head. Tokens generated later are never evicted.
    """

    scorer: Scorer = None  # type: ignore[assignment]
    target_compression: float = 0.0

    # The share is taken of every column of the prompt: a padded row would rank its padding too.
    supports_padding: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.scorer, Scorer):
            raise TypeError(f"scorer must be a kvzap Scorer, got {type(self.scorer).__name__}.")
        ratio = self.target_compression = as_number("target_compression", self.target_compression)
        if not 0 <= ratio < 1:  # also False for NaN
            raise ValueError(f"target_compression must be a number in [0, 1), got {ratio!r}.")

    def _checked(self, name: str, value):
        # Also inside `with press(model):`, where nothing validates again.
        if name == "target_compression":
            value = as_number("target_compression", value)
            if not 0 <= value < 1:  # also False for NaN
                raise ValueError(f"target_compression must be a number in [0, 1), got {value!r}.")
        elif name == "scorer" and "scorer" in self.__dict__ and not isinstance(value, Scorer):
            raise TypeError(f"scorer must be a kvzap Scorer, got {type(value).__name__}.")
        return super()._checked(name, value)

    def setup(self, model) -> None:
        self.scorer.setup(model)

    def process_layer(self, module: nn.Module, layer: PrunableLayer, hidden_states: torch.Tensor, prefill: bool):
        if not prefill:
            return False
        q_len = hidden_states.shape[1]
        n_evict = int(q_len * self.target_compression)
        if n_evict > 0:
            scores = self.scorer.score_new_pairs(module, layer, hidden_states)  # (B, H, q)
            keys = layer.last_keys
            check_scores(scores, self.scorer, module, (keys.shape[0], keys.shape[1], q_len))
            lowest = scores.topk(n_evict, dim=-1, largest=False).indices  # (B, H, n_evict)
            mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, lowest, True)
            layer.evict(layer.seen - q_len, mask)
        return True
