"""The device pool of the compact cache: block tensors, and snapshots that share them by reference.

A pool holds ``num_blocks`` blocks of ``block_size`` slots:

- ``keys (num_blocks, block_size, d_k)`` and ``values (num_blocks, block_size, d_v)``;
- ``positions (num_blocks, block_size)`` int32, the absolute position of each slot's pair;
- ``bias (num_blocks, block_size)`` in the keys' dtype: 0 in a live slot, -inf in a free one (added to the
  logits, it is the attention mask of the stored pairs; free slots hold zeros so that they stay finite);
- ``owner (num_blocks,)`` long, the head owning each block (meaningful for the used blocks only).

**Quantized storage** (``kv_bits`` 8 or 4, :mod:`kvzap.paged.quant`): ``keys`` and ``values`` hold uint8 codes
``(num_blocks, block_size, code_width)``, and ``key_scales`` / ``value_scales`` ``(num_blocks, block_size,
groups, 2)`` float16 their scales and minima, per slot. Pairs are quantized when they are written
(:meth:`BlockPool.write`, :meth:`BlockPool.pack`); :meth:`BlockPool.repack` copies codes unchanged; attention
paths read float pairs through :meth:`BlockPool.pairs` (given slots) or :meth:`BlockPool.block_pairs` (the
first blocks), or the codes themselves (the fused CPU kernel). ``bias`` stays in the model's dtype. With
``kv_bits=None`` the scales are None and the pairs are stored as given.

**Snapshots.** :meth:`BlockPool.state` returns a :class:`PoolState`, a frozen record of the five tensors,
shared by reference (taking one copies nothing), plus the host-side list of the slots live at that time. The
pool keeps weak references to the states still alive, and before any in-place write it asks whether a live
state still sees what it is about to change (copy on write):

- ``bias`` and ``owner`` (small) are copied before an in-place write while any state shares them;
- ``keys``, ``values``, their scales and ``positions`` are copied (all of them) before a write into a slot that a state
  sharing them saw live. Writes into fresh slots, which no state saw live, go in place: a decoding step after
  a restore copies nothing. The layer also avoids refilling holes while the keys are shared
  (:attr:`BlockPool.kv_shared`), so that the pipeline's questions never copy the pool.
- growing the pool (:meth:`BlockPool.grow`) makes new tensors: while a state shares the old ones, both are
  alive. The layer therefore makes room before it shares the pool (see ``CompactLayer.snapshot``).

Every check is host-side (weak references and numpy arrays): no device read.
When the last state referring to a tensor is garbage-collected, the pool owns it alone again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvzap.paged.kernels import quantize_kernel
from kvzap.paged.quant import SCALE_DTYPE, check_dim, check_kv_bits, code_width, dequantize, group_size, quantize

__all__ = ["BlockPool", "PoolState"]

# The tensors indexed by slot (first two dimensions (num_blocks, block_size)) that hold the pairs themselves.
_PAIR_FIELDS = ("keys", "values", "key_scales", "value_scales")


@dataclass(frozen=True, eq=False)
class PoolState:
    """The tensors of a pool at a point in time (see the module docstring); never written in place."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    positions: torch.Tensor | None
    bias: torch.Tensor | None
    owner: torch.Tensor | None
    live: np.ndarray  # (num_blocks * block_size,) bool: the slots live when the state was taken (host)
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None


