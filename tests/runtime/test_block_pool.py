"""BlockPool: reference counts, all-or-nothing allocation, and misuse detection."""
import pytest

from kiln.errors import CapacityError
from kiln.runtime.block_pool import BlockPool


def test_allocate_gives_distinct_blocks_with_one_reference():
    """Allocated blocks are distinct, counted once each, and leave the free list."""
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.num_free == 5
    assert set(pool.allocate(5)).isdisjoint(blocks)
    assert pool.num_free == 0


def test_free_returns_blocks_for_reuse():
    """Freed blocks become allocatable again."""
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 2 and all(pool.ref_count(b) == 0 for b in blocks)
    assert sorted(pool.allocate(2)) == sorted(blocks)


def test_fork_shares_blocks_until_the_last_owner_frees():
    """A forked block stays taken until every owner has freed it."""
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    shared = pool.fork(blocks)
    assert shared == blocks and all(pool.ref_count(b) == 2 for b in blocks)
    pool.free(blocks)
    assert pool.num_free == 2 and all(pool.ref_count(b) == 1 for b in blocks)
    pool.free(shared)
    assert pool.num_free == 4


def test_capacity_error_takes_nothing():
    """Asking for more blocks than are free raises CapacityError and leaves the pool unchanged."""
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(CapacityError, match="2 blocks needed, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert [pool.ref_count(b) for b in range(4)] == [1 if b in held else 0 for b in range(4)]
    assert len(pool.allocate(1)) == 1


def test_double_free_and_fork_of_free_block_raise():
    """Freeing a block twice, or forking a free block, is caught instead of corrupting counts."""
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        pool.fork(blocks)
    assert pool.num_free == 2


def test_empty_pool_is_rejected():
    """A pool needs at least one block."""
    with pytest.raises(CapacityError):
        BlockPool(0)
