"""Block pool accounting: allocation grows tables, free returns every block, exhaustion is a clear error."""
from __future__ import annotations

import pytest

from tokenrouter.engine.block_manager import BlockManager, KVState, OutOfBlocks


def test_allocate_grows_the_table_by_whole_blocks():
    blocks = BlockManager(num_blocks=8, block_size=4)
    kv = KVState()
    blocks.allocate(kv, 5)
    assert len(kv.block_table) == 2 and blocks.num_free_blocks == 6
    blocks.allocate(kv, 8)  # still fits in two blocks
    assert len(kv.block_table) == 2
    blocks.allocate(kv, 9)
    assert len(kv.block_table) == 3 and len(set(kv.block_table)) == 3


def test_free_returns_every_block_and_resets_the_watermark():
    blocks = BlockManager(num_blocks=8, block_size=4)
    kvs = [KVState() for _ in range(3)]
    for i, kv in enumerate(kvs):
        blocks.allocate(kv, 3 + 4 * i)
        kv.num_cached = 3 + 4 * i
    assert blocks.num_used_blocks == 1 + 2 + 3
    for kv in kvs:
        blocks.free(kv)
        assert kv.block_table == [] and kv.num_cached == 0
    assert blocks.num_free_blocks == 8
    assert sorted(blocks.free_blocks) == list(range(8))


def test_exhaustion_raises_and_allocates_nothing():
    blocks = BlockManager(num_blocks=4, block_size=4)
    kv, other = KVState(), KVState()
    blocks.allocate(other, 12)
    assert not blocks.can_allocate(kv, 8)
    with pytest.raises(OutOfBlocks, match="2 more blocks of 4, 1 of 4 are free"):
        blocks.allocate(kv, 8)
    assert kv.block_table == [] and blocks.num_free_blocks == 1


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
