"""Allocate, grow, roll back and free never leak a block nor hand one out twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faser.runner.block_manager import BlockManager


def test_allocate_covers_slots_and_rollback_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    assert bm.allocate("a", table, 9)  # 9 slots -> 3 blocks
    assert len(table) == 3 and bm.num_free_blocks == 5
    assert bm.allocate("a", table, 12) and len(table) == 3  # still fits
    bm.truncate(table, 5)  # rejected draft positions: keep 2 blocks
    assert len(table) == 2 and bm.num_free_blocks == 6
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 8


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    table: list[int] = []
    assert not bm.allocate("a", table, 9)
    assert table == [] and bm.num_free_blocks == 2


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "truncate", "free"]), st.integers(0, 4),
              st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_never_leak_or_double_use(operations):
    bm = BlockManager(num_blocks=16, block_size=4)
    tables: list[list[int]] = [[] for _ in range(5)]
    for op, who, slots in operations:
        table = tables[who]
        if op == "alloc":
            before = list(table)
            ok = bm.allocate(str(who), table, slots)
            assert ok or table == before
            if ok:
                assert len(table) * 4 >= slots
        elif op == "truncate":
            bm.truncate(table, slots)
            assert len(table) <= -(-slots // 4) or not table
        else:
            bm.free(table)
        in_use = [b for t in tables for b in t]
        assert len(in_use) == len(set(in_use))  # no block shared
        assert len(in_use) + bm.num_free_blocks == 16  # none leaked
    for table in tables:
        bm.free(table)
    assert bm.num_free_blocks == 16
