"""Quantized storage of the kept pairs: 8-bit or 4-bit codes with a float16 scale and minimum per slot and group.

A pair's key and its value are cut along ``head_dim`` into groups of :func:`group_size` channels; each group
stores ``round((x - min) / scale)`` as an unsigned code of ``bits`` bits (4-bit codes packed two to a byte, the
even channel in the low nibble) and its ``(scale, min)`` in float16. Dequantizing gives ``code * scale + min``
in float32, then the model's dtype.

Why per slot (per token) along ``head_dim`` groups, rather than per channel within a block (KIVI's choice for
keys): every slot is then self-contained. A pair is quantized once, when it is written (prefill pack, append,
hole refill), from itself alone; a repack or a batch reorder copies its codes unchanged (no second rounding);
an append never re-quantizes a block that already holds pairs; and snapshots share the codes like the float
pool's keys (copy on write per slot). So results are deterministic, and the same whatever the order of writes.
Per-channel scales within a block would need either a full-precision copy of each head's last, partly filled
block (a second storage read by every attention path) or re-quantizing a block as it fills.

The cost, measured on SmolLM2-135M's keys and values of a 2k-token prompt (all 30 layers, relative RMS error
of the keys, of the logits ``q . k`` with the prompt's last 256 keys as queries, and of the values):

============================  =============  ===============  =============
scheme                        keys           logits           values
============================  =============  ===============  =============
8 bits, per slot, groups 64   0.0076         0.0069           0.0057
8 bits, per slot, groups 32   0.0058         0.0051           0.0048
8 bits, per channel, block    0.0027         0.0040           0.0050
4 bits, per slot, groups 32   0.099          0.087            0.082
4 bits, per slot, groups 16   0.073          0.070            0.066
4 bits, per channel, block    0.046          0.069            0.085
============================  =============  ===============  =============

Keys do have outlier channels (RoPE): per token over the whole head, 8 bits lose 1.7x the logit accuracy of
per-channel scales; groups of 32 channels (8 bits) and 16 (4 bits) bring the logit error to within 1.3x and 1.0x
of the per-channel scheme. Values have no outlier channels: per slot, groups twice as wide as the keys' (64 at 8
bits, 32 at 4 bits) already match the per-channel scheme (0.0057 against 0.0050, 0.082 against 0.085). Every
byte counts at the memory goals (70% evicted, 8k tokens, all that the cache holds: 0.12 of the full float32
cache at 8 bits, 0.20 of the full bf16 cache at 8 bits, 0.07 of the full float32 cache at 4 bits), where the
positions, the bias and the host's slot map already take 0.015 of a bf16 cache: finer value groups, or float32
scales, would miss the bf16 and 4-bit goals. The scales are float16 (relative rounding 5e-4, an eighth of an
8-bit step; codes are computed against the rounded scale and minimum, so the rounding is not added to the
error). Keys and values must fit in float16's range (+-65504), as those of every model kvzap supports do.

Presses store at 8 bits only (:func:`kvzap.presses.checks.check_press_kv_bits`): on the needle suite, 4-bit codes
lose needles against pruning alone (``research/kv-bits-4``). The 4-bit width stays in the storage for such studies.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KV_BITS", "check_kv_bits", "group_size", "code_width", "quantize", "dequantize", "SCALE_DTYPE"]

#: The storage widths of the compact cache's kept pairs: None (the model's dtype), 8 or 4 bits.
KV_BITS = (None, 8, 4)

#: Channels per group along ``head_dim`` (one scale and minimum each), for keys and for values: see the module
#: docstring.
KEY_GROUP = {8: 32, 4: 16}
VALUE_GROUP = {8: 64, 4: 32}

SCALE_DTYPE = torch.float16


def check_kv_bits(value: Any) -> int | None:
    """``value`` as a storage width (None, 8 or 4), or a clear error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"kv_bits must be None, 8 or 4, got {type(value).__name__} ({value!r}).")
    bits = int(value.__index__())
    if bits not in (8, 4):
        raise ValueError(
            f"kv_bits must be None (the model's dtype), 8 or 4, got {value!r}: the compact storage keeps its pairs "
            "at 8 or 4 bits only."
        )
    return bits


def group_size(bits: int, dim: int, keys: bool = True) -> int:
    """Channels per scale for keys (or values) of ``dim`` channels: :data:`KEY_GROUP` (:data:`VALUE_GROUP`), or the
    whole vector when ``dim`` is not a multiple of it."""
    group = (KEY_GROUP if keys else VALUE_GROUP)[bits]
    return group if dim % group == 0 else dim


def code_width(bits: int, dim: int) -> int:
    """Bytes of one vector's codes."""
    return dim if bits == 8 else dim // 2


def check_dim(bits: int, dim: int, what: str) -> None:
    """Refuse a head size that ``bits`` cannot pack (4-bit codes go two to a byte)."""
    if bits == 4 and dim % 2:
        raise ValueError(
            f"kv_bits=4 packs two channels per byte, but the {what} have an odd head size ({dim}): use kv_bits=8."
        )


def quantize(x: torch.Tensor, bits: int, keys: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(N, code_width)`` uint8 and scales ``(N, groups, 2)`` float16 (scale, min) of keys (or values, with
    ``keys=False``) ``x`` ``(N, d)``."""
    n, dim = x.shape
    group = group_size(bits, dim, keys)
    levels = (1 << bits) - 1
    xg = x.float().view(n, dim // group, group)
    lo = xg.amin(-1).to(SCALE_DTYPE)
    hi = xg.amax(-1)
    scale = ((hi - lo.float()) / levels).to(SCALE_DTYPE)
    s32, lo32 = scale.float(), lo.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    codes = ((xg - lo32[..., None]) * inv[..., None]).round_().clamp_(0, levels).to(torch.uint8).view(n, dim)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.contiguous(), torch.stack([scale, lo], -1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The vectors ``(..., d)`` in ``dtype`` of codes ``(..., code_width)`` and scales ``(..., groups, 2)``."""
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    lead, dim, groups = codes.shape[:-1], codes.shape[-1], scales.shape[-2]
    sc = scales.float()
    x = codes.float().view(*lead, groups, dim // groups) * sc[..., 0:1] + sc[..., 1:2]
    return x.view(*lead, dim).to(dtype)
