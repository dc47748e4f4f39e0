"""Baseline scorers for tests and evaluation: random, key norm and recency."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvzap.presses.base import Scorer

__all__ = ["RandomScorer", "KeyNormScorer", "RecencyScorer", "ConstantScorer"]


@dataclass
class RandomScorer(Scorer):
    """Standard-normal scores, reproducible for a given ``seed`` and call order."""

    seed: int = 0

    def __post_init__(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def setup(self, model) -> None:
        self._generator.manual_seed(self.seed)

    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        bsz, n_heads, q_len, _ = keys.shape
        scores = torch.randn(bsz, n_heads, q_len, generator=self._generator)
        return scores.to(keys.device)


@dataclass
class KeyNormScorer(Scorer):
    """Minus the L2 norm of each key: low-norm keys attract attention (Devoto et al., 2024)."""

    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        return -keys.float().norm(dim=-1)  # (B, H, q)


@dataclass
class RecencyScorer(Scorer):
    """The token's absolute position: with a top-k press it keeps the most recent tokens."""

    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        bsz, n_heads, q_len, _ = keys.shape
        return positions.to(device=keys.device, dtype=torch.float32).expand(bsz, n_heads, q_len)


@dataclass
class ConstantScorer(Scorer):
    """The same score for every pair (``threshold`` semantics tests; never evicts with a lower threshold)."""

    value: float = 0.0

    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        bsz, n_heads, q_len, _ = keys.shape
        return torch.full((bsz, n_heads, q_len), float(self.value), device=keys.device)
