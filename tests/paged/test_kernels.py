"""The fused CPU decode kernel against the generic paged attention, its use by the compact cache, and its fallback.

The kernel is compiled on first use (a C++ compiler and ninja are needed). Where it cannot be built these tests
are skipped, unless ``KVZAP_REQUIRE_KERNELS=1`` (set by CI), which turns a failed build into a failure.
"""

import logging
import os
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvzap import _compat
from kvzap.compact import CompactLayer
from kvzap.paged import kernels
from kvzap.paged.attention import paged_attention
from kvzap.presses.baseline_scorers import RandomScorer
from kvzap.presses.threshold import DMSThresholdPress
from tests.conftest import random_ids, tiny_model
from tests.paged.test_attention import _random_layout


@pytest.fixture(scope="module")
def op():
    try:
        return kernels.build()
    except Exception as exc:
        if os.environ.get("KVZAP_REQUIRE_KERNELS") == "1":
            raise
        pytest.skip(f"the CPU decode kernel cannot be built here: {exc}")


@pytest.fixture
def kernel_state():
    """Restore the module's switches after a test that changes them."""
    saved = (kernels._enabled, kernels._op, kernels._error)
    yield
    kernels._enabled, kernels._op, kernels._error = saved


def _pool(generator, bsz, kv_heads, lengths, bs, d, dtype=torch.float32, extra_blocks=3):
    """A random block layout (owners shuffled, free slots in between) followed by unused blocks, as in a pool."""
    keys, values, positions, bias, owner, _ = _random_layout(generator, bsz, kv_heads, lengths, bs, d)
    nu, nh = keys.shape[0], bsz * kv_heads
    pad = (extra_blocks, bs)
    keys = torch.cat([keys, torch.randn(*pad, d, generator=generator)]).to(dtype)
    values = torch.cat([values, torch.randn(*pad, d, generator=generator)]).to(dtype)
    positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int32)])
    bias = torch.cat([bias, torch.full(pad, float("-inf"))]).to(dtype)
    owner = torch.cat([owner, torch.full((extra_blocks,), nh)])
    return keys, values, positions, bias, owner, nu


