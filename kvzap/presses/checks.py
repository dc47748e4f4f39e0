"""Checks shared by presses, scorers and the pipeline: numbers and flags given by a user, and scores given by a
scorer, each refused with a sentence naming what was wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from kvzap import _compat
from kvzap.presses.scorer import Scorer

__all__ = ["as_number", "as_bool", "check_scores"]


def as_number(name: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> Any:
    """``value`` as a Python int/float (numpy scalars included), or a TypeError naming ``name``.

    bool is refused (``True`` as a threshold or a window size is always a bug); ranges are checked by the caller.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got a bool ({value!r}).")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if not integer and isinstance(value, (float, np.floating)):
        return float(value)
    raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(value).__name__} ({value!r}).")


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool (numpy bools included), or a TypeError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r}).")


def check_scores(scores: torch.Tensor, scorer: Scorer, module: nn.Module) -> torch.Tensor:
    """Refuse NaN scores: ``score < threshold`` is False for NaN, so they would silently evict nothing.

    One device sync per scorer call; presses call it where they already score a batch (a prefill, or up to 16
    decoded tokens), not on every decoding step.

    Raises
    ------
    ValueError
        Naming the scorer and the layer.
    """
    if bool(torch.isnan(scores).any()):
        raise ValueError(
            f"{type(scorer).__name__} returned NaN scores for layer {_compat.layer_index(module)}: NaN cannot be "
            "compared with a threshold. Check the scorer's weights (a surrogate trained to NaN, or loaded in a dtype "
            "that overflows) and the model's hidden states."
        )
    return scores
