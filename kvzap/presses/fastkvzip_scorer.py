"""Fast KVzip (arXiv 2601.17668): per-layer gates distilled from KVzip scores, thresholded in log space."""

from __future__ import annotations

import os

from transformers import PreTrainedModel

from kvzap import _compat
from kvzap.presses.surrogate_scorer import SurrogateScorer
from kvzap.surrogates.fastkvzip import FastKVzipGates

__all__ = ["FastKVzipScorer"]


class FastKVzipScorer(SurrogateScorer):
    """Scores KV pairs with Fast KVzip gates.

    The score is ``log(gate)``, the log of the gate's estimate of the pair's KVzip score (a max attention
    weight in (0, 1)), so thresholds are negative numbers on the same log-attention scale as KVzip
    (``threshold=-4`` evicts pairs whose predicted KVzip score is below ``e^-4 ~ 0.018``).

    Parameters
    ----------
    surrogate : a :class:`~kvzap.surrogates.FastKVzipGates`, a local directory or a Hub id in kvzap's gate format;
        None uses the gates bundled with kvzap for the model.
    """

    module_class = FastKVzipGates
    bundled_type = "fastkvzip"

    def __init__(self, surrogate: FastKVzipGates | str | os.PathLike | None = None) -> None:
        super().__init__(surrogate)

    def __repr__(self) -> str:
        src = self.surrogate if not isinstance(self.surrogate, FastKVzipGates) else "<module>"
        return f"FastKVzipScorer(surrogate={src!r})"

    def _describe(self) -> str:
        return "Fast KVzip gate"

    def _expected_config(self, model: PreTrainedModel) -> dict[str, int]:
        cfg = _compat.text_config(model)
        n_kv = _compat.num_kv_heads(model)
        return {
            "n_modules": cfg.num_hidden_layers,
            "input_dim": cfg.hidden_size,
            "n_kv_heads": n_kv,
            "n_groups": cfg.num_attention_heads // n_kv,
        }

    def _check(self, loaded: FastKVzipGates, model: PreTrainedModel, model_name: str) -> None:
        cfg = _compat.text_config(model)
        loaded.check_compatible(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_kv_heads=_compat.num_kv_heads(model),
            num_heads=cfg.num_attention_heads,
            model_name=model_name,
        )
