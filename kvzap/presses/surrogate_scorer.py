"""Shared machinery of learned scorers: where the weights come from, shape checks, placement, scoring."""

from __future__ import annotations

import copy
import logging
import os
import threading
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from kvzap import _compat
from kvzap.presses.base import Scorer
from kvzap.surrogates import SurrogateNotFoundError, bundled_surrogate_dir
from kvzap.surrogates.checkpoint import check_finite

logger = logging.getLogger(__name__)

__all__ = ["SurrogateScorer"]


class SurrogateScorer(Scorer):
    """A scorer backed by a per-layer module ``surrogate(hidden_states (B, q, D), layer_idx) -> (B, q, H)``.

    Subclasses set :attr:`module_class` (with ``from_pretrained``), :attr:`bundled_type` (the sub-directory of
    the bundled surrogates) and implement :meth:`_check` and, optionally, :meth:`_hub_id`.

    Weights are resolved in this order: what the caller passed (module, local directory or Hub id); the
    surrogate bundled with kvzap for the model (matched on the model's name); the Hub id of :meth:`_hub_id`.
    They are checked against the model and placed on each layer's device and dtype once per model.
    """

    module_class: type[nn.Module]
    bundled_type: str

    def __init__(self, surrogate: nn.Module | str | os.PathLike | None = None) -> None:
        if surrogate is not None and not isinstance(surrogate, (self.module_class, str, os.PathLike)):
            raise TypeError(
                f"surrogate must be a {self.module_class.__name__}, a local directory or a Hub id, "
                f"got {type(surrogate).__name__}."
            )
        self.surrogate = surrogate
        self.source: str | None = None  # where the weights were loaded from, once resolved
        # The weights as given or read (never changed: a caller's module stays theirs, and a second model of another
        # dtype is placed from these, not from a copy rounded to the first one's dtype), and their placed copy.
        self._loaded = surrogate if isinstance(surrogate, self.module_class) else None
        self._placed: nn.Module | None = None
        self._loaded_for: str | None = None
        self._placement: tuple | None = None
        self._users = 0  # presses currently applied with this scorer (their `with` blocks are open)
        self._lock = threading.Lock()

    # --- for subclasses --------------------------------------------------------------------------------------
    def _hub_id(self, model_name: str) -> str | None:
        """Hub repo tried when nothing was passed and nothing is bundled (None: do not try the Hub)."""
        return None

    def _check(self, loaded: nn.Module, model: PreTrainedModel, model_name: str) -> None:
        raise NotImplementedError

    def _expected_config(self, model: PreTrainedModel) -> dict[str, int]:
        """Config values a checkpoint must have to fit ``model``, checked before its weights are read."""
        return {}

    def _describe(self) -> str:
        return self.module_class.__name__

    def _not_bundled_hint(self, model_name: str) -> str:
        """How to fix a miss: nothing bundled for ``model_name`` (and no Hub id, or the Hub failed too)."""
        return (
            f"Train one with `kvzap train` and pass {type(self).__name__}(surrogate='<output dir>'), "
            "or pass a directory or Hub id in the published format."
        )

    # --- weights ---------------------------------------------------------------------------------------------
    def _resolve(self, name: str, expect: dict[str, int]) -> nn.Module:
        short = Path(name).name if name else ""
        if self.surrogate is not None:
            self.source = str(self.surrogate)
            return self.module_class.from_pretrained(self.surrogate, expect=expect)
        bundled = bundled_surrogate_dir(short, self.bundled_type) if short else None
        if bundled is not None:
            self.source = f"bundled:{bundled}"
            return self.module_class.from_pretrained(bundled, expect=expect)
        hub_id = self._hub_id(short) if short else None
        fix = self._not_bundled_hint(short)
        if hub_id is None:
            raise SurrogateNotFoundError(f"No {self._describe()} is bundled with kvzap for model {short!r}. {fix}")
        try:
            loaded = self.module_class.from_pretrained(hub_id, expect=expect)
        except SurrogateNotFoundError as error:
            raise SurrogateNotFoundError(
                f"No {self._describe()} for model {short!r}: none is bundled with kvzap and {hub_id!r} could not "
                f"be loaded from the Hub ({error}). {fix}"
            ) from error
        self.source = hub_id
        return loaded

    def setup(self, model: PreTrainedModel) -> None:
        name = str(getattr(model.config, "_name_or_path", "") or "")
        modules = _compat.attention_modules(model)
        placement = tuple((p.device, p.dtype) for p in (next(m.parameters()) for m in modules))
        with self._lock:
            swaps_weights = not isinstance(self.surrogate, self.module_class) and name != self._loaded_for
            if self._users and (swaps_weights or placement != self._placement):
                # One scorer holds one set of weights, placed for one model: a second model at the same time
                # would swap them under the first one's feet.
                raise RuntimeError(
                    f"This {type(self).__name__} is in use by a press applied to another model ({self._loaded_for!r}"
                    f" with other weights or placement): give each model its own scorer and press."
                )
            self._setup(model, name, placement)
            self._users += 1

    def _setup(self, model: PreTrainedModel, name: str, placement: tuple) -> None:
        if self._loaded is None or (not isinstance(self.surrogate, self.module_class) and self._loaded_for != name):
            # Read from files by the scorer, so its own: inference only (placed layers share it where they can).
            self._loaded = self._resolve(name, self._expected_config(model)).eval().requires_grad_(False)
            self._loaded_for = name
            self._placement = None
            logger.info("%s loaded from %s", self._describe(), self.source)
        elif isinstance(self.surrogate, self.module_class):
            self.source = "module"
        self._check(self._loaded, model, name or type(model).__name__)
        if self._placement is None:
            # Weights passed as a module are checked here (files are checked when they are read).
            check_finite(self._loaded, self.source or "the module passed")
        # Place each layer's module next to its attention layer, once (not on every call).
        if placement != self._placement:
            self._placed = _placed(self._loaded, placement)
            self._placement = placement

    def release(self) -> None:
        with self._lock:
            self._users = max(self._users - 1, 0)

    # --- scoring ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        if self._placed is None:
            raise RuntimeError(f"{type(self).__name__}.setup(model) must run first (applying a press does it).")
        scores = self._placed(hidden_states, _compat.layer_index(module))  # (B, q, H)
        return scores.transpose(1, 2)  # (B, H, q)


def _placed(module: nn.Module, placement: tuple) -> nn.Module:
    """``module`` with layer ``i`` on ``placement[i] = (device, dtype)``, leaving ``module`` itself unchanged.

    Layers already in place are shared, not copied (a CPU float32 model with float32 weights costs nothing): the
    surrogates hold no dropout or batch norm, and scoring runs without gradients, so neither their mode nor their
    ``requires_grad`` changes a score. The others are copied, for inference only (eval mode, no gradients).
    """
    layers = []
    for layer, (device, dtype) in zip(module.layers, placement, strict=True):
        if all(p.device == device and p.dtype == dtype for p in layer.parameters()):
            layers.append(layer)
        else:
            layers.append(copy.deepcopy(layer).to(device=device, dtype=dtype).eval().requires_grad_(False))
    placed = copy.copy(module)  # a shallow copy: the same config and buffers, its own list of layers
    placed._modules = dict(module._modules)
    placed._modules["layers"] = nn.ModuleList(layers)
    return placed
