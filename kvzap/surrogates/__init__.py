"""Surrogate models that score KV pairs from hidden states, with save/load in the published format."""

from kvzap.surrogates.bundled import bundled_surrogate_dir, list_bundled
from kvzap.surrogates.checkpoint import SurrogateNotFoundError
from kvzap.surrogates.fastkvzip import FastKVzipGate, FastKVzipGates
from kvzap.surrogates.kvzap_surrogate import KVzapSurrogate

__all__ = [
    "KVzapSurrogate",
    "FastKVzipGate",
    "FastKVzipGates",
    "SurrogateNotFoundError",
    "bundled_surrogate_dir",
    "list_bundled",
]
