"""BlockPool: exact block ids, allocation order, ref counts, prefix caching and LRU eviction."""

from __future__ import annotations

import time

import pytest

from kvfit.kv.pool import BlockPool
from kvfit.kv.prefix import hash_full_blocks


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks


# plain allocation -------------------------------------------------------------------------------
def test_fresh_ids_ascend_from_zero():
    pool = BlockPool(10)
    assert counts(pool) == (10, 0, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    assert pool.allocate(2) == [4, 5]
    assert counts(pool) == (4, 6, 0)
    pool.check_invariants()


def test_freed_blocks_are_reused_last_in_first_out():
    pool = BlockPool(10)
    a, b = pool.allocate(3), pool.allocate(2)          # [0, 1, 2], [3, 4]
    pool.free(a)
    # a table is freed tail first, so its head is on top of the stack and comes back first
    assert pool.allocate(1) == [0]
    pool.free(b)
    assert pool.allocate(4) == [3, 4, 1, 2]
    assert pool.allocate(3) == [5, 6, 7]              # then fresh ids again
    pool.check_invariants()


def test_freed_blocks_come_back_before_fresh_ones():
    pool = BlockPool(8)
    pool.allocate(2)
    pool.free([1])
    assert pool.allocate(2) == [1, 2]
    pool.free([2])
    pool.free([0])
    assert pool.allocate(3) == [0, 2, 3]


def test_allocate_is_all_or_nothing():
    pool = BlockPool(5)
    assert pool.allocate(3) == [0, 1, 2]
    before = counts(pool)
    assert pool.allocate(3) is None
    assert counts(pool) == before
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(1) is None
    assert counts(pool) == (0, 5, 0)
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_everything_then_free_everything():
    pool = BlockPool(6)
    table = pool.allocate(6)
    assert table == list(range(6)) and counts(pool) == (0, 6, 0)
    pool.free(table)
    assert counts(pool) == (6, 0, 0)
    assert pool.allocate(6) == list(range(6))
    pool.check_invariants()


def test_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    pool.ref([0])
    pool.ref([0, 1])
    assert pool.ref_count(0) == 3 and pool.ref_count(1) == 2
    pool.free(a)
    assert pool.ref_count(0) == 2 and pool.ref_count(1) == 1 and counts(pool) == (2, 2, 0)
    pool.free([0, 1])
    pool.free([0])
    assert pool.ref_count(0) == 0 and counts(pool) == (4, 0, 0)
    pool.check_invariants()


def test_freeing_an_unused_block_is_a_bug():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises((KeyError, AssertionError)):
        pool.free([0])


# prefix caching ---------------------------------------------------------------------------------
def test_register_and_lookup_used_blocks():
    pool = BlockPool(8, enable_prefix_caching=True)
    table = pool.allocate(3)
    pool.register(0, h(1))
    pool.register(1, h(2))
    assert pool.lookup(h(1)) == 0 and pool.lookup(h(2)) == 1 and pool.lookup(h(3)) is None
    # a second request shares the cached prefix
    pool.ref([pool.lookup(h(1)), pool.lookup(h(2))])
    assert [pool.ref_count(b) for b in table] == [2, 2, 1]
    assert counts(pool) == (5, 3, 0)
    pool.check_invariants()


def test_register_first_writer_wins():
    pool = BlockPool(8, enable_prefix_caching=True)
    pool.allocate(3)
    pool.register(0, h(1))
    pool.register(1, h(1))          # same hash elsewhere: the first block keeps it
    pool.register(0, h(9))          # a block keeps its first hash
    assert pool.lookup(h(1)) == 0 and pool.lookup(h(9)) is None
    pool.free([1])
    assert counts(pool) == (6, 2, 0)    # block 1 had no hash of its own: plain free


def test_register_without_prefix_caching_is_a_no_op():
    pool = BlockPool(4)
    table = pool.allocate(2)
    pool.register(0, h(1))
    assert pool.lookup(h(1)) is None
    pool.free(table)
    assert counts(pool) == (4, 0, 0)


def test_register_of_a_free_block_is_a_bug():
    pool = BlockPool(4, enable_prefix_caching=True)
    with pytest.raises(AssertionError):
        pool.register(0, h(1))


def test_freeing_a_table_caches_its_hashed_blocks_tail_first():
    pool = BlockPool(6, enable_prefix_caching=True)
    table = pool.allocate(4)                   # [0, 1, 2, 3]; 3 is the partial last block
    for i, block in enumerate(table[:3]):
        pool.register(block, h(i))
    pool.free(table)
    assert counts(pool) == (3, 0, 3)         # 3 unhashed -> free; 0, 1, 2 -> cached
    assert list(pool._cached) == [2, 1, 0]   # LRU first: the tail goes first
    assert [pool.lookup(h(i)) for i in range(3)] == [0, 1, 2]
    pool.check_invariants()


def test_cached_blocks_are_evicted_only_when_nothing_plain_is_free():
    pool = BlockPool(6, enable_prefix_caching=True)
    table = pool.allocate(4)
    for i, block in enumerate(table[:3]):
        pool.register(block, h(i))
    pool.free(table)                           # cached LRU: 2, 1, 0; free: 3, fresh 4, 5
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_evictions == 0 and pool.num_cached_blocks == 3
    assert pool.allocate(2) == [2, 1]         # eviction order: least recently freed first
    assert pool.num_evictions == 2
    assert pool.lookup(h(2)) is None and pool.lookup(h(1)) is None and pool.lookup(h(0)) == 0
    assert counts(pool) == (0, 5, 1)
    assert pool.allocate(2) is None           # all or nothing, nothing evicted
    assert pool.num_evictions == 2 and pool.lookup(h(0)) == 0
    pool.check_invariants()


def test_eviction_order_follows_free_order_across_tables():
    pool = BlockPool(6, enable_prefix_caching=True)
    a, b, c = pool.allocate(2), pool.allocate(2), pool.allocate(2)    # [0,1] [2,3] [4,5]
    for n, block in enumerate(a + b + c):
        pool.register(block, h(n))
    pool.free(b)
    pool.free(a)
    pool.free(c)
    # LRU: 3, 2 (b tail first), then 1, 0, then 5, 4
    assert pool.allocate(1) == [3]
    assert pool.allocate(3) == [2, 1, 0]
    assert pool.allocate(2) == [5, 4]
    assert pool.num_evictions == 6 and counts(pool) == (0, 6, 0)
    assert all(pool.lookup(h(n)) is None for n in range(6))
    pool.check_invariants()


def test_a_cache_hit_takes_a_block_out_of_the_lru():
    pool = BlockPool(4, enable_prefix_caching=True)
    table = pool.allocate(3)
    for n, block in enumerate(table):
        pool.register(block, h(n))
    pool.free(table)                          # LRU: 2, 1, 0
    hit = pool.lookup(h(2))
    assert hit == 2
    pool.ref([hit])                           # cached -> used
    assert pool.ref_count(2) == 1 and counts(pool) == (1, 1, 2)
    assert pool.allocate(2) == [3, 1]         # fresh 3 first, then evict LRU 1 (2 is in use)
    pool.free([2])                            # 2 goes to the most recently used end
    assert pool.allocate(2) == [0, 2]
    pool.check_invariants()


def test_a_shared_block_is_cached_only_when_its_last_reference_goes():
    pool = BlockPool(4, enable_prefix_caching=True)
    first = pool.allocate(2)
    pool.register(0, h(0))
    pool.ref([0])
    second = [0] + pool.allocate(1)           # [0, 2]
    pool.free(first)
    assert pool.ref_count(0) == 1 and pool.num_cached_blocks == 0 and counts(pool) == (2, 2, 0)
    pool.free(second)
    assert pool.ref_count(0) == 0 and counts(pool) == (3, 0, 1)
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(6, enable_prefix_caching=True)
    kept, dropped = pool.allocate(2), pool.allocate(2)
    for n, block in enumerate(kept + dropped):
        pool.register(block, h(n))
    pool.free(dropped)
    assert counts(pool) == (2, 2, 2)
    pool.reset_prefix_cache()
    assert counts(pool) == (4, 2, 0)
    assert pool.lookup(h(2)) is None and pool.lookup(h(3)) is None
    assert pool.lookup(h(0)) == 0 and pool.lookup(h(1)) == 1      # blocks in use keep their hashes
    assert pool.num_evictions == 0
    pool.check_invariants()
    assert sorted(pool.allocate(4)) == [2, 3, 4, 5]
    pool.free(kept)
    assert counts(pool) == (0, 4, 2)


def test_request_flow_with_prefix_hashes():
    """Two requests with a common 2-block prefix share it; after both end everything is free or cached."""
    pool = BlockPool(16, enable_prefix_caching=True)
    bs = 4
    prompt_a = list(range(100, 110))                  # 2 full blocks + 2 tokens
    prompt_b = list(range(100, 108)) + [7, 7, 7, 7, 7]
    hashes_a = hash_full_blocks(prompt_a, bs)
    table_a = pool.allocate(3)
    for block, bh in zip(table_a, hashes_a):
        pool.register(block, bh)
    hashes_b = hash_full_blocks(prompt_b, bs)
    assert hashes_b[:2] == hashes_a and len(hashes_b) == 3
    hits = [pool.lookup(x) for x in hashes_b]
    assert hits == [0, 1, None]
    pool.ref(hits[:2])
    table_b = hits[:2] + pool.allocate(2)
    assert table_b == [0, 1, 3, 4]
    pool.register(table_b[2], hashes_b[2])
    assert [pool.ref_count(b) for b in range(5)] == [2, 2, 1, 1, 1]
    pool.free(table_a)
    pool.free(table_b)
    assert pool.num_used_blocks == 0
    assert counts(pool) == (16 - 3, 0, 3)
    pool.check_invariants()


# scale ------------------------------------------------------------------------------------------
def test_construction_of_a_huge_pool_touches_no_block():
    pool = BlockPool(10**7, enable_prefix_caching=True)
    # structure, not time: nothing is materialised per block
    assert pool._free == [] and len(pool._cached) == 0 and pool.num_used_blocks == 0
    assert pool._next_fresh == 0
    assert counts(pool) == (10**7, 0, 0)
    assert pool.allocate(3) == [0, 1, 2]


def test_construction_time_does_not_grow_with_the_pool():
    start = time.perf_counter()
    for _ in range(100):
        BlockPool(10**7)
    per_pool = (time.perf_counter() - start) / 100
    assert per_pool < 0.005, f"constructing a 10^7-block pool took {per_pool * 1e3:.2f} ms"

