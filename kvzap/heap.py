"""Give the host memory that eviction freed back to the operating system.

Freeing a CPU tensor returns its memory to the C allocator, not to the system. glibc's malloc serves tensors below
its mmap threshold (dynamic, up to 32 MiB on 64-bit systems) from a heap that it only shrinks from the top, so the
dense keys and values that a compact cache drops after a prefill, freed in the middle of the heap among live
tensors, stay in the process's resident memory and the peak RSS of a pruned run is no lower than an unpruned one.
:func:`release_freed` counts the bytes that the compact storage drops and, every ``min_bytes`` of them, calls
glibc's ``malloc_trim(0)``, which hands every whole free page of every arena back to the kernel.

This is a host (CPU) matter: tensors on an accelerator are not counted. On a platform without glibc nothing is
called. :func:`set_heap_release` changes the cadence or turns it off.

Measured (BENCHMARKS.md, "Peak RSS"): SmolLM2-135M, 8k prefill + 256 decoded tokens, ~2/3 evicted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

import torch

__all__ = ["release_freed", "set_heap_release", "trim_heap"]

_DEFAULT_MIN_BYTES = 8 * 2**20

_lock = threading.Lock()
_min_bytes: int | None = _DEFAULT_MIN_BYTES
_pending = 0
_trim = None  # the C function once looked up; False when the platform has none


def set_heap_release(min_bytes: int | None = _DEFAULT_MIN_BYTES) -> None:
    """Release freed host memory to the system every ``min_bytes`` bytes of KV pairs dropped (None: never).

    Parameters
    ----------
    min_bytes : int or None, default 8 MiB. Smaller values trim more often (each trim costs a few milliseconds
        and later allocations fault their pages in again); None turns the release off.

    Raises
    ------
    ValueError
        When ``min_bytes`` is negative or not an integer.
    """
    global _min_bytes, _pending
    if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0):
        raise ValueError(f"min_bytes must be a non-negative integer or None, got {min_bytes!r}.")
    with _lock:
        _min_bytes, _pending = min_bytes, 0


def _malloc_trim():
    global _trim
    if _trim is None:
        _trim = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _trim = libc.malloc_trim
                _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                _trim = False
    return _trim


def trim_heap() -> bool:
    """Hand the allocator's free pages back to the system now; True when some memory was released.

    False where the C library has no ``malloc_trim`` (not glibc).
    """
    trim = _malloc_trim()
    return bool(trim and trim(0))


def release_freed(nbytes: int, device: torch.device | str) -> None:
    """Note that ``nbytes`` of KV pairs on ``device`` were just dropped; trim the heap when enough have been."""
    global _pending
    if torch.device(device).type != "cpu" or _min_bytes is None:
        return
    with _lock:
        _pending += nbytes
        if _pending < _min_bytes:
            return
        _pending = 0
    trim_heap()
