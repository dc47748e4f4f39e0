"""Registry of the presses the evaluation can run, by name.

Each entry says which knob it takes: ``"threshold"`` (DMS presses, the compression ratio is an outcome),
``"compression_ratio"`` (top-k baselines, the ratio is the input) or nothing (the full cache). A factory builds a
fresh press for one value of that knob.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvzap.presses import (
    BasePress,
    DMSThresholdPress,
    FastKVzipScorer,
    KeyNormScorer,
    KVzapScorer,
    KVzipPlusScorer,
    RandomScorer,
    RecencyScorer,
    TopKPress,
)

__all__ = ["PressFactory", "PRESSES", "make_press", "PressNotAvailableError", "weights_fingerprint", "bundled_weights"]

Knob = Literal["threshold", "compression_ratio"] | None


class PressNotAvailableError(NotImplementedError):
    """The press is declared in the registry but not implemented yet."""


@dataclass(frozen=True)
class PressFactory:
    """How to build one press of the evaluation.

    Parameters
    ----------
    name : registry key, also used in run directory names.
    knob : ``"threshold"``, ``"compression_ratio"`` or None (no parameter).
    build : ``build(value, surrogate=..., sliding_window_size=..., decoding=..., seed=...)`` -> press or None;
        None when the press is not available yet.
    description : one line for ``--help`` and the README.
    surrogate_type : the learned weights the press reads (``"mlp"``, ``"linear"``, ``"fastkvzip"``), also the
        sub-directory it reads from a directory holding several (the ``kvzap train fit`` output); None for
        presses without learned weights. A run of such a press records its surrogate in its run key.
    batchable : False when running samples together changes a row's decisions (the random scorer draws the
        scores of a whole batch from one generator), so the evaluation refuses ``batch_size > 1`` for it.
    """

    name: str
    knob: Knob
    build: Callable[..., BasePress | None] | None
    description: str
    surrogate_type: str | None = None
    batchable: bool = True

    @property
    def available(self) -> bool:
        return self.build is not None


def weights_fingerprint(directory: str | os.PathLike | None) -> str | None:
    """A fingerprint of the surrogate weights in ``directory``: sha256 (16 hex digits) of its ``config.json`` and
    ``*.safetensors`` files (names and bytes); None when ``directory`` is None or not a directory."""
    directory = None if directory is None else Path(directory).expanduser()
    if directory is None or not directory.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted([directory / "config.json", *directory.glob("*.safetensors")]):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def bundled_weights(model_name: str, press: str) -> str | None:
    """:func:`weights_fingerprint` of the surrogate press ``press`` reads by default for ``model_name`` (the one
    the installed package bundles); None for presses without learned weights or models without bundled ones."""
    factory = PRESSES.get(press)
    kind = factory.surrogate_type if factory is not None else None
    if kind is None or not model_name:
        return None
    from kvzap.surrogates import bundled_surrogate_dir

    return weights_fingerprint(bundled_surrogate_dir(model_name, kind))


def _kvzap(model_type: str):
    def build(value, *, surrogate=None, sliding_window_size=128, decoding=False, **_):
        scorer = KVzapScorer(model_type, surrogate=surrogate)
        return DMSThresholdPress(scorer, float(value), sliding_window_size=sliding_window_size, decoding=decoding)

    return build


def _fastkvzip(value, *, surrogate=None, sliding_window_size=128, decoding=False, **_):
    scorer = FastKVzipScorer(surrogate=surrogate)
    return DMSThresholdPress(scorer, float(value), sliding_window_size=sliding_window_size, decoding=decoding)


def _kvzip_plus_topk(value, **_):
    # The tokenizer is found when the press is applied (the model's name or directory, local files only).
    return TopKPress(KVzipPlusScorer(), float(value))


def _kvzip_plus_threshold(value, *, sliding_window_size=128, decoding=False, **_):
    # decoding=True is refused by DMSThresholdPress with a clear error: the oracle scores the context only.
    return DMSThresholdPress(
        KVzipPlusScorer(), float(value), sliding_window_size=sliding_window_size, decoding=decoding
    )


def _topk(scorer_factory: Callable[[int], object]):
    def build(value, *, seed=0, **_):
        return TopKPress(scorer_factory(seed), float(value))

    return build


PRESSES: dict[str, PressFactory] = {
    factory.name: factory
    for factory in (
        PressFactory("no_press", None, lambda value=None, **_: None, "full cache (no eviction)"),
        PressFactory(
            "kvzap_mlp", "threshold", _kvzap("mlp"), "KVzap-MLP surrogate, DMS threshold with sliding window", "mlp"
        ),
        PressFactory(
            "kvzap_linear",
            "threshold",
            _kvzap("linear"),
            "KVzap-Linear surrogate, DMS threshold with sliding window",
            "linear",
        ),
        PressFactory(
            "random",
            "compression_ratio",
            _topk(lambda seed: RandomScorer(seed)),
            "random scores, top-k",
            batchable=False,
        ),
        PressFactory("key_norm", "compression_ratio", _topk(lambda seed: KeyNormScorer()), "minus key norm, top-k"),
        PressFactory(
            "recency", "compression_ratio", _topk(lambda seed: RecencyScorer()), "keep the most recent, top-k"
        ),
        PressFactory(
            "kvzip_plus", "compression_ratio", _kvzip_plus_topk, "KVzip+ oracle scores (exact, extra forward), top-k"
        ),
        PressFactory(
            "kvzip_plus_threshold",
            "threshold",
            _kvzip_plus_threshold,
            "KVzip+ oracle scores (exact, extra forward), DMS threshold with sliding window",
        ),
        PressFactory(
            "fastkvzip",
            "threshold",
            _fastkvzip,
            "Fast KVzip gates (log-gate threshold), sliding window",
            "fastkvzip",
        ),
    )
}


def make_press(
    name: str,
    value: float | None = None,
    *,
    surrogate: str | os.PathLike | None = None,
    sliding_window_size: int = 128,
    decoding: bool = False,
    seed: int = 0,
) -> BasePress | None:
    """Build press ``name`` for one threshold or compression ratio.

    Parameters
    ----------
    name : a key of :data:`PRESSES`.
    value : the threshold (``knob == "threshold"``) or target compression ratio (``"compression_ratio"``);
        ignored for ``no_press``.
    surrogate : KVzap surrogate directory or Hub id; None uses the bundled one or the published checkpoint.
    sliding_window_size, decoding : DMS options for threshold presses.
    seed : seed of the random scorer.

    Returns
    -------
    BasePress, or None for the full cache.

    Raises
    ------
    ValueError : unknown name, or a missing value.
    PressNotAvailableError : the press is declared but not implemented yet.
    """
    if name not in PRESSES:
        raise ValueError(f"Unknown press {name!r}; choose from {', '.join(PRESSES)}.")
    factory = PRESSES[name]
    if not factory.available:
        raise PressNotAvailableError(
            f"The press {name!r} ({factory.description}) is not available yet in this version of kvzap; "
            f"choose one of {', '.join(n for n, f in PRESSES.items() if f.available)}."
        )
    if factory.knob is not None and value is None:
        raise ValueError(f"The press {name!r} needs a {factory.knob.replace('_', ' ')}.")
    return factory.build(
        value, surrogate=surrogate, sliding_window_size=sliding_window_size, decoding=decoding, seed=seed
    )
