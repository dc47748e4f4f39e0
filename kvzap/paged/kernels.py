"""Compiled kernels of the compact cache: a fused paged attention for decoding on CPU.

A decoding step of the compact cache reads, in every layer, the kept pairs of each head from the blocks it owns.
The generic :func:`~kvzap.paged.attention.paged_attention` does it in ~14 tensor operations whose fixed cost
(dispatch, allocation, Python) dominates at batch 1 on CPU: ~170 us per layer and step, where reading the pairs
takes tens of microseconds at 2k tokens. ``csrc/paged_decode.cpp`` does the same computation in one call
(a split softmax over chunks of each head's blocks, in torch's intra-op threads) and is registered as the torch
operator ``torch.ops.kvzap.paged_decode``. The same source registers ``torch.ops.kvzap.quantize_store``, which
writes a decoding step's appended pairs into a quantized pool (``kv_bits``) in one call per pool tensor instead of
~14 tensor operations.

It is compiled on first use with :func:`torch.utils.cpp_extension.load_inline` into torch's extension cache
(``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``): about 30-60 s once per machine and torch install.
The extension's name, hence its build folder, carries a hash of everything that changes the build (the source,
the compiler flags, torch's include paths, torch's install path and version, see :func:`extension_name`): two
virtual environments sharing the cache, even with the same torch version, each keep their own build instead of
rebuilding each other's.
That needs a C++ compiler and ninja (``pip install ninja``). Where either is missing, or the build fails, kvzap
logs why once and uses the generic path, which computes the same result.

Control:

- ``KVZAP_KERNELS=0`` in the environment, or :func:`set_kernels` ``(False)``, turns the kernel off (no build);
- :func:`build` compiles now (e.g. in a setup step), and raises if it cannot;
- :func:`kernel_status` says whether the kernel is in use, and why not.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

__all__ = ["build", "decode_kernel", "extension_name", "kernel_status", "quantize_kernel", "set_kernels"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_EXTENSION = "kvzap_paged_kernels"  # the stem of the extension's name (see extension_name)

_lock = threading.Lock()
_enabled: bool | None = None  # None: follow KVZAP_KERNELS (default on)
_op = None  # the loaded operator
_error: str | None = None  # why the kernel is not available (set once a build failed)


def set_kernels(enabled: bool | None) -> None:
    """Use the compiled kernels (True), never (False), or as ``KVZAP_KERNELS`` says (None, the default: on
    unless it is ``0``)."""
    global _enabled
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_kernels expects True, False or None, got {enabled!r}.")
    _enabled = enabled


def _wanted() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get("KVZAP_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _cflags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-std=c++17"]
    try:  # vector instructions this machine has (the build is local, and its cache is per source and flags)
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = ""
    if " avx2" in cpu and " fma" in cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def _include_paths() -> list[str]:
    """The include paths torch's extension builder passes to the compiler (those of this torch install)."""
    try:
        from torch.utils.cpp_extension import include_paths

        return [str(p) for p in include_paths()]
    except Exception:
        return []


def extension_name(
    source: str | None = None,
    cflags: list[str] | None = None,
    include_paths: list[str] | None = None,
    torch_path: str | None = None,
) -> str:
    """The extension's name: :data:`_EXTENSION` and a hash of the ``source``, the ``cflags``, the
    ``include_paths`` and torch's install path and version (each defaults to this process's).

    torch names the build folder after the extension, and rebuilds in place when its own check of sources and
    flags differs: without the hash, two environments with the same torch version would share one folder and
    rebuild it for each other in turn.
    """
    parts = [
        _SOURCE.read_text() if source is None else source,
        "\0".join(_cflags() if cflags is None else cflags),
        "\0".join(_include_paths() if include_paths is None else include_paths),
        str(Path(torch.__file__).resolve().parent) if torch_path is None else torch_path,
        torch.__version__,
    ]
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]
    return f"{_EXTENSION}_{digest}"


def _build_folder(name: str | None = None) -> Path | None:
    """The folder of the extension ``name`` (default :func:`extension_name`) in torch's extension cache, or None
    if torch's private helper is gone."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name or extension_name(), verbose=False))
    except Exception:
        return None


def _built(folder: Path | None) -> bool:
    """Whether a build of the extension is already in its ``folder`` of torch's extension cache (it may still be
    rebuilt if torch's own check of the source and flags says so: load_inline decides)."""
    return folder is not None and any(folder.glob(f"{_EXTENSION}*.so"))


STALE_LOCK_SECONDS = 300.0  # a build takes 30-60 s; a lock this old has no live owner


