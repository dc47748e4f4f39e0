"""KVzap: a per-layer surrogate predicts each new KV pair's log KVzip+ score from its hidden state."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedModel

from kvzap import _compat
from kvzap.presses.base import Scorer
from kvzap.surrogates import KVzapSurrogate, SurrogateNotFoundError, bundled_surrogate_dir

logger = logging.getLogger(__name__)

__all__ = ["KVzapScorer"]

_MODEL_TYPES = ("linear", "mlp")


class KVzapScorer(Scorer):
    """Scores KV pairs with a KVzap surrogate (arXiv 2601.07891).

    Parameters
    ----------
    model_type : ``"mlp"`` (default) or ``"linear"``.
    surrogate : where the weights come from: a :class:`~kvzap.surrogates.KVzapSurrogate`, a local directory or a
        Hub id in the published checkpoint format. When None, the scorer uses the surrogate bundled with kvzap for
        the model (if any), else downloads ``nvidia/KVzap-{model_type}-{model name}`` from the Hub.

    The weights are resolved, checked against the model's shapes and placed on each layer's device and dtype
    once, when a press using this scorer is applied to a model.
    """

    def __init__(
        self,
        model_type: Literal["linear", "mlp"] = "mlp",
        surrogate: KVzapSurrogate | str | os.PathLike | None = None,
    ) -> None:
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type must be 'linear' or 'mlp', got {model_type!r}.")
        if surrogate is not None and not isinstance(surrogate, (KVzapSurrogate, str, os.PathLike)):
            raise TypeError(
                f"surrogate must be a KVzapSurrogate, a local directory or a Hub id, got {type(surrogate).__name__}."
            )
        if isinstance(surrogate, KVzapSurrogate) and surrogate.model_type != model_type:
            raise ValueError(
                f"The surrogate given is a KVzap-{surrogate.model_type} model but model_type={model_type!r}: "
                "pass the matching model_type."
            )
        self.model_type = model_type
        self.surrogate = surrogate
        self.source: str | None = None  # where the weights were loaded from, once resolved
        self._loaded: KVzapSurrogate | None = surrogate if isinstance(surrogate, KVzapSurrogate) else None
        self._loaded_for: str | None = None
        self._placement: tuple | None = None

    def __repr__(self) -> str:
        src = self.surrogate if not isinstance(self.surrogate, KVzapSurrogate) else "<module>"
        return f"KVzapScorer(model_type={self.model_type!r}, surrogate={src!r})"

    # --- weights ---------------------------------------------------------------------------------------------
    def _resolve(self, model: PreTrainedModel) -> KVzapSurrogate:
        name = str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "name_or_path", ""))
        short = Path(name).name if name else ""
        if isinstance(self.surrogate, KVzapSurrogate):
            self.source = "module"
            return self.surrogate
        if self.surrogate is not None:
            self.source = str(self.surrogate)
            return KVzapSurrogate.from_pretrained(self.surrogate)
        bundled = bundled_surrogate_dir(short, self.model_type) if short else None
        if bundled is not None:
            self.source = f"bundled:{bundled}"
            return KVzapSurrogate.from_pretrained(bundled)
        if not short:
            raise SurrogateNotFoundError(
                "The model has no name (config._name_or_path is empty), so no KVzap surrogate can be looked up: "
                "pass one with KVzapScorer(surrogate=<directory or Hub id>)."
            )
        repo_id = f"nvidia/KVzap-{self.model_type}-{short}"
        try:
            surrogate = KVzapSurrogate.from_pretrained(repo_id)
        except SurrogateNotFoundError as error:
            raise SurrogateNotFoundError(
                f"No KVzap-{self.model_type} surrogate for model {short!r}: none is bundled with kvzap and "
                f"{repo_id!r} could not be loaded from the Hub ({error}). Train one with "
                f"`python -m train --model {name}` and pass KVzapScorer(surrogate='<output dir>'), "
                "or pass a directory or Hub id in the published KVzap format."
            ) from error
        self.source = repo_id
        return surrogate

    def setup(self, model: PreTrainedModel) -> None:
        name = str(getattr(model.config, "_name_or_path", ""))
        if self._loaded is None or (self.surrogate is None and self._loaded_for != name):
            self._loaded = self._resolve(model)
            self._loaded_for = name
            self._placement = None
            logger.info("KVzap-%s surrogate loaded from %s", self.model_type, self.source)
        if self._loaded.model_type != self.model_type:
            raise ValueError(
                f"The surrogate loaded from {self.source} is a KVzap-{self._loaded.model_type} model but "
                f"model_type={self.model_type!r}."
            )
        cfg = _compat.text_config(model)
        self._loaded.check_compatible(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_kv_heads=_compat.num_kv_heads(model),
            model_name=name or type(model).__name__,
        )
        # Place each layer's module next to its attention layer, once (not on every call).
        modules = _compat.attention_modules(model)
        placement = tuple((p.device, p.dtype) for p in (next(m.parameters()) for m in modules))
        if placement != self._placement:
            self._loaded.eval().requires_grad_(False)
            for layer_module, (device, dtype) in zip(self._loaded.layers, placement, strict=True):
                layer_module.to(device=device, dtype=dtype)
            self._placement = placement

    # --- scoring ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        if self._loaded is None:
            raise RuntimeError("KVzapScorer.setup(model) must run first (applying a press does it).")
        scores = self._loaded(hidden_states, _compat.layer_index(module))  # (B, q, H)
        return scores.transpose(1, 2)  # (B, H, q)
