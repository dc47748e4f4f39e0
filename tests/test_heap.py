"""Giving freed host memory back to the system (``kvzap.heap``), measured by the process's resident memory."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
from transformers import DynamicCache

import kvzap.compact
import kvzap.heap as heap
from benchmarks.common import resident_mb
from kvzap import DMSThresholdPress, RandomScorer, _compat
from tests.conftest import random_ids, tiny_model

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.fixture(autouse=True)
def default_cadence():
    yield
    heap.set_heap_release()


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_gives_back_pages_freed_in_the_middle_of_the_heap():
    """64 KiB blocks (below glibc's smallest mmap threshold: always from the heap), each followed by a 4 KiB block
    (too large for glibc's per-thread caches, so it comes from the heap right after) that stays allocated: free()
    alone cannot shrink the heap, only the trim returns their pages."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    big, pins, n, size = [], [], 2000, 64 * 1024  # 125 MiB
    for _ in range(n):
        big.append(libc.malloc(size))
        libc.memset(big[-1], 1, size)  # touch every page
        pins.append(libc.malloc(4096))
    for p in big:
        libc.free(p)
    before = resident_mb()
    assert heap.trim_heap()
    released = (before - resident_mb()) * 2**20
    for p in pins:
        libc.free(p)
    assert released > 0.8 * n * size, f"the trim gave back {released / 2**20:.0f} MiB of {n * size / 2**20:.0f}"


def test_release_trims_every_min_bytes_of_cpu_pairs(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    heap.set_heap_release(100)
    heap.release_freed(60, "cpu")
    assert calls == []
    heap.release_freed(60, torch.device("cpu"))
    assert calls == [1]
    heap.release_freed(60, "cpu")  # the count restarted after the trim
    assert calls == [1]
    heap.release_freed(10**9, "meta")  # not host memory
    assert calls == [1]
    heap.set_heap_release(None)
    heap.release_freed(10**9, "cpu")
    assert calls == [1]


@pytest.mark.parametrize("bad", [-1, 1.5, "32M", True])
def test_bad_cadence_is_refused(bad):
    with pytest.raises(ValueError, match="min_bytes must be a non-negative integer or None"):
        heap.set_heap_release(bad)


@torch.no_grad()
def test_a_compact_prefill_reports_each_layers_dense_pairs(monkeypatch):
    """The prompt's dense keys and values of every layer are reported once they are dropped; decoding reports
    nothing (its pairs go straight into the pool)."""
    noted = []
    monkeypatch.setattr(kvzap.compact, "release_freed", lambda nbytes, device: noted.append((nbytes, str(device))))
    model = tiny_model("llama")
    cfg = model.config
    press = DMSThresholdPress(RandomScorer(seed=0), threshold=0.0, decoding=True)
    ids = random_ids(1, 300)
    cache = DynamicCache(config=cfg)
    kw = _compat.cache_kwarg_name(model)
    with press(model):
        model(ids, **{kw: cache})
        assert len(noted) == cfg.num_hidden_layers
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dense = 2 * cfg.num_key_value_heads * 300 * head_dim * 4
        assert noted == [(dense, "cpu")] * cfg.num_hidden_layers
        model(ids[:, :1], **{kw: cache})
    assert len(noted) == cfg.num_hidden_layers