def _clear_stale_lock(folder: Path | None, stale_after: float = STALE_LOCK_SECONDS, poll: float = 0.5) -> None:
    """Wait for a build lock held by another process, and remove it once it is ``stale_after`` seconds old.

    torch's build lock is a bare file with no owner, taken by every ``load_inline`` (for the up-to-date check
    too, not only for a build). A process killed while it held it (Ctrl-C, ``kill``) leaves it behind, and every
    later load then waits for it forever, silently. A lock is waited for while it is young (another process may be
    building) and removed once older than any build.
    """
    if folder is None:
        return
    lock = folder / "lock"
    waited = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            logger.warning(
                "Removing %s, %.0f s old: a process was killed while it loaded kvzap's decode kernel.", lock, age
            )
            lock.unlink(missing_ok=True)
            return
        if not waited:
            logger.warning(
                "Waiting for %s (%.0f s old): another process is loading kvzap's decode kernel. If none is, delete "
                "the file; it is removed anyway once %.0f s old.",
                lock,
                age,
                stale_after,
            )
            waited = True
        time.sleep(poll)


def _load():
    global _op
    if hasattr(torch.ops.kvzap, "paged_decode"):
        _op = torch.ops.kvzap.paged_decode  # already registered in this process
        return _op
    from torch.utils.cpp_extension import load_inline

    start = time.perf_counter()
    source, cflags = _SOURCE.read_text(), _cflags()
    name = extension_name(source, cflags)
    folder = _build_folder(name)
    if not _built(folder):
        logger.warning(
            "Building kvzap's fused CPU decode kernel (once per machine and torch install, about 30-60 s; "
            "KVZAP_KERNELS=0 skips it and uses the generic path)."
        )
    _clear_stale_lock(folder)
    load_inline(
        name,
        cpp_sources=[source],
        extra_cflags=cflags,
        is_python_module=False,
        verbose=False,
    )
    _register_fake()
    _op = torch.ops.kvzap.paged_decode
    logger.info("kvzap's CPU decode kernel is ready (%.1f s)", time.perf_counter() - start)
    return _op


def _register_fake() -> None:
    """Shapes for tracing (torch.compile, meta tensors): the output is ``(B, Hq, 1, d_v)`` in the query's dtype."""

    def fake(
        query,
        keys,
        values,
        bias,
        owner,
        positions,
        mask,
        num_used,
        kv_heads,
        scale,
        key_scales=None,
        value_scales=None,
        bits=0,
    ):
        d_v = values.shape[-1] * (2 if bits == 4 else 1)  # 4-bit codes hold two channels per byte
        return query.new_empty(query.shape[0], query.shape[1], 1, d_v)

    def fake_store(codes, scales, slots, x, bits, group):  # writes in place, returns nothing
        return None

    for name, impl in (("kvzap::paged_decode", fake), ("kvzap::quantize_store", fake_store)):
        try:
            torch.library.register_fake(name, impl)
        except RuntimeError:  # already registered in this process
            pass


def _reason(exc: Exception) -> str:
    """Why a build failed, in one line (a compiler's log can be long: its first line)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def build():
    """Compile (or load from the cache) the CPU decode kernel now and return the operator; raises on failure."""
    global _error
    with _lock:
        if _op is not None:
            return _op
        try:
            return _load()
        except Exception as exc:
            _error = _reason(exc)
            raise


def decode_kernel():
    """The fused decode operator, or None (kernels turned off, or not buildable here: logged once)."""
    global _error
    if _op is not None:
        return _op if _wanted() else None
    if not _wanted() or _error is not None:
        return None
    with _lock:
        if _op is not None or _error is not None:
            return _op
        try:
            return _load()
        except Exception as exc:  # no compiler, no ninja, a failed build: the generic path serves
            _error = _reason(exc)
            logger.warning("kvzap's CPU decode kernel is unavailable (%s); using the generic path.", _error)
            return None


def quantize_kernel():
    """The fused quantize-and-store operator of the same extension (``torch.ops.kvzap.quantize_store``: appended
    pairs into a quantized pool's codes and scales, as :func:`kvzap.paged.quant.quantize` then a copy), or None
    when :func:`decode_kernel` is."""
    return None if decode_kernel() is None else torch.ops.kvzap.quantize_store


def kernel_status() -> str:
    """``"loaded"``, ``"off"`` (turned off), ``"not built"`` (not needed yet) or ``"unavailable: <why>"``."""
    if not _wanted():
        return "off"
    if _op is not None:
        return "loaded"
    if _error is not None:
        return f"unavailable: {_error}"
    return "not built"
