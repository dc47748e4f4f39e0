"""Give the host memory that eviction freed back to the operating system.

Freeing a CPU tensor returns its memory to the C allocator, not to the system. glibc's malloc serves tensors below
its mmap threshold (dynamic, up to 32 MiB on 64-bit systems) from a heap that it only shrinks from the top, so the
dense keys and values that a compact cache drops after a prefill, freed in the middle of the heap among live
tensors, stay in the process's resident memory and the peak RSS of a pruned run is no lower than an unpruned one.

Two ways back to the system:

- :func:`release_pages`: the pages of the dropped tensors themselves, just before they are freed, with
  ``madvise(MADV_DONTNEED)`` (Linux), when nothing else can read them (checked on the tensor's and its storage's
  reference counts: no other Python reference, no other tensor or view on the storage). Only those pages go;
  the rest of the heap keeps its pages, so later allocations do not fault them in again.
- :func:`release_freed`: after each layer, reads the process's anonymous resident memory and, when it has grown
  by more than the pools kept plus ``min_bytes`` since the last trim (freed memory the allocator keeps:
  fragmentation, or pairs that could not go the first way), calls glibc's ``malloc_trim(0)``, which hands every
  whole free page of every arena back to the kernel. A trim at every layer made the next
  allocations fault their pages in again, 5-10% of a prefill (BENCHMARKS.md); the rule trims only when needed.

This is a host (CPU) matter: tensors on an accelerator are not counted. On a platform without glibc nothing is
called. :func:`set_heap_release` changes the cadence or turns it off.

Measured (BENCHMARKS.md, "Peak RSS"): SmolLM2-135M, 8k prefill + 256 decoded tokens, ~2/3 evicted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import platform
import sys
import threading

import torch

__all__ = ["release_freed", "release_pages", "set_heap_release", "trim_heap"]

_DEFAULT_MIN_BYTES = 32 * 2**20

_lock = threading.Lock()
_min_bytes: int | None = _DEFAULT_MIN_BYTES
_pending = 0  # dropped bytes since the last trim (without /proc)
_floor: int | None = None  # lowest anonymous resident bytes at a release since the last trim, net of pools kept since
_kept = 0  # pool bytes kept since the last trim
_pages = True  # release_pages on (set_heap_release)
_MADV_DONTNEED = 4  # Linux
_MIN_PAGES_BYTES = 64 * 1024  # smaller tensors: not worth a system call


def set_heap_release(min_bytes: int | None = _DEFAULT_MIN_BYTES, *, pages: bool = True) -> None:
    """How dropped KV pairs go back to the system: their own pages (``pages``), and a heap trim whenever the
    process's resident memory outgrows the pools kept by more than ``min_bytes`` (None: never).

    Parameters
    ----------
    min_bytes : int or None, default 32 MiB: how much freed memory the allocator may keep resident (fragmentation)
        before a trim. Smaller values trim more often (each trim costs a few milliseconds, and later allocations
        fault their pages in again); None turns the trim off.
    pages : bool, default True. Give the dropped tensors' own pages back (:func:`release_pages`); False leaves
        every byte to the trim. ``set_heap_release(None, pages=False)`` keeps all freed memory in the allocator.

    Raises
    ------
    ValueError
        When ``min_bytes`` is negative or not an integer.
    """
    global _min_bytes, _pending, _pages, _floor, _kept
    if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0):
        raise ValueError(f"min_bytes must be a non-negative integer or None, got {min_bytes!r}.")
    if not isinstance(pages, bool):
        raise ValueError(f"pages must be True or False, got {pages!r}.")
    with _lock:
        _min_bytes, _pending, _pages, _floor, _kept = min_bytes, 0, pages, None, 0


@functools.cache
def _libc_function(name: str, argtypes: tuple, restype, glibc_only: bool = False):
    """The C library's function ``name`` with its signature set, looked up once; None off Linux (or off glibc when
    ``glibc_only``) or where the library lacks it."""
    if platform.system() != "Linux" or (glibc_only and platform.libc_ver()[0] != "glibc"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function


def _malloc_trim():
    return _libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int, glibc_only=True)


def _libc_madvise():
    return _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)


def _holders(tensor: torch.Tensor) -> tuple:
    """What can reach ``tensor``'s memory, as counts: Python references to it, its TensorImpl's owners, the same
    two for the base it is a view of (None: not a view), and the TensorImpls on its storage."""
    base = tensor._base
    of_base = None if base is None else (sys.getrefcount(base), base._use_count(), base._base is None)
    del base
    storage = tensor.untyped_storage()
    on_storage = torch._C._storage_Use_Count(storage._cdata)
    del storage
    return sys.getrefcount(tensor), tensor._use_count(), of_base, on_storage


@functools.cache
def _unshared(inference_mode: bool) -> tuple[tuple, tuple]:
    """What :func:`_holders` sees of a tensor, and of a view of an operator's result (the values of a projection),
    that the caller alone holds in one local variable (the same call depth as in :func:`release_pages`). Measured,
    not assumed: how torch counts a Python object that its TensorImpl keeps alive changes between releases."""
    with torch.inference_mode(inference_mode):
        plain = torch.empty(64)
        view = torch.empty(8, 8).view(2, 4, 8).transpose(0, 1)
        return _holders(plain), _holders(view)


def release_pages(tensors: list[torch.Tensor]) -> int:
    """Give the pages of host tensors that are about to be dropped back to the system; returns the bytes released.

    ``tensors`` is emptied: the caller passes its last references in a list of its own. A tensor's pages are
    released only when nothing else can read them (another reference, a view of the same storage, a tensor on
    an accelerator, or a platform without ``madvise``: left as it is, and counted out of the result). The
    tensors are then freed as usual; the C allocator keeps their address range, and a later allocation there
    gets zero-filled pages from the kernel.
    """
    released = 0
    madvise = _libc_madvise() if _pages else False
    while tensors:
        tensor = tensors.pop()
        if not madvise or tensor.device.type != "cpu" or tensor.requires_grad:
            continue
        # Nothing but this local variable may reach the memory: no other Python reference to the tensor or to its
        # base, no other tensor (view, alias) on its storage, no C++ owner (autograd, a hook's capture).
        if _holders(tensor) not in _unshared(torch.is_inference_mode_enabled()):
            continue
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        del storage
        if size < _MIN_PAGES_BYTES:
            continue
        page = mmap.PAGESIZE
        first = -(-start // page) * page  # whole pages inside the allocation only: the allocator's own
        last = (start + size) // page * page  # bookkeeping around it stays untouched
        if last > first and madvise(first, last - first, _MADV_DONTNEED) == 0:
            released += last - first
    return released


def trim_heap() -> bool:
    """Hand the allocator's free pages back to the system now; True when some memory was released.

    False where the C library has no ``malloc_trim`` (not glibc).
    """
    trim = _malloc_trim()
    return bool(trim and trim(0))


def _rss_anon() -> int | None:
    """Anonymous resident bytes of this process (heap and mapped tensors, not the model's file-backed weights);
    None where ``/proc/self/status`` does not say."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_freed(nbytes: int, device: torch.device | str, kept: int = 0) -> None:
    """Note that a layer just dropped ``nbytes`` of KV pairs on ``device`` and kept ``kept`` bytes (its new pool);
    trim the heap when the process's anonymous resident memory, net of what was kept since the last trim, has risen
    more than ``min_bytes`` above its lowest reading at a release since then (see :func:`set_heap_release`). The
    first reading after a trim sets that floor: it includes the working set faulted back in since the trim.

    Resident memory that grows by more than the pools is freed memory the allocator keeps (fragmentation): a
    trim returns it. While the heap reuses its free chunks, nothing is trimmed and later allocations find their
    pages still mapped. Without ``/proc``, the heap is trimmed every ``min_bytes`` of dropped pairs.
    """
    global _pending, _floor, _kept
    if torch.device(device).type != "cpu" or _min_bytes is None:
        return
    anon = _rss_anon()
    with _lock:
        if anon is None:
            _pending += nbytes
            if _pending < _min_bytes:
                return
            _pending = 0
        else:
            _kept += kept
            # The lowest resident size since the last trim, net of what was kept since: memory freed by the caller
            # (a cache deleted) lowers it, growth beyond the pools raises the excess.
            net = anon - _kept
            _floor = net if _floor is None else min(_floor, net)
            if net - _floor <= _min_bytes:
                return
    trim_heap()
    with _lock:
        # The next reading sets the floor, not this one: between the trim and the next release, the caller's working
        # set (a layer's activations) faults its pages back in. A floor taken right after the trim would count that
        # working set as growth and trim again at every layer (5 ms each, plus the page faults, at 2k tokens).
        _floor, _kept = None, 0
