"""KVzap: a per-layer surrogate predicts each new KV pair's log KVzip+ score from its hidden state."""

from __future__ import annotations

import os
from typing import Literal

from transformers import PreTrainedModel

from kvzap import _compat
from kvzap.presses.surrogate_scorer import SurrogateScorer
from kvzap.surrogates import KVzapSurrogate

__all__ = ["KVzapScorer"]

_MODEL_TYPES = ("linear", "mlp")


class KVzapScorer(SurrogateScorer):
    """Scores KV pairs with a KVzap surrogate (arXiv 2601.07891): the predicted log KVzip+ score.

    Parameters
    ----------
    model_type : ``"mlp"`` (default) or ``"linear"``.
    surrogate : where the weights come from: a :class:`~kvzap.surrogates.KVzapSurrogate`, a local directory or a
        Hub id in the published checkpoint format. When None, the scorer uses the surrogate bundled with kvzap for
        the model (if any), else downloads ``nvidia/KVzap-{model_type}-{model name}`` from the Hub.

    The weights are resolved, checked against the model's shapes and placed on each layer's device and dtype
    once, when a press using this scorer is applied to a model.
    """

    module_class = KVzapSurrogate

    def __init__(
        self,
        model_type: Literal["linear", "mlp"] = "mlp",
        surrogate: KVzapSurrogate | str | os.PathLike | None = None,
    ) -> None:
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type must be 'linear' or 'mlp', got {model_type!r}.")
        if isinstance(surrogate, KVzapSurrogate) and surrogate.model_type != model_type:
            raise ValueError(
                f"The surrogate given is a KVzap-{surrogate.model_type} model but model_type={model_type!r}: "
                "pass the matching model_type."
            )
        self.model_type = model_type
        self.bundled_type = model_type
        super().__init__(surrogate)

    def __repr__(self) -> str:
        src = self.surrogate if not isinstance(self.surrogate, KVzapSurrogate) else "<module>"
        return f"KVzapScorer(model_type={self.model_type!r}, surrogate={src!r})"

    def _describe(self) -> str:
        return f"KVzap-{self.model_type} surrogate"

    def _hub_id(self, model_name: str) -> str:
        return f"nvidia/KVzap-{self.model_type}-{model_name}"

    def _expected_config(self, model: PreTrainedModel) -> dict[str, int]:
        cfg = _compat.text_config(model)
        return {
            "n_modules": cfg.num_hidden_layers,
            "input_dim": cfg.hidden_size,
            "output_dim": _compat.num_kv_heads(model),
        }

    def _check(self, loaded: KVzapSurrogate, model: PreTrainedModel, model_name: str) -> None:
        if loaded.model_type != self.model_type:
            raise ValueError(
                f"The surrogate loaded from {self.source} is a KVzap-{loaded.model_type} model but "
                f"model_type={self.model_type!r}."
            )
        cfg = _compat.text_config(model)
        loaded.check_compatible(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_kv_heads=_compat.num_kv_heads(model),
            model_name=model_name,
        )
