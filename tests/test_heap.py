"""Giving freed host memory back to the system (``kvzap.heap``), measured by the process's resident memory."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import DynamicCache

import kvzap.compact
import kvzap.heap as heap
from benchmarks.common import resident_mb
from kvzap import DMSThresholdPress, RandomScorer, _compat
from tests.conftest import random_ids, tiny_model

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
LINUX = platform.system() == "Linux"
MIB = 2**20


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


def test_release_trims_when_resident_memory_outgrows_the_pools(monkeypatch):
    """The trim runs when anonymous resident memory, net of the pools kept since the last trim, has risen more than
    ``min_bytes`` above its lowest point; growth that the pools explain, or memory the caller freed, does not."""
    calls, anon = [], [0]
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(anon[0]) or True)
    monkeypatch.setattr(heap, "_rss_anon", lambda: anon[0])
    heap.set_heap_release(100)
    anon[0] = 1000
    heap.release_freed(50, "cpu", kept=0)  # the first reading sets the floor
    anon[0] = 1300
    heap.release_freed(50, "cpu", kept=250)  # +300 of which 250 kept: 50 of excess
    assert calls == []
    anon[0] = 900
    heap.release_freed(50, "cpu", kept=0)  # the caller freed memory: the floor goes down
    assert calls == []
    anon[0] = 1100
    heap.release_freed(50, "cpu", kept=0)  # 200 above the lowest point, nothing kept: trim
    assert calls == [1100]
    anon[0] = 1180
    heap.release_freed(50, "cpu", kept=0)  # the first reading after the trim sets the floor: the working set that
    assert calls == [1100]  # faulted back in since the trim is not growth
    anon[0] = 1250
    heap.release_freed(50, "cpu", kept=0)
    assert calls == [1100]
    anon[0] = 1300
    heap.release_freed(50, "cpu", kept=0)  # 120 above the new floor: trim
    assert calls == [1100, 1300]
    heap.release_freed(10**9, "meta")  # not host memory
    heap.set_heap_release(None)
    anon[0] = 10**12
    heap.release_freed(10**9, "cpu")
    assert calls == [1100, 1300]


def test_without_proc_the_trim_follows_the_dropped_bytes(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(heap, "_rss_anon", lambda: None)
    heap.set_heap_release(100)
    heap.release_freed(60, "cpu")
    assert calls == []
    heap.release_freed(60, torch.device("cpu"))
    assert calls == [1]
    heap.release_freed(60, "cpu")  # the count restarted after the trim
    assert calls == [1]


def test_resident_anonymous_memory_is_read():
    if not LINUX:
        pytest.skip("/proc is Linux's")
    before = heap._rss_anon()
    block = torch.ones(64 * MIB // 4)  # 64 MiB, every page touched
    assert heap._rss_anon() - before >= 60 * MIB
    del block


@pytest.mark.parametrize("bad", [-1, 1.5, "32M", True])
def test_bad_cadence_is_refused(bad):
    with pytest.raises(ValueError, match="min_bytes must be a non-negative integer or None"):
        heap.set_heap_release(bad)


@torch.no_grad()
def test_a_compact_prefill_reports_each_layers_dense_pairs(monkeypatch):
    """The prompt's dense keys and values of every layer are reported once they are dropped; decoding reports
    nothing (its pairs go straight into the pool)."""
    noted = []
    monkeypatch.setattr(
        kvzap.compact, "release_freed", lambda nbytes, device, kept: noted.append((nbytes, str(device)))
    )
    monkeypatch.setattr(kvzap.compact, "release_pages", lambda tensors: tensors.clear() or 0)
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


# --- the dropped tensors' own pages ---------------------------------------------------------------------------------


def _release_one(tensor_factory):
    """Bytes released for the tensor that ``tensor_factory`` makes, when the list holds its last reference."""
    tensors = [tensor_factory()]
    return heap.release_pages(tensors)


@pytest.mark.skipif(not LINUX, reason="madvise is Linux's")
def test_pages_of_a_tensor_or_view_held_by_nobody_else_are_released():
    size = 4 * MIB
    plain = _release_one(lambda: torch.ones(size // 4))
    # The values of an attention layer: a transposed view of a projection's output, which nothing else holds.
    view = _release_one(lambda: torch.ones(1, size // 4 // 192, 192).view(1, -1, 3, 64).transpose(1, 2))
    page = 4096
    assert size - 2 * page <= plain <= size
    assert size - 2 * page <= view <= size


@pytest.mark.skipif(not LINUX, reason="madvise is Linux's")
def test_memory_that_something_else_can_read_is_never_released():
    """Each case keeps a way to the data (a second reference, a view, the base of a view, a slice, autograd) and
    must find it intact: nothing released, nothing zeroed."""
    n = MIB  # 4 MiB of float32
    cases = {}
    a = torch.full((n,), 3.0)
    cases["second reference"] = (a, a)
    b = torch.full((n,), 3.0)
    cases["a view of it alive"] = (b, b[10:])
    base = torch.full((1, n // 192, 192), 3.0)
    cases["its base held (a hook's capture)"] = (base.view(1, -1, 3, 64).transpose(1, 2), base)
    c = torch.full((n,), 3.0)
    cases["a slice of a larger tensor"] = (c[: n // 2], c)
    d = torch.full((n,), 3.0, requires_grad=True)
    cases["autograd"] = (d, d)
    del a, b, base, c, d
    for name, (tensor, witness) in cases.items():
        tensors = [tensor]
        del tensor
        assert heap.release_pages(tensors) == 0, name
        assert tensors == []
        assert bool((witness == 3.0).all()), f"{name}: data zeroed"
    cases.clear()


def test_pages_off_or_not_host_memory_releases_nothing():
    heap.set_heap_release(pages=False)
    assert _release_one(lambda: torch.ones(MIB)) == 0
    heap.set_heap_release()
    assert _release_one(lambda: torch.ones(MIB, device="meta")) == 0
    assert _release_one(lambda: torch.ones(1024)) == 0  # below 64 KiB: not worth a system call
    with pytest.raises(ValueError, match="pages must be True or False"):
        heap.set_heap_release(pages="yes")


@pytest.mark.skipif(not (LINUX and GLIBC), reason="glibc's mallopt and madvise")
@pytest.mark.parametrize("pages", [True, False])
def test_released_pages_leave_the_processs_resident_memory(pages):
    """Outside measure, in a fresh process: a 64 MiB tensor served from glibc's heap (mmap threshold raised) and
    pinned below the heap's top, so that free() alone keeps its pages resident; only ``release_pages`` returns
    them (the trim is off)."""
    script = textwrap.dedent(
        f"""
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 512 * 2**20)  # M_MMAP_THRESHOLD: 512 MiB, so the tensor comes from the heap
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: free() never shrinks the heap by itself
        import torch
        import kvzap.heap as heap
        from benchmarks.common import resident_mb
        heap.set_heap_release(None, pages={pages})
        tensors = [torch.ones(16 * 2**20)]  # 64 MiB, every page touched
        libc.malloc.restype = ctypes.c_void_p
        pin = libc.malloc(64 * 1024)  # above it in the heap
        before = resident_mb()
        released = heap.release_pages(tensors)
        print(released, before - resident_mb())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=_root())
    released, dropped_mb = out.stdout.split()
    if pages:
        assert int(released) >= 63 * MIB
        assert float(dropped_mb) >= 60, f"RSS dropped by {dropped_mb} MiB only"
    else:
        assert int(released) == 0
        assert float(dropped_mb) < 8, f"RSS dropped by {dropped_mb} MiB without a release"


