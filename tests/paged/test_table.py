"""The host-side block table: slot choice, holes, forgetting, repack plans."""

import numpy as np

from kvzap.paged.table import BlockTable


def _table_with(q_len, heads=2, block_size=4):
    table = BlockTable.empty(heads, block_size)
    table.take_blocks(table.blocks_needed(q_len))
    table.place(0, q_len)
    return table


def test_place_fills_each_head_s_blocks_in_order_and_takes_blocks_as_a_prefix():
    table = _table_with(6)
    assert table.blocks_needed(2) == []  # each head's 2 blocks hold 8 slots: 2 more fit
    assert table.n_used == 4 and sorted(b for blocks in table.blocks for b in blocks) == [0, 1, 2, 3]
    assert table.n == [6, 6] and table.end == [6, 6]
    for i in range(2):
        slots = table.slot[i, :6]
        assert len(set(slots.tolist())) == 6 and all(s // 4 in table.blocks[i] for s in slots)
    assert (table.slot[:, 6:] == -1).all()


def test_forgotten_slots_become_holes_that_the_next_appends_fill_first():
    table = _table_with(6)
    freed = int(table.slot[0, 2])
    table.forget(np.array([0]), np.array([2]))
    assert table.slot[0, 2] == -1 and table.n == [5, 6] and table.holes == [[freed], []]
    slots, reused = table.place(6, 1)
    assert reused and slots[0, 0] == freed and table.holes == [[], []]
    assert table.n == [6, 7] and table.end == [6, 7]  # head 0 reused its hole, head 1 took a fresh slot
    slots, reused = table.place(7, 1, use_holes=False)
    assert not reused


def test_pack_plans_put_each_head_s_pairs_in_consecutive_blocks_in_position_order():
    table = _table_with(6)
    table.forget(np.array([0, 0, 1]), np.array([1, 4, 0]))
    plan = table.pack_plan(seen=6)
    assert plan.counts.tolist() == [4, 5] and plan.n_blocks.tolist() == [1, 2]
    assert plan.positions.tolist() == [0, 2, 3, 5, 1, 2, 3, 4, 5]
    assert plan.dst.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert plan.src.tolist() == [int(table.slot[i, p]) for i, p in [(0, 0), (0, 2), (0, 3), (0, 5)]] + [
        int(table.slot[1, p]) for p in range(1, 6)
    ]
    assert plan.owner.tolist() == [0, 1, 1]
    # Batch reorders: new head i copies old head rows[i].
    assert table.pack_plan(seen=6, rows=[1, 1]).counts.tolist() == [5, 5]
    table.adopt(plan, seen=6)
    assert table.blocks == [[0], [1, 2]] and table.n_used == 3 and table.holes == [[], []]
    assert table.slot[0, :6].tolist() == [0, -1, 1, 2, -1, 3]


def test_dense_plans_keep_only_the_kept_pairs():
    table = BlockTable.empty(2, 4)
    keep = np.array([[True, False, True], [False, False, True]])
    plan = table.dense_plan(keep)
    assert plan.src.tolist() == [0, 2, 5] and plan.positions.tolist() == [0, 2, 2]
    assert plan.counts.tolist() == [2, 1] and plan.dst.tolist() == [0, 1, 4]


def test_copies_are_independent():
    table = _table_with(6)
    copy = table.copy()
    table.forget(np.array([0]), np.array([0]))
    table.place(6, 2)
    assert copy.n == [6, 6] and copy.holes == [[], []] and (copy.slot[:, 6:] == -1).all()
