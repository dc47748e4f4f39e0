"""Baseline scorers for tests and evaluation: random, key norm and recency."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvzap.presses.base import Scorer, as_number, check_number

__all__ = ["RandomScorer", "KeyNormScorer", "RecencyScorer", "ConstantScorer"]


@dataclass
class RandomScorer(Scorer):
    """Standard-normal scores, reproducible for a given ``seed`` and call order."""

    seed: int = 0

    def __setattr__(self, name: str, value) -> None:
        # Checked at construction and when set later alike.
        if name == "seed":
            value = as_number("seed", value, integer=True)
            if not 0 <= value < 2**63:  # what torch.Generator.manual_seed accepts without wrapping
                raise ValueError(f"seed must be an int in [0, 2**63), got {value}.")
        super().__setattr__(name, value)

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

    def __setattr__(self, name: str, value) -> None:
        # Checked at construction and when set later alike: a NaN score can be compared with no threshold.
        if name == "value":
            value = check_number("value", value)
        super().__setattr__(name, value)

    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        bsz, n_heads, q_len, _ = keys.shape
        return torch.full((bsz, n_heads, q_len), float(self.value), device=keys.device)
