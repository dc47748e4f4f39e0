"""The device pool of the compact cache: block tensors, and snapshots that share them by reference.

A pool holds ``num_blocks`` blocks of ``block_size`` slots:

- ``keys (num_blocks, block_size, d_k)`` and ``values (num_blocks, block_size, d_v)``;
- ``positions (num_blocks, block_size)`` int32, the absolute position of each slot's pair;
- ``bias (num_blocks, block_size)`` in the keys' dtype: 0 in a live slot, -inf in a free one (added to the
  logits, it is the attention mask of the stored pairs; free slots hold zeros so that they stay finite);
- ``owner (num_blocks,)`` long, the head owning each block (meaningful for the used blocks only).

**Snapshots.** :meth:`BlockPool.state` returns a :class:`PoolState`, a frozen record of the five tensors,
shared by reference (taking one copies nothing), plus the host-side list of the slots live at that time. The
pool keeps weak references to the states still alive, and before any in-place write it asks whether a live
state still sees what it is about to change (copy on write):

- ``bias`` and ``owner`` (small) are copied before an in-place write while any state shares them;
- ``keys``, ``values`` and ``positions`` are copied (all three) before a write into a slot that a state
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

__all__ = ["BlockPool", "PoolState"]


@dataclass(frozen=True, eq=False)
class PoolState:
    """The tensors of a pool at a point in time (see the module docstring); never written in place."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    positions: torch.Tensor | None
    bias: torch.Tensor | None
    owner: torch.Tensor | None
    live: np.ndarray  # (num_blocks * block_size,) bool: the slots live when the state was taken (host)


class BlockPool:
    """Block tensors on one device, grown geometrically, rebuilt by :meth:`pack` (see the module docstring).

    Parameters
    ----------
    block_size : slots per block.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.owner: torch.Tensor | None = None
        self._states: weakref.WeakSet[PoolState] = weakref.WeakSet()
        self._ninf: torch.Tensor | None = None  # a 0-dim -inf for evictions (see _minus_inf)

    @property
    def num_blocks(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The pool's tensors (for memory accounting)."""
        tensors = (self.keys, self.values, self.positions, self.bias, self.owner, self._ninf)
        return tuple(t for t in tensors if t is not None)

    # --- allocation ---------------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, like_keys: torch.Tensor, like_values: torch.Tensor, free_owner: int) -> None:
        """Replace the tensors with ``num_blocks`` empty blocks (zeros, bias -inf, owner ``free_owner``)."""
        bs, dev = self.block_size, like_keys.device
        self.keys = like_keys.new_zeros(num_blocks, bs, like_keys.shape[-1])
        self.values = like_values.new_zeros(num_blocks, bs, like_values.shape[-1])
        self.positions = torch.zeros(num_blocks, bs, dtype=torch.int32, device=dev)
        self.bias = like_keys.new_full((num_blocks, bs), float("-inf"))
        self.owner = torch.full((num_blocks,), free_owner, dtype=torch.long, device=dev)

    def grow(self, num_blocks: int, free_owner: int) -> None:
        """Append empty blocks so that the pool has ``num_blocks`` (new tensors: states keep the old ones)."""
        extra = num_blocks - self.num_blocks
        if extra <= 0:
            return
        bs = self.block_size
        self.keys = torch.cat([self.keys, self.keys.new_zeros(extra, bs, self.keys.shape[-1])])
        self.values = torch.cat([self.values, self.values.new_zeros(extra, bs, self.values.shape[-1])])
        self.positions = torch.cat([self.positions, self.positions.new_zeros(extra, bs)])
        self.bias = torch.cat([self.bias, self.bias.new_full((extra, bs), float("-inf"))])
        self.owner = torch.cat([self.owner, self.owner.new_full((extra,), free_owner)])

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
        at flat slots ``dst (N,)`` with ``positions (N,)``; ``owner`` gives the owner of the first
        ``len(owner)`` blocks. The old tensors are left untouched (states may still share them)."""
        dev = keys.device
        dst_t = torch.from_numpy(dst).to(dev)
        self.allocate(num_blocks, keys, values, free_owner)
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, dst_t, keys)
        self.values.view(-1, self.values.shape[-1]).index_copy_(0, dst_t, values)
        self.positions.view(-1)[dst_t] = torch.from_numpy(positions).to(dev)
        self.bias.view(-1)[dst_t] = 0
        self.owner[: len(owner)] = torch.from_numpy(owner).to(dev)

    # --- snapshots ----------------------------------------------------------------------------------------------
    def state(self, live: np.ndarray) -> PoolState:
        """A record of the current tensors, shared by reference; ``live`` ``(num_blocks * block_size,)`` bool, the
        slots live now (host)."""
        record = PoolState(self.keys, self.values, self.positions, self.bias, self.owner, live)
        self._states.add(record)
        return record

    def restore(self, record: PoolState) -> None:
        """Use the tensors of ``record`` (shared with it from now on: writes that it could see copy first)."""
        self.keys, self.values, self.positions = record.keys, record.values, record.positions
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
        """Store pairs at flat ``slots`` ``(N,)`` (host): ``keys (N, d_k)``, ``values (N, d_v)``, ``positions``
        ``(N,)`` int32 or one position for all (copying the shared tensors first if a state saw one of these
        slots live)."""
        if self._claimed(slots):
            self.keys, self.values, self.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
        slots_t = torch.from_numpy(slots).to(self.keys.device)
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, slots_t, keys)
        self.values.view(-1, self.values.shape[-1]).index_copy_(0, slots_t, values)
        if isinstance(positions, int):
            self.positions.view(-1).index_fill_(0, slots_t, positions)
        else:
            self.positions.view(-1).index_copy_(0, slots_t, positions)
        self._own("bias").view(-1).index_fill_(0, slots_t, 0)

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