class BlockPool:
    """Block tensors on one device, grown geometrically, rebuilt by :meth:`pack` (see the module docstring).

    Parameters
    ----------
    block_size : slots per block.
    kv_bits : None (pairs stored in the model's dtype), 8 or 4 (quantized, see :mod:`kvzap.paged.quant`).
    """

    def __init__(self, block_size: int, kv_bits: int | None = None):
        self.block_size = block_size
        self.kv_bits = check_kv_bits(kv_bits)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.owner: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None  # the model's dtype (of the pairs given and returned)
        self.dims: tuple[int, int] = (0, 0)  # head sizes of the keys and values
        self._states: weakref.WeakSet[PoolState] = weakref.WeakSet()
        self._ninf: torch.Tensor | None = None  # a 0-dim -inf for evictions (see _minus_inf)

    @property
    def num_blocks(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def quantized(self) -> bool:
        return self.kv_bits is not None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The pool's tensors (for memory accounting)."""
        tensors = (*self._pair_tensors(), self.positions, self.bias, self.owner, self._ninf)
        return tuple(t for t in tensors if t is not None)

    def _pair_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(getattr(self, name) for name in _PAIR_FIELDS)

    def slot_pair_bytes(self) -> int:
        """Bytes of one stored pair in its slot: keys and values (codes and scales when quantized)."""
        d_k, d_v = self.dims
        if not self.quantized:
            return (d_k + d_v) * torch.empty((), dtype=self.dtype).element_size()
        bits, scale_bytes = self.kv_bits, 2 * torch.empty((), dtype=SCALE_DTYPE).element_size()
        groups = d_k // group_size(bits, d_k) + d_v // group_size(bits, d_v, keys=False)
        return code_width(bits, d_k) + code_width(bits, d_v) + groups * scale_bytes

    # --- allocation ---------------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, like_keys: torch.Tensor, like_values: torch.Tensor, free_owner: int) -> None:
        """Replace the tensors with ``num_blocks`` empty blocks (zeros, bias -inf, owner ``free_owner``), for
        pairs of ``like_keys``' dtype and device and head sizes ``like_keys.shape[-1]``, ``like_values.shape[-1]``."""
        if self.quantized:
            check_dim(self.kv_bits, like_keys.shape[-1], "keys")
            check_dim(self.kv_bits, like_values.shape[-1], "values")
        self._allocate(num_blocks, like_keys.shape[-1], like_values.shape[-1], like_keys.dtype, like_keys.device)
        self.owner.fill_(free_owner)

    def _allocate(self, num_blocks: int, d_k: int, d_v: int, dtype: torch.dtype, device: torch.device) -> None:
        bs = self.block_size
        self.dtype, self.dims = dtype, (d_k, d_v)
        if self.quantized:
            bits = self.kv_bits
            self.keys = torch.zeros(num_blocks, bs, code_width(bits, d_k), dtype=torch.uint8, device=device)
            self.values = torch.zeros(num_blocks, bs, code_width(bits, d_v), dtype=torch.uint8, device=device)
            self.key_scales = torch.zeros(
                num_blocks, bs, d_k // group_size(bits, d_k), 2, dtype=SCALE_DTYPE, device=device
            )
            self.value_scales = torch.zeros(
                num_blocks, bs, d_v // group_size(bits, d_v, keys=False), 2, dtype=SCALE_DTYPE, device=device
            )
        else:
            self.keys = torch.zeros(num_blocks, bs, d_k, dtype=dtype, device=device)
            self.values = torch.zeros(num_blocks, bs, d_v, dtype=dtype, device=device)
        self.positions = torch.zeros(num_blocks, bs, dtype=torch.int32, device=device)
        self.bias = torch.full((num_blocks, bs), float("-inf"), dtype=dtype, device=device)
        self.owner = torch.zeros(num_blocks, dtype=torch.long, device=device)

    def grow(self, num_blocks: int, free_owner: int) -> None:
        """Append empty blocks so that the pool has ``num_blocks`` (new tensors: states keep the old ones)."""
        extra = num_blocks - self.num_blocks
        if extra <= 0:
            return
        for name in _PAIR_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])]))
        bs = self.block_size
        self.positions = torch.cat([self.positions, self.positions.new_zeros(extra, bs)])
        self.bias = torch.cat([self.bias, self.bias.new_full((extra, bs), float("-inf"))])
        self.owner = torch.cat([self.owner, self.owner.new_full((extra,), free_owner)])

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Pairs ``keys (N, d_k)``, ``values (N, d_v)`` in the stored form, in the order of the pair fields (keys,
        values, key scales, value scales; no scales when not quantized)."""
        if not self.quantized:
            return keys, values, None, None
        k_codes, k_scales = quantize(keys, self.kv_bits)
        v_codes, v_scales = quantize(values, self.kv_bits, keys=False)
        return k_codes, v_codes, k_scales, v_scales

    def _store(self, slots_t: torch.Tensor, rows: tuple[torch.Tensor | None, ...]) -> None:
        """Copy stored-form rows into flat slots (no copy on write: the caller checked)."""
        for name, row in zip(_PAIR_FIELDS, rows, strict=True):
            tensor = getattr(self, name)
            if tensor is not None:
                tensor.view(-1, *tensor.shape[2:]).index_copy_(0, slots_t, row)

    def pack(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        dst: np.ndarray,
        positions: np.ndarray,
        owner: np.ndarray,
        num_blocks: int,
        free_owner: int,
    ) -> None:
        """Replace the tensors with ``num_blocks`` blocks holding the pairs ``keys (N, d_k)``, ``values (N, d_v)``
        (quantized here when the pool is) at flat slots ``dst (N,)`` with ``positions (N,)``; ``owner`` gives the
        owner of the first ``len(owner)`` blocks. The old tensors are left untouched (states may still share them)."""
        rows = self.encode(keys, values)
        self._allocate(num_blocks, keys.shape[-1], values.shape[-1], keys.dtype, keys.device)
        self._fill(rows, dst, positions, owner, free_owner)

    def repack(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        positions: np.ndarray,
        owner: np.ndarray,
        num_blocks: int,
        free_owner: int,
    ) -> None:
        """Like :meth:`pack`, with the pairs of this pool's flat slots ``src (N,)``: copied as stored (quantized
        codes are not quantized again)."""
        src_t = torch.from_numpy(src).to(self.keys.device)
        rows = tuple(
            None if t is None else t.view(-1, *t.shape[2:]).index_select(0, src_t) for t in self._pair_tensors()
        )
        self._allocate(num_blocks, *self.dims, self.dtype, self.keys.device)
        self._fill(rows, dst, positions, owner, free_owner)

    def _fill(self, rows, dst: np.ndarray, positions: np.ndarray, owner: np.ndarray, free_owner: int) -> None:
        dev = self.keys.device
        dst_t = torch.from_numpy(dst).to(dev)
        self._store(dst_t, rows)
        self.positions.view(-1)[dst_t] = torch.from_numpy(positions).to(dev)
        self.bias.view(-1)[dst_t] = 0
        self.owner.fill_(free_owner)
        self.owner[: len(owner)] = torch.from_numpy(owner).to(dev)

    # --- reads --------------------------------------------------------------------------------------------------
    def pairs(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``(N, d_k)`` and values ``(N, d_v)`` of flat ``slots`` ``(N,)`` (device), in the model's dtype
        (dequantized when the pool is quantized)."""
        rows = [None if t is None else t.view(-1, *t.shape[2:]).index_select(0, slots) for t in self._pair_tensors()]
        if not self.quantized:
            return rows[0], rows[1]
        return (
            dequantize(rows[0], rows[2], self.kv_bits, self.dtype),
            dequantize(rows[1], rows[3], self.kv_bits, self.dtype),
        )

    def block_pairs(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``(n, bs, d_k)`` and values ``(n, bs, d_v)`` of the first ``num_blocks`` blocks in the model's dtype:
        views of the pool, or dequantized copies when it is quantized (free slots give finite values)."""
        n = num_blocks
        if not self.quantized:
            return self.keys[:n], self.values[:n]
        return (
            dequantize(self.keys[:n], self.key_scales[:n], self.kv_bits, self.dtype),
            dequantize(self.values[:n], self.value_scales[:n], self.kv_bits, self.dtype),
        )

    # --- snapshots ----------------------------------------------------------------------------------------------
    def state(self, live: np.ndarray) -> PoolState:
        """A record of the current tensors, shared by reference; ``live`` ``(num_blocks * block_size,)`` bool, the
        slots live now (host)."""
        record = PoolState(
            self.keys, self.values, self.positions, self.bias, self.owner, live, self.key_scales, self.value_scales
        )
        self._states.add(record)
        return record

    def restore(self, record: PoolState) -> None:
        """Use the tensors of ``record`` (shared with it from now on: writes that it could see copy first)."""
        self.keys, self.values, self.positions = record.keys, record.values, record.positions
        self.key_scales, self.value_scales = record.key_scales, record.value_scales
        self.bias, self.owner = record.bias, record.owner
        self._states.add(record)

    def _seen_by_state(self, name: str) -> bool:
        if not self._states:  # the usual case, checked first: a decoding step asks three times
            return False
        tensor = getattr(self, name)
        return any(getattr(record, name) is tensor for record in self._states)

    def _claimed(self, slots: np.ndarray) -> bool:
        """True when a live state sharing the keys saw one of the flat ``slots`` live."""
        return bool(self._states) and any(
            record.keys is self.keys and record.live[slots].any() for record in self._states
        )

    @property
    def kv_shared(self) -> bool:
        """True while a live state shares the keys: writing a slot that was live before must copy them first."""
        return self._seen_by_state("keys")

    # --- writes -------------------------------------------------------------------------------------------------
    def _own(self, name: str) -> torch.Tensor:
        """The tensor ``name``, copied first if a live state shares it."""
        if self._seen_by_state(name):
            setattr(self, name, getattr(self, name).clone())
        return getattr(self, name)

    def write(self, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | int) -> None:
        """Store pairs at flat ``slots`` ``(N,)`` (host): ``keys (N, d_k)``, ``values (N, d_v)`` (quantized here when
        the pool is), ``positions`` ``(N,)`` int32 or one position for all (copying the shared tensors first if a
        state saw one of these slots live)."""
        if self._claimed(slots):
            for name in (*_PAIR_FIELDS, "positions"):
                tensor = getattr(self, name)
                if tensor is not None:
                    setattr(self, name, tensor.clone())
        slots_t = torch.from_numpy(slots).to(self.keys.device)
        kernel = self._quantize_kernel(keys)
        if kernel is None:
            self._store(slots_t, self.encode(keys, values))
        else:  # one fused call per pool tensor instead of quantize() and a copy (~14 operations each)
            bits, (d_k, d_v) = self.kv_bits, self.dims
            kernel(self.keys, self.key_scales, slots_t, keys, bits, group_size(bits, d_k))
            kernel(self.values, self.value_scales, slots_t, values, bits, group_size(bits, d_v, keys=False))
        if isinstance(positions, int):
            self.positions.view(-1).index_fill_(0, slots_t, positions)
        else:
            self.positions.view(-1).index_copy_(0, slots_t, positions)
        self._own("bias").view(-1).index_fill_(0, slots_t, 0)

    def _quantize_kernel(self, keys: torch.Tensor):
        """The fused quantize-and-store operator for pairs like ``keys``, or None: not quantized, not on CPU,
        autograd on, or the kernel unavailable (then :meth:`encode` and :meth:`_store` do the same)."""
        if not self.quantized or keys.device.type != "cpu" or (keys.requires_grad and torch.is_grad_enabled()):
            return None
        return quantize_kernel()

    def set_owner(self, blocks: list[int], heads: list[int]) -> None:
        """Record the owners of newly taken blocks."""
        dev = self.owner.device
        self._own("owner")[torch.tensor(blocks, dtype=torch.long, device=dev)] = torch.tensor(
            heads, dtype=torch.long, device=dev
        )

    def free(self, slots: torch.Tensor, evict: torch.Tensor) -> torch.Tensor:
        """Free the slots ``slots[k]`` ``(N,)`` where ``evict[k]`` is True and the slot is live, on the device.

        Returns the ``(N,)`` bool tensor of slots freed by this call (live before, evicted now): the caller reads
        it later, never here, so the call does not wait for the device.
        """
        bias = self._own("bias").view(-1)
        current = bias.index_select(0, slots)
        freed = evict & (current == 0)
        bias.index_put_((slots,), torch.where(freed, float("-inf"), current))
        return freed

    def kill(self, slots: torch.Tensor, evict: torch.Tensor) -> None:
        """Free the live slots ``slots[k]`` ``(N,)`` where ``evict[k]`` is True (the caller knows that every one of
        these slots is live, so the new bias is -inf or 0: two device operations, where :meth:`free` takes five)."""
        bias = self._own("bias")
        bias.view(-1).index_put_((slots,), torch.where(evict, self._minus_inf(bias), 0.0))

    def _minus_inf(self, like: torch.Tensor) -> torch.Tensor:
        """A 0-dim -inf of ``like``'s dtype and device, kept (built once, not per decoding step)."""
        cached = self._ninf
        if cached is None or cached.dtype != like.dtype or cached.device != like.device:
            cached = self._ninf = torch.tensor(float("-inf"), dtype=like.dtype, device=like.device)
        return cached
