"""Surrogate models that score KV pairs from hidden states, with save/load in the published format.

Which file holds what:

- ``kvzap_surrogate.py``: :class:`KVzapSurrogate`, one linear or 2-layer MLP model per decoder layer;
- ``fastkvzip.py``: the Fast KVzip gates (:class:`FastKVzipGates`);
- ``checkpoint.py``: saving and loading checkpoints in the published ``nvidia/KVzap-*`` format;
- ``bundled.py``: finding the surrogates shipped in ``bundled/`` by model name, without network access.
"""

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
