"""Memory measured from outside kvzap: what the process really holds, without asking the library.

Nothing here imports kvzap or calls its accounting (``kv_bytes``, ``physical_bytes``, statistics). Three measures:

- :func:`reachable_bytes` walks every object reachable from a root (attributes, ``__slots__``, dicts, lists,
  tuples, sets, deques) and adds up the *storages* of the tensors it meets, each storage once and whole (a view of
  a large tensor keeps all of it alive, so it counts all of it), plus NumPy arrays (host memory, by their owning
  array). A tensor subclass that wraps others (``__tensor_flatten__``, e.g. optimum-quanto's packed int4/int2
  tensors, whose own storage cannot be read) counts the storages of its inner tensors, recursively; HQQ's
  quantized states (a packed tensor and a dict of scales and zeros) are plain tensors in a tuple and a dict.
  Modules (model weights), classes, functions and weak references are not followed.
- :func:`live_bytes` adds up every tensor storage alive in the process (``gc.get_objects()``), minus the given
  storages (the model's parameters and buffers).
- :class:`LayerExitSampler` samples :func:`live_bytes` at the exit of every decoder layer of a model (a forward hook
  on each layer, registered outside any press), so the peak during a forward is measured deterministically; the
  difference with the same forward run without a cache (``use_cache=False``) is the memory the KV cache and its
  pruning cost at that point.

Used by ``tests/test_outside_memory.py`` and by the benchmarks.
"""

from __future__ import annotations

import collections
import gc
import types
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "Bytes",
    "reachable_bytes",
    "live_bytes",
    "model_storage_keys",
    "LayerExitSampler",
    "full_cache_bytes",
    "decoder_layers",
]


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, meta and wrapper-subclass tensors have no plain storage
        return None
    if ptr == 0:
        return None  # empty storage
    return (str(t.device), ptr)


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass is made of (``__tensor_flatten__``: quanto's packed tensors hold their bits,
    scales and shifts in inner tensors, and the wrapper itself has no storage); empty for a plain tensor."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return []
    try:
        names, _ = t.__tensor_flatten__()
    except (NotImplementedError, TypeError, RuntimeError):
        return []
    return [inner for inner in (getattr(t, name, None) for name in names) if isinstance(inner, torch.Tensor)]


def _numpy_owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class Bytes(collections.namedtuple("Bytes", "device host")):
    """Bytes of tensor storages (``device``: torch tensors, on any device) and NumPy arrays (``host``)."""

    @property
    def total(self) -> int:
        return self.device + self.host


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


def reachable_bytes(root: Any, exclude: set | None = None) -> Bytes:
    """Bytes of every tensor storage and NumPy array reachable from ``root`` (each counted once, whole).

    Parameters
    ----------
    root : any object (a cache, a snapshot, a list of them ...).
    exclude : storage keys (see :func:`model_storage_keys`) not to count, e.g. the model's weights.
    """
    exclude = exclude or set()
    seen_objects: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    arrays: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, _NOT_FOLLOWED):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            inner = _inner_tensors(obj)
            if inner:  # a wrapper subclass: its inner tensors hold the bytes (walked the same way, recursively)
                stack.extend(inner)
                continue
            key = _storage_key(obj)
            if key is not None and key not in exclude:
                storages[key] = _storage_nbytes(obj)
            continue
        if isinstance(obj, np.ndarray):
            owner = _numpy_owner(obj)
            arrays[id(owner)] = owner.nbytes
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
            continue
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            stack.append(attrs)
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if isinstance(name, str) and hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return Bytes(sum(storages.values()), sum(arrays.values()))


def model_storage_keys(model: nn.Module) -> set:
    """Storage keys of a model's parameters and buffers (the weights are not KV memory)."""
    keys = set()
    for t in list(model.parameters()) + list(model.buffers()):
        key = _storage_key(t)
        if key is not None:
            keys.add(key)
    return keys


def live_bytes(exclude: set | None = None) -> int:
    """Bytes of every tensor storage alive in the process (each storage once), minus ``exclude``."""
    exclude = exclude or set()
    storages: dict[tuple[str, int], int] = {}
    with warnings.catch_warnings():  # isinstance() on some lazy module proxies warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in tensors:
        key = _storage_key(obj)
        if key is not None and key not in exclude:
            storages[key] = _storage_nbytes(obj)
    return sum(storages.values())


def _is_tensor(obj: Any) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a dead weak proxy
        return False


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers`` and its multimodal variants)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    base = getattr(base, "language_model", base)
    return base.layers


class LayerExitSampler:
    """Samples :func:`live_bytes` (weights excluded) at the exit of every decoder layer while active.

    ``samples`` lists ``(layer index, bytes)`` in call order; :attr:`peak` is their maximum.

    Example::

        with LayerExitSampler(model) as sampler:
            model(ids, past_key_values=cache)
        print(sampler.peak)
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.samples: list[tuple[int, int]] = []
        self._exclude = model_storage_keys(model)
        self._handles: list = []

    def _hook(self, index: int, module, args, output) -> None:
        self.samples.append((index, live_bytes(self._exclude)))

    def __enter__(self) -> LayerExitSampler:
        for i, layer in enumerate(decoder_layers(self.model)):
            self._handles.append(layer.register_forward_hook(lambda m, a, o, i=i: self._hook(i, m, a, o)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def by_layer(self) -> dict[int, int]:
        """Peak per decoder layer index over the samples taken."""
        out: dict[int, int] = {}
        for i, b in self.samples:
            out[i] = max(out.get(i, 0), b)
        return out


def full_cache_bytes(
    config, n_tokens: int, batch: int = 1, dtype: torch.dtype = torch.float32, layers: Iterable[int] | None = None
) -> int:
    """Bytes of an unpruned dense cache of ``n_tokens`` tokens, computed from the model config alone."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    n_layers = len(list(layers)) if layers is not None else cfg.num_hidden_layers
    return 2 * n_layers * batch * n_kv * n_tokens * head_dim * torch.finfo(dtype).bits // 8
