"""The paged-attention function against plain attention over each head's pairs, whatever the block layout."""

import pytest
import torch

from kvzap.paged.attention import paged_attention


def _random_layout(generator, bsz, kv_heads, lengths, bs, d):
    """Blocks of each head's pairs scattered over a pool in random order, with free slots in between."""
    nh = bsz * kv_heads
    per_head = [-(-n // bs) + 1 for n in lengths]  # one block more than needed: free slots
    owner = torch.tensor([i for i in range(nh) for _ in range(per_head[i])])
    owner = owner[torch.randperm(len(owner), generator=generator)]
    nu = len(owner)
    keys, values = torch.randn(nu, bs, d, generator=generator), torch.randn(nu, bs, d, generator=generator)
    positions = torch.zeros(nu, bs, dtype=torch.int32)
    bias = torch.full((nu, bs), float("-inf"))
    pairs = {}
    for i in range(nh):
        slots = [(int(b), j) for b in (owner == i).nonzero().view(-1) for j in range(bs)]
        chosen = torch.randperm(len(slots), generator=generator)[: lengths[i]].sort().values
        for pos, k in enumerate(chosen.tolist()):
            b, j = slots[k]
            positions[b, j], bias[b, j] = pos, 0.0
            pairs.setdefault(i, []).append((pos, keys[b, j], values[b, j]))
    return keys, values, positions, bias, owner, pairs


@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_equals_attention_over_each_head_s_pairs(q_len):
    generator = torch.Generator().manual_seed(0)
    bsz, kv_heads, groups, bs, d = 2, 3, 2, 4, 8
    lengths = [5, 9, 4, 13, 7, 6]
    keys, values, positions, bias, owner, pairs = _random_layout(generator, bsz, kv_heads, lengths, bs, d)
    query = torch.randn(bsz, kv_heads * groups, q_len, d, generator=generator)
    q_pos = None if q_len == 1 else torch.arange(3, 3 + q_len)
    out = paged_attention(query, keys, values, positions, bias, owner, kv_heads, d**-0.5, q_pos=q_pos)
    assert out.shape == (bsz, kv_heads * groups, q_len, d)
    for b in range(bsz):
        for g in range(kv_heads * groups):
            i = b * kv_heads + g // groups
            for t in range(q_len):
                visible = [(k, v) for p, k, v in pairs[i] if q_pos is None or p <= int(q_pos[t])]
                k, v = torch.stack([k for k, _ in visible]), torch.stack([v for _, v in visible])
                expected = torch.softmax(query[b, g, t] @ k.T * d**-0.5, -1) @ v
                torch.testing.assert_close(out[b, g, t], expected, rtol=1e-5, atol=1e-5)


def test_an_explicit_mask_is_read_at_the_stored_positions():
    generator = torch.Generator().manual_seed(1)
    keys, values, positions, bias, owner, pairs = _random_layout(generator, 1, 2, [6, 8], 4, 4)
    query = torch.randn(1, 2, 2, 4, generator=generator)
    mask = torch.rand(1, 2, 8, generator=generator) > 0.3
    mask[:, :, 0] = True  # every row sees a pair
    out = paged_attention(query, keys, values, positions, bias, owner, 2, 0.5, mask=mask)
    for h in range(2):
        for t in range(2):
            visible = [(k, v) for p, k, v in pairs[h] if mask[0, t, p]]
            k, v = torch.stack([k for k, _ in visible]), torch.stack([v for _, v in visible])
            torch.testing.assert_close(out[0, h, t], torch.softmax(query[0, h, t] @ k.T * 0.5, -1) @ v)
