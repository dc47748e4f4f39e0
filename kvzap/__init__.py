"""kvzap: adaptive KV-cache pruning (KVzap, arXiv 2601.07891) for Hugging Face transformers.

Importing kvzap registers the ``kv-press-text-generation`` pipeline task and does nothing else global: the
attention function is registered, and a model switched to it, only while a press is applied.
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

__version__ = "0.1.0"

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
