"""Every transformers internal that kvzap relies on, in one place.

transformers 5.x moves fast: 5.4 removed ``cache_position`` from the attention kwargs, 5.24 renamed the
``past_key_values`` argument to ``cache``, and cache layers changed the signatures of ``crop`` and
``get_mask_sizes``. Hooks, caches and the pipeline go through the helpers below, so supporting a new release
is a change to this file only. Supported: transformers 5.2.x up to the newest 5.x release.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

__all__ = [
    "TRANSFORMERS_VERSION",
    "SUPPORTED_MODEL_TYPES",
    "cache_from_kwargs",
    "cache_kwarg_name",
    "crop_count",
    "CROP_TAKES_NEGATIVE_COUNT",
    "decoder_layers",
    "attention_modules",
    "layer_index",
    "text_config",
    "num_kv_heads",
    "check_supported_model",
    "new_dynamic_cache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
]

TRANSFORMERS_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())

# Model families whose attention kvzap has been checked on (config.model_type of the text model).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", "gemma3")

# The name under which the attention module receives the cache: ``cache`` since 5.24, ``past_key_values`` before.
_CACHE_KWARGS = ("cache", "past_key_values")


#: ``generate``'s prefill step (private; ``_prefill(input_ids, generation_config, model_kwargs, ...)`` in 5.2 to 5.24).
#: With ``prefill_chunk_size`` it runs the prompt as several forwards, which a press must see as one prompt.
GENERATE_PREFILL = "_prefill"

#: transformers' continuous-batching entry points (``generate(cache_implementation="paged")`` calls the first).
CONTINUOUS_BATCHING = ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager")


def generation_config_of_prefill(args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The ``generation_config`` argument of a call to ``generate``'s prefill step."""
    return kwargs.get("generation_config", args[1] if len(args) > 1 else None)


def cache_from_kwargs(kwargs: Mapping[str, Any]) -> Cache | None:
    """Return the cache object an attention module was called with (``cache`` or ``past_key_values``)."""
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def cache_kwarg_name(model: PreTrainedModel) -> str:
    """The keyword that passes a cache to ``model.forward`` without a deprecation warning.

    ``model(..., cache=c)`` is silently ignored before 5.24, so the choice is read off the forward signature
    rather than guessed.
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _crop_takes_negative_count() -> bool:
    """True when ``DynamicLayer.crop`` takes a count of tokens to remove (newer 5.x), False for a final length (5.2)."""
    params = list(inspect.signature(DynamicLayer.crop).parameters)
    return len(params) > 1 and params[1] == "tokens_to_remove"


#: The crop convention of the installed transformers, read off ``DynamicLayer.crop``'s signature.
CROP_TAKES_NEGATIVE_COUNT = _crop_takes_negative_count()


def crop_count(layer_seq_length: int, arg: int, *, negative_count: bool | None = None) -> int:
    """Number of tokens a ``crop(arg)`` call removes from a layer holding ``layer_seq_length`` tokens.

    transformers 5.2 takes a final length: ``crop(n)`` keeps ``n`` tokens (``crop(0)`` keeps none) and a
    negative ``n`` removes ``-n``. Newer releases take only a count: ``crop(-n)`` removes ``n`` tokens,
    ``crop(0)`` (what assisted decoding calls when every draft token was accepted) removes nothing, and a
    positive argument is an error.

    Parameters
    ----------
    layer_seq_length : tokens the layer holds.
    arg : the argument transformers passed to ``crop``.
    negative_count : which convention to apply; None (default) follows the installed transformers.

    Raises
    ------
    ValueError
        For a positive ``arg`` under the negative-count convention (transformers raises there too).
    """
    if negative_count is None:
        negative_count = CROP_TAKES_NEGATIVE_COUNT
    arg = int(arg)
    if arg < 0:
        return min(-arg, layer_seq_length)
    if negative_count:
        if arg > 0:
            raise ValueError(
                f"crop({arg}) is not supported by this transformers version: pass a negative count of tokens to "
                f"remove (crop(-n))."
            )
        return 0
    return max(layer_seq_length - arg, 0)


def text_config(model: PreTrainedModel):
    """The configuration of the text decoder (the model's own config for text-only models)."""
    return model.config.get_text_config(decoder=True)


def num_kv_heads(model: PreTrainedModel) -> int:
    cfg = text_config(model)
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The list of decoder layers of a causal LM (also inside multimodal wrappers such as Gemma3)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if hasattr(base, "language_model"):
        base = base.language_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"Could not find the decoder layers of {type(model).__name__}: kvzap expects `model.model.layers` "
            "(Llama, Qwen2/3, Mistral, Phi3, Gemma3 layouts)."
        )
    return layers


def decoder_model(model: PreTrainedModel) -> nn.Module:
    """The decoder stack (the module that receives ``input_ids`` and ``attention_mask``)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    return getattr(base, "language_model", base)


def attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    modules = []
    for i, layer in enumerate(decoder_layers(model)):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "layer_idx"):
            raise TypeError(f"Decoder layer {i} of {type(model).__name__} has no `self_attn` with a `layer_idx`.")
        modules.append(attn)
    return modules


def layer_index(module: nn.Module) -> int:
    return int(module.layer_idx)


def check_supported_model(model: Any) -> None:
    """Raise a clear error if ``model`` is not a transformers causal LM that kvzap supports."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"Expected a transformers PreTrainedModel (e.g. from AutoModelForCausalLM.from_pretrained), "
            f"got {type(model).__name__}."
        )
    model_type = getattr(text_config(model), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Model type {model_type!r} is not supported by kvzap; supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "Other decoder-only models with a `self_attn.layer_idx` usually work but are untested: open an issue."
        )
    attention_modules(model)  # raises if the layout is unexpected


def new_dynamic_cache(model: PreTrainedModel) -> DynamicCache:
    """A DynamicCache whose layers follow the model's config (sliding-window layers included)."""
    return DynamicCache(config=model.config)


def padded_rows(attention_mask: torch.Tensor | None) -> bool:
    """True when a 2-D attention mask marks padding (any zero)."""
    return attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())
