"""Checks shared by presses, scorers and the pipeline: numbers and flags given by a user, and scores given by a
scorer, each refused with a sentence naming what was wrong."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from kvzap import _compat
from kvzap.paged.quant import check_kv_bits
from kvzap.presses.scorer import Scorer

__all__ = [
    "as_number",
    "as_bool",
    "check_kv_bits",
    "check_number",
    "check_press_kv_bits",
    "check_score_shape",
    "check_scores",
]

#: Why a press refuses 4-bit storage: the measurement (``research/kv-bits-4``).
KV_BITS_4_REFUSAL = (
    "kv_bits=4 is refused: storing the kept pairs at 4 bits loses needles against pruning alone, -4.5 points "
    "[95%: -8.8, -0.2] on the 200 samples of the 2k needle suite (SmolLM2-135M-Instruct, KVzap-MLP at threshold "
    "-2.5; research/kv-bits-4 in the repository). Use kv_bits=8 (no measured loss, 0.11 of the full float32 cache "
    "at 8k tokens with ~70% evicted) or kv_bits=None (the model's dtype)."
)


def check_press_kv_bits(value: Any) -> int | None:
    """A press's ``kv_bits``: None or 8, or a clear error (4 bits is a storage width presses refuse, see
    :data:`KV_BITS_4_REFUSAL`)."""
    try:
        bits = check_kv_bits(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"kv_bits must be None (the model's dtype) or 8, got {value!r}: a press stores its kept pairs at 8 bits "
            "or in the model's dtype."
        ) from None
    if bits == 4:
        raise ValueError(KV_BITS_4_REFUSAL)
    return bits


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


def check_number(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    allow_none: bool = False,
    minimum: float | None = None,
    finite: bool = False,
    hint: str = "",
) -> Any:
    """:func:`as_number` with its range checked: never NaN, at least ``minimum``, and finite when ``finite``.

    Raises
    ------
    TypeError
        When ``value`` is not a number (see :func:`as_number`).
    ValueError
        When it is NaN, infinite (``finite=True``) or below ``minimum``; the message ends with ``hint``.
    """
    value = as_number(name, value, integer=integer, allow_none=allow_none)
    if value is None:
        return None
    hint = f" {hint}" if hint else ""
    if math.isnan(value):
        raise ValueError(f"{name} is NaN: pass a number.{hint}")
    if finite and math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value!r}.{hint}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}.{hint}")
    return value


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool (numpy bools included), or a TypeError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r}).")


def check_score_shape(scores: Any, scorer: Scorer, module: nn.Module, expected: tuple[int, ...]) -> torch.Tensor:
    """Refuse scores that are not a real tensor of shape ``expected`` = ``(batch, kv_heads, tokens)``.

    A scorer returning another shape (one head, one token, the heads last) would otherwise be broadcast against
    the cache silently.

    Raises
    ------
    TypeError, ValueError
        Naming the scorer, the layer and the shape expected.
    """
    where = f"{type(scorer).__name__} (layer {_compat.layer_index(module)})"
    if not isinstance(scores, torch.Tensor):
        raise TypeError(
            f"{where} returned a {type(scores).__name__}: Scorer.score must return a tensor of shape "
            "(batch, kv_heads, tokens)."
        )
    if scores.dtype == torch.bool or scores.is_complex():
        raise TypeError(f"{where} returned {scores.dtype} scores: return real numbers (higher = more important).")
    if tuple(scores.shape) != tuple(expected):
        raise ValueError(
            f"{where} returned scores of shape {tuple(scores.shape)}, expected (batch, kv_heads, tokens) = "
            f"{tuple(expected)}: one score per new KV pair (keys are (batch, kv_heads, tokens, head_dim))."
        )
    return scores


def check_scores(
    scores: Any, scorer: Scorer, module: nn.Module, expected: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Refuse NaN scores (and, given ``expected``, scores of the wrong shape: :func:`check_score_shape`).

    NaN is refused because ``score < threshold`` is False for NaN: NaN scores would silently evict nothing.

    One device sync per scorer call; presses call it where they already score a batch (a prefill, or up to 16
    decoded tokens), not on every decoding step.

    Raises
    ------
    ValueError
        Naming the scorer and the layer.
    """
    if expected is not None:
        check_score_shape(scores, scorer, module, expected)
    elif not isinstance(scores, torch.Tensor):
        raise TypeError(f"{type(scorer).__name__} returned a {type(scores).__name__}: scores must be a tensor.")
    if bool(torch.isnan(scores).any()):
        raise ValueError(
            f"{type(scorer).__name__} returned NaN scores for layer {_compat.layer_index(module)}: NaN cannot be "
            "compared with a threshold. Check the scorer's weights (a surrogate trained to NaN, or loaded in a dtype "
            "that overflows) and the model's hidden states."
        )
    return scores