@pytest.mark.parametrize(
    "bsz, kv_heads, groups, bs, d, lengths",
    [
        (1, 3, 3, 64, 64, [700, 300, 1500]),  # SmolLM2's shape: AVX path, several chunks per head
        (2, 2, 4, 16, 32, [40, 3, 17, 90]),
        (1, 1, 4, 64, 256, [200]),  # Gemma 3's head size
        (2, 3, 2, 5, 8, [5, 9, 4, 13, 7, 6]),  # a block size that is not a multiple of 8
        (1, 2, 2, 8, 12, [30, 11]),  # a head size that is not a multiple of 8: the generic loops
    ],
)
def test_the_kernel_equals_the_generic_paged_attention(op, bsz, kv_heads, groups, bs, d, lengths):
    generator = torch.Generator().manual_seed(0)
    keys, values, positions, bias, owner, nu = _pool(generator, bsz, kv_heads, lengths, bs, d)
    query = torch.randn(bsz, kv_heads * groups, 1, d, generator=generator)
    expected = paged_attention(query, keys[:nu], values[:nu], positions[:nu], bias[:nu], owner[:nu], kv_heads, 0.3)
    out = op(query, keys, values, bias, owner, positions, None, nu, kv_heads, 0.3)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_reads_a_mask_at_the_stored_positions(op):
    generator = torch.Generator().manual_seed(1)
    keys, values, positions, bias, owner, nu = _pool(generator, 3, 2, [70, 20, 33, 64, 9, 41], 16, 16)
    query = torch.randn(3, 4, 1, 16, generator=generator)
    mask = torch.rand(3, 1, 80, generator=generator) > 0.4
    mask[:, :, 0] = True
    args = (keys[:nu], values[:nu], positions[:nu], bias[:nu], owner[:nu], 2, 0.25)
    expected = paged_attention(query, *args, mask=mask)
    out = op(query, keys, values, bias, owner, positions, mask[:, 0].contiguous(), nu, 2, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_head_with_no_pair_gives_nan_as_sdpa_and_half_precision_is_served(op):
    generator = torch.Generator().manual_seed(2)
    keys, values, positions, bias, owner, nu = _pool(generator, 1, 2, [30, 12], 8, 16)
    bias[owner == 1] = float("-inf")  # head 1 has blocks but nothing live
    query = torch.randn(1, 4, 1, 16, generator=generator)
    out = op(query, keys, values, bias, owner, positions, None, nu, 2, 0.25)
    assert torch.isnan(out[0, 2:]).all() and not torch.isnan(out[0, :2]).any()
    for dtype in (torch.bfloat16, torch.float16):
        cast = [t.to(dtype) for t in (query, keys, values, bias)]
        q, k, v, b = cast
        expected = paged_attention(q, k[:nu], v[:nu], positions[:nu], b[:nu], owner[:nu], 2, 0.25)
        got = op(cast[0], cast[1], cast[2], cast[3], owner, positions, None, nu, 2, 0.25)
        assert got.dtype == dtype
        torch.testing.assert_close(got[0, :2].float(), expected[0, :2].float(), rtol=2e-2, atol=2e-2)


def test_the_kernel_refuses_bad_input(op):
    keys, values = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    bias, owner, positions = torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query must be"):
        op(torch.zeros(1, 2, 3, 8), keys, values, bias, owner, positions, None, 2, 1, 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(torch.zeros(1, 2, 1, 8, dtype=torch.float64), keys, values, bias, owner, positions, None, 2, 1, 1.0)
    with pytest.raises(RuntimeError, match="num_used"):
        op(torch.zeros(1, 2, 1, 8), keys, values, bias, owner, positions, None, 3, 1, 1.0)


def _decode(model, batch=2, n_decode=6):
    press = DMSThresholdPress(RandomScorer(seed=0), threshold=0.0, sliding_window_size=4, decoding=True)
    cache, kw, logits = DynamicCache(config=model.config), _compat.cache_kwarg_name(model), []
    with torch.no_grad(), press(model):
        logits.append(model(random_ids(batch, 60, seed=1), **{kw: cache}).logits)
        for _ in range(n_decode):
            logits.append(model(logits[-1][:, -1:].argmax(-1), **{kw: cache}).logits)
    assert any(isinstance(layer, CompactLayer) for layer in cache.layers)
    return logits, press.compression_ratio


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_decoding_with_and_without_the_kernel_gives_the_same_logits(op, kernel_state, family, monkeypatch):
    model = tiny_model(family)
    calls = []
    real = kernels.decode_kernel

    def counting():
        found = real()
        if found is not None:
            calls.append(1)
        return found

    monkeypatch.setattr("kvzap.compact.decode_kernel", counting)
    kernels.set_kernels(True)
    with_kernel, ratio_kernel = _decode(model)
    assert calls, "the compact cache never used the kernel"
    kernels.set_kernels(False)
    calls.clear()
    generic, ratio_generic = _decode(model)
    assert not calls
    assert ratio_kernel == ratio_generic and 0.1 < ratio_kernel < 0.9
    for step, (a, b) in enumerate(zip(generic, with_kernel, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_turned_off_by_the_environment_or_set_kernels(kernel_state, monkeypatch):
    kernels.set_kernels(None)
    monkeypatch.setenv("KVZAP_KERNELS", "0")
    assert kernels.decode_kernel() is None and kernels.kernel_status() == "off"
    monkeypatch.setenv("KVZAP_KERNELS", "1")
    kernels.set_kernels(False)
    assert kernels.decode_kernel() is None and kernels.kernel_status() == "off"
    with pytest.raises(TypeError, match="True, False or None"):
        kernels.set_kernels("yes")


def test_a_failed_build_falls_back_to_the_generic_path_once_with_a_reason(kernel_state, monkeypatch, caplog):
    kernels.set_kernels(True)
    kernels._op, kernels._error = None, None
    attempts = []

    def failing_load():
        attempts.append(1)
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(kernels, "_load", failing_load)
    with caplog.at_level(logging.WARNING, logger="kvzap.paged.kernels"):
        assert kernels.decode_kernel() is None
        assert kernels.decode_kernel() is None
    assert len(attempts) == 1  # not retried at every decoding step
    assert "Ninja is required" in kernels.kernel_status()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    # The compact cache then decodes with the generic path.
    logits, ratio = _decode(tiny_model("llama"))
    assert torch.isfinite(logits[-1]).all() and 0.1 < ratio < 0.9


def test_the_operator_has_a_shape_function_for_tracing(op):
    keys, values = torch.zeros(2, 4, 8, device="meta"), torch.zeros(2, 4, 16, device="meta")
    bias, owner = torch.zeros(2, 4, device="meta"), torch.zeros(2, dtype=torch.long, device="meta")
    positions = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    out = op(torch.zeros(3, 6, 1, 8, device="meta"), keys, values, bias, owner, positions, None, 2, 2, 1.0)
    assert out.shape == (3, 6, 1, 16) and out.device.type == "meta"


def test_a_stale_build_lock_is_removed_and_a_young_one_waited_for(tmp_path, caplog):
    """torch's build lock has no owner: one left by a killed process must not hang every later load."""
    import threading
    import time

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * kernels.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert "killed" in caplog.text

    # A young lock is another process's load: waited for until its owner removes it, and left to the owner.
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    start = time.perf_counter()
    kernels._clear_stale_lock(tmp_path, poll=0.02)
    assert 0.25 < time.perf_counter() - start < 5

    # A young lock nobody removes is removed once it is older than stale_after.
    lock.touch()
    start = time.perf_counter()
    kernels._clear_stale_lock(tmp_path, stale_after=0.3, poll=0.02)
    assert not lock.exists()
    assert 0.25 < time.perf_counter() - start < 5
    kernels._clear_stale_lock(tmp_path)  # no lock: returns at once
    kernels._clear_stale_lock(None)


def test_the_build_folder_is_keyed_by_the_include_paths_flags_torch_and_source(tmp_path, monkeypatch):
    """Two environments with the same torch version but their own include paths (or torch install) build into two
    folders, and the same inputs always name the same folder: no environment rebuilds another's kernel."""
    args = dict(source="int main() {}", cflags=["-O3"], torch_path="/env/a/torch")
    first = kernels.extension_name(include_paths=["/env/a/include"], **args)
    second = kernels.extension_name(include_paths=["/env/b/include"], **args)
    assert first != second
    assert first == kernels.extension_name(include_paths=["/env/a/include"], **args)
    assert first.startswith(kernels._EXTENSION)
    others = [
        kernels.extension_name(include_paths=["/env/a/include"], **{**args, "torch_path": "/env/b/torch"}),
        kernels.extension_name(include_paths=["/env/a/include"], **{**args, "cflags": ["-O2"]}),
        kernels.extension_name(include_paths=["/env/a/include"], **{**args, "source": "int main() { return 1; }"}),
    ]
    assert len({first, *others}) == 4
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch makes the folders: not in the real cache
    folders = {kernels._build_folder(name) for name in (first, second)}
    assert len(folders) == 2 and None not in folders
    assert kernels._build_folder(first) == kernels._build_folder(first)
    # This process's name covers this environment's include paths and torch install.
    assert kernels.extension_name() == kernels.extension_name(
        kernels._SOURCE.read_text(),
        kernels._cflags(),
        kernels._include_paths(),
        str(Path(torch.__file__).resolve().parent),
    )
