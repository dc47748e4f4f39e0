"""Attention of a multi-token step (a prefill chunk, a question) over each head's live pairs, gathered.

A chunk of ``q`` query positions meets every pair a head keeps. :func:`~kvzap.paged.attention.paged_attention`
computes it block by block with segment reductions, materialising ``(blocks, G * q, block_size)`` logits in
float32 and a few tensors of that size more: at a 1k-token chunk over a few thousand kept pairs that is most of
a chunk's time on CPU (measured on SmolLM2-135M at 4k tokens: ~60% of the chunked prefill, against ~2% for the
dense prefill's attention). Here each head's live pairs, gathered in position order into one contiguous tensor,
go through torch's ``scaled_dot_product_attention`` (its fused flash kernel on CPU and CUDA), one call per
(batch row, KV head) with the query heads of its group folded into the query axis. Heads are not padded to a
common length, so a head that keeps 3% of its pairs costs 3% of a dense head.

Gathering copies the live pairs once per layer and step (``kept x d`` values), which is small next to the
attention itself (``q x kept x d``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["gathered_attention"]


def _flash_with_lse():
    """torch's fused CPU attention that also returns the log-sum-exp of each query row (None where absent)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_causal(mask_row: torch.Tensor | None, start: int, q_len: int) -> bool:
    """Whether ``mask_row`` ``(q, seen)`` (None: causal from the positions) lets query row ``j`` see every
    position before ``start`` and the positions ``start .. start + j``: a chunk's plain causal mask."""
    if mask_row is None:
        return True
    if not bool(mask_row[:, :start].all()):
        return False
    own = mask_row[:, start : start + q_len]
    return bool(torch.equal(own, torch.ones_like(own).tril()))


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attentions over disjoint sets of pairs merged into one (the split softmax of flash decoding)."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = (lse_a - top).exp()[..., None], (lse_b - top).exp()[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)


def gathered_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    counts: Sequence[int],
    kv_heads: int,
    scale: float,
    q_pos: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over every head's live pairs, given head by head.

    Parameters
    ----------
    query : ``(B, Hq, q, d)``; query head ``g`` reads KV head ``g // (Hq // kv_heads)``.
    keys, values : ``(N, d)``, ``(N, d_v)``: the live pairs of head 0 (batch row 0, KV head 0), then head 1, ...
        (head ``i = b * kv_heads + h``), in the model's dtype.
    positions : ``(N,)`` long, absolute position of each pair.
    counts : pairs of each head, ``B * kv_heads`` entries summing to ``N``.
    kv_heads : KV heads per batch row.
    scale : softmax scale.
    q_pos : ``(q,)`` absolute positions of the query rows: query row ``j`` sees the pairs at positions
        ``<= q_pos[j]``. None: every row sees every pair.
    mask : bool ``(B or 1, q, seen)``, True where query row ``j`` may read position ``p``; replaces ``q_pos``.

    Returns
    -------
    Tensor ``(B, Hq, q, d_v)``. A query row that sees no pair gives NaN, as sdpa does.
    """
    bsz, n_q_heads, q_len, head_dim = query.shape
    if len(counts) != bsz * kv_heads:
        raise ValueError(f"counts has {len(counts)} entries for {bsz} x {kv_heads} heads.")
    groups = n_q_heads // kv_heads
    out = query.new_empty(bsz, n_q_heads, q_len, values.shape[-1])
    flash = _flash_with_lse() if query.device.type == "cpu" and q_pos is not None and q_len > 1 else None
    chunk_start = int(q_pos[0]) if q_pos is not None else 0
    if flash is not None and not bool(torch.equal(q_pos, torch.arange(chunk_start, chunk_start + q_len))):
        flash = None
    plain = [
        flash is not None
        and _split_causal(None if mask is None else mask[min(b, mask.shape[0] - 1)], chunk_start, q_len)
        for b in range(bsz)
    ]
    start = 0
    for i, n in enumerate(counts):
        b, h = divmod(i, kv_heads)
        stop = start + int(n)
        k, v, p = keys[start:stop], values[start:stop], positions[start:stop]
        start = stop
        if plain[b]:
            split = _split_attention(flash, query[b, h * groups : (h + 1) * groups], k, v, p, chunk_start, scale)
            if split is not None:
                out[b, h * groups : (h + 1) * groups] = split
                continue
        if mask is not None:
            visible = mask[min(b, mask.shape[0] - 1)][:, p]  # (q, n)
        elif q_pos is not None:
            visible = p[None, :] <= q_pos[:, None]  # (q, n) causal, from the stored positions
        else:
            visible = None
        # The group's query heads folded into the query axis: (G, q, d) -> (1, 1, G * q, d), one sdpa call.
        q_h = query[b, h * groups : (h + 1) * groups].reshape(1, 1, groups * q_len, head_dim)
        if visible is not None:
            visible = visible.repeat(groups, 1)[None, None]  # (1, 1, G * q, n)
        o = F.scaled_dot_product_attention(q_h, k[None, None], v[None, None], attn_mask=visible, scale=scale)
        out[b, h * groups : (h + 1) * groups] = o.view(groups, q_len, -1)
    return out


def _split_attention(flash, q_h, k, v, p, chunk_start: int, scale: float) -> torch.Tensor | None:
    """Attention of a chunk's query rows ``q_h`` ``(G, q, d)`` (positions ``chunk_start ..``) over one head's pairs,
    in two fused calls without a mask: the pairs before the chunk (every row sees them all) and the chunk's own
    pairs (causal, when all of them are stored: a chunk is evicted after its forward), merged by their
    log-sum-exp. None when the chunk's own pairs are not exactly its positions (then a mask is needed)."""
    groups, q_len, head_dim = q_h.shape
    n_prior = int((p < chunk_start).sum())  # p is sorted
    n_own = p.shape[0] - n_prior
    if n_own != q_len or (n_own and int(p[n_prior]) != chunk_start):
        return None
    own_k = k[n_prior:][None, None].expand(1, groups, q_len, head_dim)
    own_v = v[n_prior:][None, None].expand(1, groups, q_len, v.shape[-1])
    out_own, lse_own = flash(q_h[None], own_k, own_v, 0.0, True, scale=scale)[:2]
    if n_prior == 0:
        return out_own[0]
    # Every row sees every earlier pair: the group's query heads folded into the query axis, one unmasked call.
    q_fold = q_h.reshape(1, 1, groups * q_len, head_dim)
    out_prior, lse_prior = flash(q_fold, k[:n_prior][None, None], v[:n_prior][None, None], 0.0, False, scale=scale)[:2]
    if lse_prior.shape != (1, 1, groups * q_len) or lse_own.shape != (1, groups, q_len):
        return None  # another layout of the log-sum-exp than this torch's: the masked path
    merged = _merge(out_prior.view(groups, q_len, -1), lse_prior.view(groups, q_len), out_own[0], lse_own[0])
    return merged.to(q_h.dtype)
