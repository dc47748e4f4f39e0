"""Registry of the presses the evaluation can run, by name.

Each entry says which knob it takes: ``"threshold"`` (DMS presses, the compression ratio is an outcome),
``"compression_ratio"`` (top-k baselines, the ratio is the input) or nothing (the full cache, and the caches below).
A factory builds a fresh press for one value of that knob.

The alternatives to pruning that a user would try first are entries too: transformers' static cache
(``static_cache``) and its quantized cache (``quanto_int4``, ``quanto_int2``, ``hqq_int4``, ``hqq_int2``). They
are not presses but caches; their factory builds a :class:`CacheMethod`, which the runner applies by prefilling
and answering into a fresh cache of that kind (what ``generate(..., cache_implementation=...)`` does), with no
press. ``kvzap_mlp_kv8`` is KVzap-MLP with its kept pairs stored at 8 bits (``kv_bits=8``). ``kvzap_mlp_kv4`` stores
them at 4 bits, which presses refuse (``kv_bits=4``) for the loss this entry measures (``research/kv-bits-4``): its
press keeps the compact storage's 4-bit layers, so the measurement stays reproducible.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvzap.compact import compact_layer_like
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

__all__ = [
    "PressFactory",
    "PRESSES",
    "CacheMethod",
    "make_press",
    "PressNotAvailableError",
    "weights_fingerprint",
    "bundled_weights",
]

Knob = Literal["threshold", "compression_ratio"] | None


class PressNotAvailableError(NotImplementedError):
    """The press is declared in the registry but not implemented yet."""


@dataclass(frozen=True)
class CacheMethod:
    """A cache the evaluation answers with in place of a press: transformers' static or quantized cache.

    Parameters
    ----------
    name : registry key.
    kind : ``"static"`` (preallocated, full precision) or ``"quantized"``.
    backend, nbits : the quantized cache's backend (``"quanto"`` or ``"hqq"``) and bits (4 or 2); None for static.

    :meth:`new_cache` gives the empty cache of one sample; nothing is evicted, so its compression ratio is 0.
    """

    name: str
    kind: Literal["static", "quantized"]
    backend: str | None = None
    nbits: int | None = None

    def new_cache(self, model, max_len: int):
        """An empty cache for ``model``, room for ``max_len`` tokens (the prompt, the question and the answer)."""
        from transformers import QuantizedCache, StaticCache

        if self.kind == "static":
            return StaticCache(config=model.config, max_cache_len=int(max_len))
        return QuantizedCache(self.backend, model.config, nbits=self.nbits)


# The Python package each quantized cache backend needs, as transformers imports it.
_BACKEND_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}


def _cache_method(name: str, kind: str, backend: str | None = None, nbits: int | None = None):
    def build(value=None, **_):
        if backend is not None:
            module, package = _BACKEND_PACKAGES[backend]
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:  # the parent package (optimum) is missing too
                found = False
            if not found:
                raise PressNotAvailableError(
                    f"{name} uses transformers' quantized cache with the {backend} backend, which needs the "
                    f"{package} package: pip install {package}."
                )
        return CacheMethod(name, kind, backend, nbits)

    return build


@dataclass(frozen=True)
class PressFactory:
    """How to build one press of the evaluation.

    Parameters
    ----------
    name : registry key, also used in run directory names.
    knob : ``"threshold"``, ``"compression_ratio"`` or None (no parameter).
    build : ``build(value, surrogate=..., sliding_window_size=..., decoding=..., seed=...)`` -> press, a
        :class:`CacheMethod`, or None (the full cache); ``build`` itself is None when the press is not available.
    description : one line for ``--help`` and the README.
    surrogate_type : the learned weights the press reads (``"mlp"``, ``"linear"``, ``"fastkvzip"``), also the
        sub-directory it reads from a directory holding several (the ``kvzap train fit`` output); None for
        presses without learned weights. A run of such a press records its surrogate in its run key.
    batchable : False when running samples together changes a row's decisions (the random scorer draws the
        scores of a whole batch from one generator), so the evaluation refuses ``batch_size > 1`` for it.
    """

    name: str
    knob: Knob
    build: Callable[..., BasePress | CacheMethod | None] | None
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


class FourBitStoragePress(DMSThresholdPress):
    """A DMS threshold press whose kept pairs are the compact storage's 4-bit codes: what ``kv_bits=4`` would be,
    which presses refuse; the evaluation keeps it to measure why (``research/kv-bits-4``)."""

    def _storage_layer(self, layer):
        return compact_layer_like(layer, kv_bits=4)


def _kvzap_kv4(value, *, surrogate=None, sliding_window_size=128, decoding=False, sink_size=None, **_):
    scorer = KVzapScorer("mlp", surrogate=surrogate)
    return FourBitStoragePress(
        scorer, float(value), sliding_window_size=sliding_window_size, decoding=decoding, sink_size=sink_size
    )


def _kvzap(model_type: str, **extra):
    def build(value, *, surrogate=None, sliding_window_size=128, decoding=False, sink_size=None, **_):
        scorer = KVzapScorer(model_type, surrogate=surrogate)
        return DMSThresholdPress(
            scorer,
            float(value),
            sliding_window_size=sliding_window_size,
            decoding=decoding,
            sink_size=sink_size,
            **extra,
        )

    return build


def _fastkvzip(value, *, surrogate=None, sliding_window_size=128, decoding=False, sink_size=None, **_):
    scorer = FastKVzipScorer(surrogate=surrogate)
    return DMSThresholdPress(
        scorer, float(value), sliding_window_size=sliding_window_size, decoding=decoding, sink_size=sink_size
    )


def _kvzip_plus_topk(value, **_):
    # The tokenizer is found when the press is applied (the model's name or directory, local files only).
    return TopKPress(KVzipPlusScorer(), float(value))


def _kvzip_plus_threshold(value, *, sliding_window_size=128, decoding=False, sink_size=None, **_):
    # decoding=True is refused by DMSThresholdPress with a clear error: the oracle scores the context only.
    return DMSThresholdPress(
        KVzipPlusScorer(),
        float(value),
        sliding_window_size=sliding_window_size,
        decoding=decoding,
        sink_size=sink_size,
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
            "kvzap_mlp_kv8",
            "threshold",
            _kvzap("mlp", kv_bits=8),
            "KVzap-MLP surrogate, DMS threshold with sliding window, kept pairs stored at 8 bits",
            "mlp",
        ),
        PressFactory(
            "kvzap_mlp_kv4",
            "threshold",
            _kvzap_kv4,
            "KVzap-MLP surrogate, DMS threshold with sliding window, kept pairs stored at 4 bits (refused by presses;"
            " kept to measure why)",
            "mlp",
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
        PressFactory(
            "static_cache",
            None,
            _cache_method("static_cache", "static"),
            "no press, transformers' static cache (preallocated)",
        ),
        *(
            PressFactory(
                f"{backend}_int{nbits}",
                None,
                _cache_method(f"{backend}_int{nbits}", "quantized", backend, nbits),
                f"no press, transformers' quantized cache ({label} int{nbits}, groups of 64, last 128 tokens full)",
            )
            for backend, label in (("quanto", "optimum-quanto"), ("hqq", "HQQ"))
            for nbits in (4, 2)
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
    sink_size: int | None = None,
) -> BasePress | CacheMethod | None:
    """Build press ``name`` for one threshold or compression ratio.

    Parameters
    ----------
    name : a key of :data:`PRESSES`.
    value : the threshold (``knob == "threshold"``) or target compression ratio (``"compression_ratio"``);
        ignored for ``no_press``.
    surrogate : KVzap surrogate directory or Hub id; None uses the bundled one or the published checkpoint.
    sliding_window_size, decoding, sink_size : DMS options for threshold presses.
    seed : seed of the random scorer.

    Returns
    -------
    BasePress; a :class:`CacheMethod` for the static and quantized caches; None for the full cache.

    Raises
    ------
    ValueError : unknown name, or a missing value.
    PressNotAvailableError : the press is declared but not implemented yet, or its backend is not installed.
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
        value,
        surrogate=surrogate,
        sliding_window_size=sliding_window_size,
        decoding=decoding,
        seed=seed,
        sink_size=sink_size,
    )
