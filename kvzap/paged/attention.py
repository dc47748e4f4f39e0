"""Paged attention over per-head blocks: a pure function of the pool's tensors.

Each used block belongs to one head (a (batch row, KV head) pair). The function runs one batched matmul of
every block's keys with the queries of its owner head, a softmax split over blocks and merged per head with
segment reductions (the split-K scheme of flash decoding: a per-head max by ``scatter_reduce_(..., "amax")``,
sums by ``index_add_``; ``index_reduce_`` computes the same max but warns that it is in beta), and one
batched matmul with the values. The work is O(blocks): there is no dense (heads x blocks) routing matrix.
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention"]


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    bias: torch.Tensor,
    owner: torch.Tensor,
    kv_heads: int,
    scale: float,
    q_pos: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over the pairs stored in blocks.

    Parameters
    ----------
    query : ``(B, Hq, q, d)``; query head ``g`` reads KV head ``g // (Hq // kv_heads)``.
    keys, values : ``(nu, bs, d)``, ``(nu, bs, d_v)``: the used blocks.
    positions : ``(nu, bs)`` int, absolute position of each slot's pair (any value in a free slot).
    bias : ``(nu, bs)``: 0 in a live slot, -inf in a free one.
    owner : ``(nu,)`` long, the head ``b * kv_heads + h`` owning each block.
    kv_heads : KV heads per batch row.
    scale : softmax scale.
    q_pos : ``(q,)`` absolute positions of the query rows, for a causal mask from the stored positions; None
        when every query row sees every live slot (one decoded token, whose own pair is stored).
    mask : bool ``(B or 1, q, seen)``, True where query row ``j`` may read position ``p``; replaces ``q_pos``.

    Returns
    -------
    Tensor ``(B, Hq, q, d_v)``. A query row that sees no pair gives NaN, as sdpa does.
    """
    bsz, n_q_heads, q_len, head_dim = query.shape
    groups = n_q_heads // kv_heads
    rows = groups * q_len
    nh, nu = bsz * kv_heads, keys.shape[0]

    slot_bias = bias[:, None, :]  # (nu, 1, bs)
    if mask is not None:
        seen = mask.shape[-1]
        block_row = (owner // kv_heads).clamp_max(mask.shape[0] - 1)  # (nu,) batch row of each block
        # Free slots may hold stale positions (a snapshot's branch): clamp them, the bias hides them anyway.
        flat_pos = positions.reshape(-1).clamp(0, seen - 1)
        visible = mask[:, :, flat_pos].view(mask.shape[0], q_len, nu, -1)  # (B', q, nu, bs)
        visible = visible[block_row, :, torch.arange(nu, device=keys.device)]  # (nu, q, bs)
        blocked = ~visible
    elif q_pos is not None:
        blocked = positions[:, None, :] > q_pos[None, :, None]  # (nu, q, bs) causal
    else:
        blocked = None
    if blocked is not None:  # per query position, repeated over the group like the folded queries
        slot_bias = slot_bias.masked_fill(blocked, float("-inf")).repeat(1, groups, 1)  # (nu, G*q, bs)

    # Fold the query heads of a group into the query axis: (B, Hq, q, d) -> (B*Hkv, G*q, d); each block meets
    # its owner's queries. Scale, mask and logits in one batched matmul.
    q_blocks = query.reshape(nh, rows, head_dim).index_select(0, owner)  # (nu, G*q, d)
    logits = torch.baddbmm(slot_bias, q_blocks, keys.transpose(1, 2), alpha=scale).float()  # (nu, G*q, bs)

    # Split softmax, merged per head by segment reductions over each head's blocks.
    block_max = logits.amax(-1)  # (nu, G*q)
    head_max = block_max.new_full((nh, rows), float("-inf"))
    head_max.scatter_reduce_(0, owner[:, None].expand(nu, rows), block_max, "amax")  # (nh, G*q)
    if blocked is not None:  # a row that sees nothing would give -inf - -inf = NaN in every weight
        head_max = torch.nan_to_num(head_max, neginf=0.0)
    weights = logits.sub_(head_max.index_select(0, owner)[:, :, None]).exp_()  # (nu, G*q, bs), in place
    block_sum = weights.sum(-1)  # (nu, G*q)
    block_out = torch.bmm(weights.to(values.dtype), values).float()  # (nu, G*q, d_v)
    head_sum = block_sum.new_zeros(nh, rows).index_add_(0, owner, block_sum)  # (nh, G*q)
    head_out = block_out.new_zeros(nh, rows, block_out.shape[-1]).index_add_(0, owner, block_out)
    out = (head_out / head_sum[:, :, None]).to(query.dtype)  # (B*Hkv, G*q, d_v)
    return out.view(bsz, n_q_heads, q_len, -1)
