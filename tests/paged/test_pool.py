"""The device pool: writes, device-side frees, and snapshots shared by reference with copy on write."""

import gc

import numpy as np
import torch

from kvzap.paged.pool import BlockPool


def _pool(num_blocks=3, bs=4, d=2):
    pool = BlockPool(bs)
    pool.allocate(num_blocks, torch.zeros(1, d), torch.zeros(1, d), free_owner=9)
    return pool


def _write(pool, slots, value):
    n = len(slots)
    d = pool.keys.shape[-1]
    pool.write(
        np.asarray(slots),
        torch.full((n, d), float(value)),
        torch.full((n, d), -float(value)),
        torch.arange(n, dtype=torch.int32),
    )


def test_write_and_free_on_the_device():
    pool = _pool()
    _write(pool, [0, 1, 5], 1.0)
    assert (pool.bias.view(-1)[[0, 1, 5]] == 0).all() and int((pool.bias == 0).sum()) == 3
    freed = pool.free(torch.tensor([0, 1, 2]), torch.tensor([True, False, True]))
    assert freed.tolist() == [True, False, False]  # slot 2 was not live: nothing freed there
    assert pool.bias.view(-1)[0] == float("-inf") and pool.bias.view(-1)[1] == 0
    assert pool.free(torch.tensor([0]), torch.tensor([True])).tolist() == [False]  # freeing twice frees once


def test_states_share_the_tensors_and_never_see_later_changes():
    pool = _pool()
    _write(pool, [0, 1], 1.0)
    live = np.zeros(12, dtype=bool)
    live[[0, 1]] = True
    state = pool.state(live)
    assert state.keys is pool.keys and state.bias is pool.bias and pool.kv_shared  # nothing copied
    keys_before, bias_before = state.keys.clone(), state.bias.clone()
    _write(pool, [2], 2.0)  # a fresh slot: written in place, the state's bias (copied first) still hides it
    assert pool.keys is state.keys and pool.bias is not state.bias
    pool.free(torch.tensor([0]), torch.tensor([True]))
    assert torch.equal(state.bias, bias_before)
    _write(pool, [0], 3.0)  # a slot the state saw live: keys, values and positions are copied first
    seen_by_state = [0, 1]  # what the state sees (its free slots may have been written: it never reads them)
    assert pool.keys is not state.keys
    assert torch.equal(state.keys.view(-1, 2)[seen_by_state], keys_before.view(-1, 2)[seen_by_state])
    pool.restore(state)
    assert pool.keys is state.keys and torch.equal(pool.bias, bias_before)
    del state
    gc.collect()
    assert not pool.kv_shared  # the last state is gone: the pool owns its tensors alone


def test_grow_and_pack_build_new_tensors():
    pool = _pool(num_blocks=2)
    _write(pool, [1, 6], 1.0)
    state = pool.state(np.zeros(8, dtype=bool))
    pool.grow(5, free_owner=9)
    assert pool.num_blocks == 5 and state.keys.shape[0] == 2 and torch.equal(pool.keys[:2], state.keys)
    assert (pool.bias[2:] == float("-inf")).all() and (pool.owner[2:] == 9).all()
    pool.pack(
        torch.ones(3, 2),
        -torch.ones(3, 2),
        np.array([0, 1, 4]),
        np.array([7, 8, 9], dtype=np.int32),
        np.array([0, 1]),
        num_blocks=3,
        free_owner=2,
    )
    assert pool.num_blocks == 3 and pool.owner.tolist() == [0, 1, 2]
    assert (pool.bias.view(-1) == 0).nonzero().view(-1).tolist() == [0, 1, 4]
    assert pool.positions.view(-1)[[0, 1, 4]].tolist() == [7, 8, 9]
