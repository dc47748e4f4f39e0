"""kvzap: adaptive KV-cache pruning (KVzap, arXiv 2601.07891) for Hugging Face transformers.

Importing kvzap registers the ``kv-press-text-generation`` pipeline task and does nothing else global: the
attention function is registered, and a model switched to it, only while a press is applied.

Which file holds what (each layer imports only the ones above it in this list):

- ``_compat.py``: every transformers internal kvzap relies on; ``layers.py``: which attention layers are pruned;
  ``heap.py``: giving freed host memory back to the operating system;
- ``surrogates/``: the KVzap surrogates and Fast KVzip gates, their checkpoints and the bundled weights;
- ``prunable.py``: the cache-layer interface presses use, with its snapshot rules; ``cache.py``: the masked
  storage and whole-cache operations (checkpoints, bytes); ``compact.py``: the compact storage that frees evicted
  pairs, built on ``paged/`` (block table, pool, paged attention, the fused decode kernel);
- ``attention.py``: the attention function registered with transformers, reading the bound cache layer;
- ``kvzip.py``: the KVzip+ oracle scores of a context; ``prompts.py``: how a prompt opens;
- ``presses/``: scorers and presses (``with press(model):``);
- ``calibrate.py``: the threshold for a target compression ratio; ``memory.py``: the memory a press freed;
  ``models.py``: model loaders (bundled GGUF models, any GGUF file, any causal LM);
- ``pipeline.py``: the ``kv-press-text-generation`` pipeline; ``cli.py``: the ``kvzap`` command line.
"""

from kvzap.cache import MaskedLayer, MaskedSlidingWindowLayer, PrunableLayer
from kvzap.pipeline import KVPressTextGenerationPipeline, register_pipeline
from kvzap.presses import (
    BasePress,
    ConstantScorer,
    DMSThresholdPress,
    FastKVzipScorer,
    KeyNormScorer,
    KVzapScorer,
    KVzipPlusScorer,
    RandomScorer,
    RecencyScorer,
    Scorer,
    TopKPress,
)
from kvzap.surrogates import FastKVzipGates, KVzapSurrogate, SurrogateNotFoundError

__version__ = "0.2.0"

# The names used by the KVzap README and model cards (kvpress), so seed code runs with only the import changed.
KVzapPress = KVzapScorer
DMSPress = DMSThresholdPress

register_pipeline()

__all__ = [
    "BasePress",
    "Scorer",
    "KVzapScorer",
    "KVzapPress",
    "DMSThresholdPress",
    "DMSPress",
    "TopKPress",
    "RandomScorer",
    "KeyNormScorer",
    "RecencyScorer",
    "ConstantScorer",
    "KVzapSurrogate",
    "FastKVzipGates",
    "FastKVzipScorer",
    "KVzipPlusScorer",
    "SurrogateNotFoundError",
    "KVPressTextGenerationPipeline",
    "PrunableLayer",
    "MaskedLayer",
    "MaskedSlidingWindowLayer",
]
