"""The block manager's prefix cache with no model loaded: keys, sharing, eviction."""

from __future__ import annotations

import pytest

from faser.runner.block_manager import BlockManager


def registered(blocks: BlockManager, tokens: list[int], num_draft: int = 0,
               num_featured: int = 0):
    """A request that computed `tokens` (all of them in the target, `num_draft` in the draft, the
    first `num_featured` with the target's features) and registered them: its table, its keys
    and how many blocks hold the draft's half."""
    table: list[int] = []
    assert blocks.allocate("a", table, len(tokens))
    digests: list[bytes] = []
    marked = blocks.register(table, tokens, digests, len(tokens), num_draft, 0, num_featured)
    return table, digests, marked


def test_a_later_request_shares_the_full_blocks_its_tokens_begin_with():
    blocks = BlockManager(16, 4, prefix_caching=True)
    table, _, _ = registered(blocks, list(range(10)))  # two full blocks, half a third
    assert blocks.num_cached_blocks == 2
    digests: list[bytes] = []
    shared = blocks.share([0, 1, 2, 3, 4, 5, 6, 7, 99], digests)
    assert shared == (table[:2], 0, 0) and len(digests) == 2
    assert blocks.share([0, 1, 2, 3, 5, 5, 6, 7], []).blocks == [table[0]]  # differs in block 2
    assert blocks.share([1, 0, 2, 3], []).blocks == []


def test_a_block_is_keyed_by_every_token_before_it():
    blocks = BlockManager(16, 4, prefix_caching=True)
    registered(blocks, [9, 9, 9, 9, 1, 2, 3, 4])
    assert blocks.share([8, 8, 8, 8, 1, 2, 3, 4], []).blocks == []  # the same second block's tokens


def test_shared_blocks_are_counted_and_freed_once_per_holder():
    blocks = BlockManager(4, 4, prefix_caching=True)
    table, _, _ = registered(blocks, list(range(8)))
    shared = blocks.share(list(range(8)), []).blocks
    assert blocks.num_free_blocks == 2
    blocks.free(table)  # the first holder leaves; the second still reads them
    assert blocks.num_free_blocks == 2
    block = shared[0]
    blocks.free(shared)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 2
    with pytest.raises(AssertionError, match="freed twice"):
        blocks.free([block])


def test_free_blocks_go_first_then_the_least_recently_released_cached_ones():
    blocks = BlockManager(4, 4, prefix_caching=True)
    first, _, _ = registered(blocks, [1] * 4)
    blocks.free(first)
    second, _, _ = registered(blocks, [2] * 4)
    kept = list(second)
    blocks.free(second)
    table: list[int] = []
    assert blocks.allocate("b", table, 8)  # the two never-used blocks
    assert blocks.num_cached_blocks == 2
    assert blocks.allocate("b", table, 12)  # evicts [1] * 4, released first
    assert blocks.share([1] * 4, []).blocks == []
    assert blocks.share([2] * 4, []).blocks == kept


def test_the_drafts_half_is_trusted_only_where_it_was_fed():
    blocks = BlockManager(16, 4, prefix_caching=True)
    tokens = list(range(12))
    table, digests, marked = registered(blocks, tokens, num_draft=5)  # the draft fed 5
    assert marked == 1
    assert blocks.share(tokens, []).num_draft_ready == 1
    assert blocks.register(table, tokens, digests, 12, 12, marked) == 3
    assert blocks.share(tokens, []).num_draft_ready == 3


def test_a_key_held_by_another_block_stays_with_it():
    blocks = BlockManager(16, 4, prefix_caching=True)
    first, _, _ = registered(blocks, [5] * 4)
    kept = list(first)
    second, _, _ = registered(blocks, [5] * 4)  # computed beside the first, before it registered
    blocks.free(second)
    assert blocks.num_cached_blocks == 1 and blocks.num_free_blocks == 15
    assert blocks.share([5] * 4, []).blocks == kept



def test_a_request_that_drafts_from_features_shares_only_blocks_holding_them():
    blocks = BlockManager(16, 4, prefix_caching=True)
    tokens = list(range(12))
    table, _, _ = registered(blocks, tokens, num_featured=6)  # features for the first block only
    assert blocks.share(tokens, []) == (table, 0, 1)
    digests: list[bytes] = []
    assert blocks.share(tokens, digests, featured=True) == (table[:1], 0, 1)
    assert len(digests) == 1


def test_a_block_with_features_takes_the_key_of_one_without():
    """A request that drafts computes again what it could not share; its block then holds the
    key, and the one without features is its holder's own until freed, then free."""
    blocks = BlockManager(16, 4, prefix_caching=True)
    bare, _, _ = registered(blocks, [5] * 4)
    kept = list(bare)
    featured, _, _ = registered(blocks, [5] * 4, num_featured=4)
    assert blocks.share([5] * 4, [], featured=True).blocks == featured
    again, _, _ = registered(blocks, [5] * 4)  # without features: the key stays where it is
    assert blocks.share([5] * 4, []).blocks == featured
    free = blocks.num_free_blocks
    blocks.free(bare)
    assert blocks.num_free_blocks == free + 1 and blocks.num_cached_blocks == 1
    assert kept[0] not in blocks.share([5] * 4, []).blocks
