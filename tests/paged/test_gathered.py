"""The gathered multi-token attention against the paged-attention function, on the same pairs."""

import pytest
import torch

from kvzap.paged.attention import paged_attention
from kvzap.paged.gathered import gathered_attention

from .test_attention import _random_layout


def _gathered_inputs(pairs, nh):
    """Each head's live pairs in position order, concatenated head by head (what the compact layer gathers)."""
    keys, values, positions, counts = [], [], [], []
    for i in range(nh):
        ordered = sorted(pairs.get(i, []), key=lambda entry: entry[0])
        counts.append(len(ordered))
        positions += [p for p, _, _ in ordered]
        keys += [k for _, k, _ in ordered]
        values += [v for _, _, v in ordered]
    return torch.stack(keys), torch.stack(values), torch.tensor(positions), counts


@pytest.mark.parametrize("q_len, with_mask", [(1, False), (4, False), (4, True)])
def test_gathered_attention_equals_paged_attention(q_len, with_mask):
    generator = torch.Generator().manual_seed(0)
    bsz, kv_heads, groups, bs, d = 2, 3, 3, 4, 8
    lengths = [5, 9, 4, 13, 7, 6]
    keys, values, positions, bias, owner, pairs = _random_layout(generator, bsz, kv_heads, lengths, bs, d)
    query = torch.randn(bsz, kv_heads * groups, q_len, d, generator=generator)
    q_pos = torch.arange(3, 3 + q_len) if q_len > 1 else None
    mask = None
    if with_mask:
        mask = torch.rand(bsz, q_len, 13, generator=generator) > 0.4
        mask[:, :, 0] = True  # every row sees a pair
    expected = paged_attention(query, keys, values, positions, bias, owner, kv_heads, 0.3, q_pos=q_pos, mask=mask)
    g_keys, g_values, g_positions, counts = _gathered_inputs(pairs, bsz * kv_heads)
    out = gathered_attention(query, g_keys, g_values, g_positions, counts, kv_heads, 0.3, q_pos=q_pos, mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_head_without_pairs_and_wrong_counts():
    query = torch.randn(1, 2, 3, 4)
    keys, values = torch.randn(5, 4), torch.randn(5, 4)
    positions = torch.arange(5)
    out = gathered_attention(query, keys, values, positions, [5, 0], 2, 0.5, q_pos=torch.arange(2, 5))
    assert torch.isfinite(out[:, 0]).all()
    with pytest.raises(ValueError, match="counts has 3 entries"):
        gathered_attention(query, keys, values, positions, [5, 0, 0], 2, 0.5)


def _chunk_layout(generator, nh, prior, q_len, d):
    """Each head keeps a random subset of the positions before the chunk, and every position of the chunk."""
    keys, values, positions, counts = [], [], [], []
    for _ in range(nh):
        kept = (torch.rand(prior, generator=generator) < 0.4).nonzero().view(-1)
        pos = torch.cat([kept, torch.arange(prior, prior + q_len)])
        positions.append(pos)
        counts.append(len(pos))
        keys.append(torch.randn(len(pos), d, generator=generator))
        values.append(torch.randn(len(pos), d, generator=generator))
    return torch.cat(keys), torch.cat(values), torch.cat(positions), counts


@pytest.mark.parametrize("explicit_mask", [False, True])
def test_a_chunk_over_its_own_pairs_and_earlier_ones_is_split_in_two_fused_calls(monkeypatch, explicit_mask):
    """The split path (earlier pairs unmasked, the chunk's own causal, merged by log-sum-exp) equals attention
    computed from the definition, with causality from the positions or from a plain causal mask."""
    import kvzap.paged.gathered as gathered

    calls = []
    split = gathered._split_attention
    monkeypatch.setattr(gathered, "_split_attention", lambda *a: calls.append(1) or split(*a))
    generator = torch.Generator().manual_seed(3)
    bsz, kv_heads, groups, d, prior, q_len = 2, 2, 3, 8, 30, 7
    keys, values, positions, counts = _chunk_layout(generator, bsz * kv_heads, prior, q_len, d)
    query = torch.randn(bsz, kv_heads * groups, q_len, d, generator=generator)
    q_pos = torch.arange(prior, prior + q_len)
    mask = None
    if explicit_mask:  # transformers' causal mask of a chunk after `prior` tokens
        mask = torch.arange(prior + q_len)[None, None, :] <= q_pos[None, :, None]
    out = gathered_attention(query, keys, values, positions, counts, kv_heads, 0.4, q_pos=q_pos, mask=mask)
    assert len(calls) == bsz * kv_heads
    first = 0
    for i, n in enumerate(counts):
        b, h = divmod(i, kv_heads)
        k, v, p = keys[first : first + n], values[first : first + n], positions[first : first + n]
        first += n
        for g in range(h * groups, (h + 1) * groups):
            logits = (query[b, g] @ k.T * 0.4).masked_fill(p[None, :] > q_pos[:, None], float("-inf"))
            torch.testing.assert_close(out[b, g], torch.softmax(logits, -1) @ v, rtol=1e-5, atol=1e-5)


def test_a_mask_that_is_not_plain_causal_takes_the_masked_path(monkeypatch):
    import kvzap.paged.gathered as gathered

    generator = torch.Generator().manual_seed(4)
    keys, values, positions, counts = _chunk_layout(generator, 2, 20, 5, 8)
    query = torch.randn(1, 4, 5, 8, generator=generator)
    q_pos = torch.arange(20, 25)
    mask = torch.arange(25)[None, None, :] <= q_pos[None, :, None]
    mask[0, :, 3] = False  # a padding column
    monkeypatch.setattr(gathered, "_split_attention", lambda *a: pytest.fail("the split path ignores the mask"))
    out = gathered_attention(query, keys, values, positions, counts, 2, 0.5, q_pos=q_pos, mask=mask)
    k, v, p = keys[: counts[0]], values[: counts[0]], positions[: counts[0]]
    logits = (query[0, 0] @ k.T * 0.5).masked_fill(~mask[0][:, p], float("-inf"))
    torch.testing.assert_close(out[0, 0], torch.softmax(logits, -1) @ v, rtol=1e-5, atol=1e-5)