def _root():
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1])


@torch.no_grad()
@pytest.mark.skipif(not LINUX, reason="madvise is Linux's")
def test_a_compact_prefill_releases_its_dense_pairs_and_leaves_captured_activations_alone(monkeypatch):
    """A dense prefill gives back the pages of every layer's keys and values (all of them: the values are views of
    a projection's output that nothing else holds). A forward hook that keeps the value projection's output (an
    interpretability tool's capture) holds the values' memory: those are left alone, and the capture reads the
    same numbers as a copy taken in the hook."""
    released = []
    real = kvzap.heap.release_pages
    monkeypatch.setattr(kvzap.compact, "release_pages", lambda tensors: released.append(real(tensors)) or released[-1])
    model = tiny_model("llama", hidden_size=256, intermediate_size=256)  # head_dim 64
    cfg = model.config
    ids = random_ids(1, 600)
    press = DMSThresholdPress(RandomScorer(seed=0), threshold=0.0)
    kw = _compat.cache_kwarg_name(model)
    with press(model):
        model(ids, **{kw: DynamicCache(config=cfg)})
    dense = cfg.num_key_value_heads * 600 * 64 * 4  # keys, or values, of one layer
    assert len(released) == cfg.num_hidden_layers
    assert all(2 * dense - 4 * 4096 <= r <= 2 * dense for r in released)

    captured, copies = [], []

    def capture(module, args, output):
        captured.append(output)
        copies.append(output.clone())

    released.clear()
    handles = [layer.self_attn.v_proj.register_forward_hook(capture) for layer in model.model.layers]
    try:
        with press(model):
            model(ids, **{kw: DynamicCache(config=cfg)})
    finally:
        for h in handles:
            h.remove()
    assert all(dense - 2 * 4096 <= r <= dense for r in released)  # the keys only
    for kept, copy in zip(captured, copies, strict=True):
        torch.testing.assert_close(kept, copy, rtol=0, atol=0)
