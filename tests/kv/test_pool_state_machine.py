"""BlockPool against a model of who holds which block (hypothesis RuleBasedStateMachine).

The model keeps tables (request -> its blocks), the plain free stack, fresh ids, and an OrderedDict of
cached free blocks in LRU order. Every allocation must hand out exactly the ids the model predicts:
plain free blocks last-in-first-out, then fresh ids ascending, then cached blocks least recently freed
first. After every step: free + used + cached == total, each block's ref count equals the number of
tables holding it, and the pool's own check_invariants() passes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfit.kv.pool import BlockPool

HASHES = [bytes([n]) * 16 for n in range(10)]   # few hashes, so collisions and re-registrations happen


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), prefix_caching=st.sampled_from([True, True, False]))
    def start(self, num_blocks, prefix_caching):
        self.pool = BlockPool(num_blocks, enable_prefix_caching=prefix_caching)
        self.total = num_blocks
        self.prefix_caching = prefix_caching
        self.tables: dict[int, list[int]] = {}
        self.next_table = 0
        self.free_stack: list[int] = []
        self.next_fresh = 0
        self.cached: OrderedDict[int, bytes] = OrderedDict()   # LRU first
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.evictions = 0

    # model helpers ----------------------------------------------------------------------------
    @property
    def num_plain_free(self) -> int:
        return len(self.free_stack) + self.total - self.next_fresh

    def holders(self) -> Counter:
        return Counter(b for table in self.tables.values() for b in table)

    def expected_allocation(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free_stack:
                out.append(self.free_stack.pop())
            elif self.next_fresh < self.total:
                out.append(self.next_fresh)
                self.next_fresh += 1
            else:
                block, block_hash = self.cached.popitem(last=False)
                del self.hash_of[block], self.block_of[block_hash]
                self.evictions += 1
                out.append(block)
        return out

    def add_table(self, blocks: list[int]) -> None:
        self.tables[self.next_table] = blocks
        self.next_table += 1

    def pick_table(self, index: int) -> int:
        return sorted(self.tables)[index % len(self.tables)]

    # rules ------------------------------------------------------------------------------------
    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        allocatable = self.num_plain_free + len(self.cached)
        got = self.pool.allocate(n)
        if n > allocatable:
            assert got is None, f"allocate({n}) with {allocatable} allocatable returned {got}"
            return
        expected = self.expected_allocation(n)
        assert got == expected
        held = set(self.holders())
        assert not held & set(got), "a block was handed out twice"
        self.add_table(got)

    @precondition(lambda self: self.cached)
    @rule(k=st.integers(1, 12))
    def evict_by_pressure(self, k):
        """Ask for every plain free block plus k cached ones: exactly the k least recently freed go."""
        k = min(k, len(self.cached))
        lru = list(self.cached)[:k]
        lru_hashes = [self.cached[b] for b in lru]
        n = self.num_plain_free + k
        got = self.pool.allocate(n)
        expected = self.expected_allocation(n)
        assert got == expected and got[-k:] == lru
        for block_hash in lru_hashes:
            assert self.pool.lookup(block_hash) is None
        self.add_table(got)

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def free_table(self, index):
        table = self.tables.pop(self.pick_table(index))
        self.pool.free(table)
        still_held = self.holders()
        for block in reversed(table):
            if still_held[block] or block in self.cached or block in self.free_stack:
                continue
            if block in self.hash_of:
                self.cached[block] = self.hash_of[block]     # most recently freed end
            else:
                self.free_stack.append(block)

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), position=st.integers(0, 20), hash_index=st.integers(0, len(HASHES) - 1))
    def register(self, index, position, hash_index):
        table = self.tables[self.pick_table(index)]
        if not table:
            return
        block, block_hash = table[position % len(table)], HASHES[hash_index]
        self.pool.register(block, block_hash)
        if self.prefix_caching and block not in self.hash_of and block_hash not in self.block_of:
            self.hash_of[block], self.block_of[block_hash] = block_hash, block

    @rule(hash_index=st.integers(0, len(HASHES) - 1))
    def lookup_and_ref(self, hash_index):
        block_hash = HASHES[hash_index]
        block = self.pool.lookup(block_hash)
        assert block == self.block_of.get(block_hash)
        if block is None:
            return
        self.pool.ref([block])
        self.cached.pop(block, None)
        self.add_table([block])

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        for block, block_hash in self.cached.items():
            self.free_stack.append(block)
            del self.hash_of[block], self.block_of[block_hash]
        self.cached.clear()

    @rule()
    def end_every_request(self):
        """After every request ends, all blocks are free or cached-free."""
        while self.tables:
            self.free_table(0)
        assert self.pool.num_used_blocks == 0
        assert self.pool.num_free_blocks + self.pool.num_cached_blocks == self.total

    # invariants -------------------------------------------------------------------------------
    @invariant()
    def counts_add_up(self):
        pool = self.pool
        assert pool.num_free_blocks + pool.num_used_blocks + pool.num_cached_blocks == self.total
        held = self.holders()
        assert pool.num_used_blocks == len(held)
        assert pool.num_cached_blocks == len(self.cached)
        assert pool.num_free_blocks == self.num_plain_free
        assert pool.num_allocatable_blocks == self.total - len(held)
        assert pool.num_evictions == self.evictions

    @invariant()
    def shared_blocks_have_matching_ref_counts(self):
        held = self.holders()
        for block in range(self.total):
            assert self.pool.ref_count(block) == held[block]
        assert not set(held) & set(self.cached) and not set(held) & set(self.free_stack)

    @invariant()
    def lookups_match_the_model(self):
        for block_hash in HASHES:
            assert self.pool.lookup(block_hash) == self.block_of.get(block_hash)
        assert all(block in self.hash_of for block in self.cached)

    @invariant()
    def pool_invariants(self):
        self.pool.check_invariants()



PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockPoolStateMachine = PoolMachine.TestCase
