"""KVzap: a per-layer surrogate predicts each new KV pair's log KVzip+ score from its hidden state."""

from __future__ import annotations

import os
from typing import Literal

from transformers import PreTrainedModel

from kvzap import _compat
from kvzap.presses.surrogate_scorer import SurrogateScorer
from kvzap.surrogates import KVzapSurrogate, list_bundled

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
    variant : another surrogate bundled for the model, in ``<model name>/<model_type>-<variant>/`` of the bundled
        surrogates (``kvzap.surrogates.list_bundled()`` lists them), instead of the default ``<model_type>/``.
        For SmolLM2-135M-Instruct, ``variant="average"`` is the average of three MLPs fitted on more text (higher
        held-out R^2 on every kind of text, fewer needles kept at the same eviction; see the bundled README). A
        variant is never looked up on the Hub, and cannot be combined with ``surrogate``.

    The weights are resolved, checked against the model's shapes and placed on each layer's device and dtype
    once, when a press using this scorer is applied to a model.
    """

    module_class = KVzapSurrogate

    def __init__(
        self,
        model_type: Literal["linear", "mlp"] = "mlp",
        surrogate: KVzapSurrogate | str | os.PathLike | None = None,
        variant: str | None = None,
    ) -> None:
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type must be 'linear' or 'mlp', got {model_type!r}.")
        if variant is not None:
            _check_variant(model_type, variant, surrogate)
        if isinstance(surrogate, KVzapSurrogate) and surrogate.model_type != model_type:
            raise ValueError(
                f"The surrogate given is a KVzap-{surrogate.model_type} model but model_type={model_type!r}: "
                "pass the matching model_type."
            )
        self.model_type = model_type
        self.variant = variant
        self.bundled_type = model_type if variant is None else f"{model_type}-{variant}"
        super().__init__(surrogate)

    def __repr__(self) -> str:
        if self.variant is not None:
            return f"KVzapScorer(model_type={self.model_type!r}, variant={self.variant!r})"
        src = self.surrogate if not isinstance(self.surrogate, KVzapSurrogate) else "<module>"
        return f"KVzapScorer(model_type={self.model_type!r}, surrogate={src!r})"

    def _describe(self) -> str:
        if self.variant is not None:
            return f"KVzap-{self.model_type} surrogate (variant {self.variant!r})"
        return f"KVzap-{self.model_type} surrogate"

    def _not_bundled_hint(self, model_name: str) -> str:
        if self.variant is None:
            return super()._not_bundled_hint(model_name)
        models = _bundled_variants(self.model_type).get(self.variant, [])
        return (
            f"Variant {self.variant!r} is bundled for {', '.join(models)} only: leave variant=None for the model's "
            "default surrogate, or pass surrogate='<directory>'."
        )

    def _hub_id(self, model_name: str) -> str | None:
        # A variant names a bundled directory; the Hub has no counterpart to fall back on.
        return None if self.variant is not None else f"nvidia/KVzap-{self.model_type}-{model_name}"

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


def _bundled_variants(model_type: str) -> dict[str, list[str]]:
    """Variant name -> the bundled models that have it, for one surrogate type."""
    prefix = f"{model_type}-"
    variants: dict[str, list[str]] = {}
    for model_name, types in list_bundled().items():
        for bundled_type in types:
            if bundled_type.startswith(prefix):
                variants.setdefault(bundled_type[len(prefix) :], []).append(model_name)
    return variants


def _check_variant(model_type: str, variant: object, surrogate: object) -> None:
    """Refuses a variant that is not a bundled one, or one given together with ``surrogate``."""
    if surrogate is not None:
        raise ValueError(
            "variant picks a surrogate bundled with kvzap and surrogate= names one: pass only one of them "
            "(surrogate='<directory>' for your own weights)."
        )
    known = _bundled_variants(model_type)
    if not isinstance(variant, str) or variant not in known:
        listed = ", ".join(f"{name!r} ({', '.join(models)})" for name, models in sorted(known.items())) or "none"
        raise ValueError(
            f"variant={variant!r} is not a bundled KVzap-{model_type} variant; bundled {model_type} variants: "
            f"{listed}. Leave variant=None for the model's default surrogate."
        )
