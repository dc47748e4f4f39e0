"""How much of a KV cache's memory a press freed, measured by walking what the cache holds.

:func:`cache_bytes` follows every object reachable from the cache (attributes, ``__slots__``, dicts, lists,
tuples, sets, deques) and adds up each tensor *storage* it meets, once and whole (a small view of a large tensor
keeps all of it alive), plus NumPy arrays by their owning array. It asks no layer for its own accounting, so it
counts what a process really keeps alive for the cache: storage, masks, block tables, bookkeeping and the press's
per-sequence state alike. Modules (model weights), classes, functions and weak references are not followed.

:func:`freed_share` compares that with the same tokens in an unpruned dense cache: the share of the *whole*
cache's bytes that eviction freed. Unlike ``press.compression_ratio`` (the share of the pruned layers' pairs
evicted) it counts the layers left alone (sliding-window layers keep their bounded storage) and the compact
storage's own overhead, so it can be slightly negative when little is evicted.
"""

from __future__ import annotations

import collections
import types
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import Cache

from kvzap.cache import kv_bytes

__all__ = ["cache_bytes", "freed_share"]

_NOT_FOLLOWED = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    weakref.ReferenceType,
    nn.Module,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
)


def cache_bytes(root: Any) -> int:
    """Bytes of every tensor storage and NumPy array reachable from ``root`` (a cache, a snapshot ...), each once.

    Parameters
    ----------
    root : any object; typically a ``transformers.Cache`` after a forward under a press.

    Returns
    -------
    int: device tensor bytes plus host NumPy bytes.
    """
    if root is None:
        raise TypeError("cache_bytes needs an object to measure (a cache, a snapshot ...), got None.")
    visited: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    arrays: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in visited or isinstance(obj, _NOT_FOLLOWED):
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse or meta tensors own no plain storage
                continue
            if storage.data_ptr():  # empty storages hold nothing
                storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, np.ndarray):
            owner = obj
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            arrays[id(owner)] = owner.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.append(attrs)
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if isinstance(name, str) and hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return sum(storages.values()) + sum(arrays.values())


def freed_share(cache: Cache) -> float:
    """Share of the whole cache's memory freed by eviction: ``1 - cache_bytes(cache) / full``.

    ``full`` is the bytes of the same tokens in an unpruned dense cache (every layer: the pairs it would store
    without eviction, a sliding-window layer its window), as :func:`kvzap.cache.kv_bytes` computes it.

    Raises
    ------
    ValueError
        When the cache holds no pair yet.
    """
    if not isinstance(cache, Cache):
        raise TypeError(
            f"freed_share takes a transformers Cache (the `past_key_values` of a forward), got {type(cache).__name__}."
        )
    full = kv_bytes(cache).full
    if full == 0:
        raise ValueError("The cache holds no key or value yet: run a forward pass with it before measuring it.")
    return 1.0 - cache_bytes(cache) / full
