"""The parts of the compact cache, kept apart as serving engines keep them (see :mod:`kvzap.compact`).

- :mod:`kvzap.paged.table`: the host-side block table (block lists, slot map, holes, repack plans);
- :mod:`kvzap.paged.pool`: the device pool of blocks, with snapshots that share it by reference (copy on write);
- :mod:`kvzap.paged.attention`: a pure paged-attention function with segment reductions;
- :mod:`kvzap.paged.kernels`: the same attention for one decoded token, fused into one compiled CPU operator.
"""

from kvzap.paged.attention import paged_attention
from kvzap.paged.pool import BlockPool, PoolState
from kvzap.paged.table import BlockTable, PackPlan

__all__ = ["BlockTable", "PackPlan", "BlockPool", "PoolState", "paged_attention"]
