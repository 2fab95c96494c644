"""KVCacheManager: exact block ids of tables, prefix sharing with ref counts, the at-least-one-token rule,
all-or-nothing grow, free and eviction order, commit cost and idempotence, prefix caching off, counters."""

from __future__ import annotations

import pytest

import kvfit.kv.manager as manager_module
from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.kv.prefix import hash_full_blocks

BS = 4   # tokens per block in every test


def make(num_blocks: int, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_prefix_caching=prefix_caching), BS)


def counts(kv: KVCacheManager) -> tuple[int, int, int]:
    pool = kv.pool
    return pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks


def refs(kv: KVCacheManager, num_blocks: int) -> list[int]:
    return [kv.pool.ref_count(b) for b in range(num_blocks)]


def registered(kv: KVCacheManager, token_ids: list[int]) -> list[int | None]:
    """The block holding each full block of token_ids in the prefix cache (None: not cached)."""
    return [kv.pool.lookup(x) for x in hash_full_blocks(token_ids, BS)]


# grow and free ----------------------------------------------------------------------------------
def test_grow_appends_exact_ids():
    kv = make(10, prefix_caching=False)
    assert kv.block_ids("a") == () and kv.num_requests == 0
    assert kv.grow("a", 5) == [0, 1]
    assert kv.grow("a", 8) == []                 # covered: nothing new
    assert kv.grow("a", 9) == [2]
    assert kv.grow("b", 1) == [3]
    assert kv.grow("a", 0) == []
    assert list(kv.block_ids("a")) == [0, 1, 2] and list(kv.block_ids("b")) == [3]
    assert kv.num_requests == 2 and counts(kv) == (6, 4, 0)
    kv.check_invariants()


def test_num_blocks_short():
    kv = make(10)
    assert [kv.num_blocks_short("a", n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    kv.grow("a", 6)
    assert [kv.num_blocks_short("a", n) for n in (0, 1, 8, 9, 17)] == [0, 0, 0, 1, 3]


def test_grow_is_all_or_nothing():
    kv = make(4, prefix_caching=False)
    assert kv.grow("a", 12) == [0, 1, 2]
    before = counts(kv)
    assert kv.grow("b", 8) is None               # needs 2, 1 allocatable
    assert counts(kv) == before and kv.block_ids("b") == () and kv.num_requests == 1   # no table started
    assert kv.grow("a", 20) is None              # needs 2 more for a
    assert list(kv.block_ids("a")) == [0, 1, 2]
    assert kv.grow("b", 4) == [3]
    assert kv.grow("b", 5) is None and list(kv.block_ids("b")) == [3]
    assert counts(kv) == (0, 4, 0)
    kv.check_invariants()


def test_free_gives_the_table_back_tail_first():
    kv = make(10, prefix_caching=False)
    kv.grow("a", 12)                             # [0, 1, 2]
    kv.grow("b", 4)                              # [3]
    kv.free("a")
    assert kv.block_ids("a") == () and kv.num_requests == 1 and counts(kv) == (9, 1, 0)
    # the tail went back first, so the head is on top of the free stack
    assert kv.grow("c", 8) == [0, 1]
    assert kv.grow("c", 16) == [2, 4]
    kv.free("b")
    kv.free("c")
    assert counts(kv) == (10, 0, 0) and kv.num_requests == 0
    kv.check_invariants()


def test_freeing_an_unknown_request_is_a_no_op():
    kv = make(4)
    kv.grow("a", 4)
    kv.free("nobody")
    kv.free("a")
    kv.free("a")
    assert counts(kv) == (4, 0, 0) and kv.num_requests == 0


# prefix caching ---------------------------------------------------------------------------------
def test_two_requests_share_a_cached_prefix():
    kv = make(16)
    a = list(range(100, 110))                    # 2 full blocks + 2 tokens
    b = list(range(100, 108)) + [7] * 5          # a's 2 blocks, then 1 full block + 1 token
    assert kv.lookup_prefix("a", a) == 0
    assert kv.grow("a", len(a)) == [0, 1, 2]
    kv.commit("a", a, len(a))
    assert registered(kv, a) == [0, 1]
    assert kv.lookup_prefix("b", b) == 8
    assert list(kv.block_ids("b")) == [0, 1]
    assert refs(kv, 3) == [2, 2, 1]
    assert kv.grow("b", len(b)) == [3, 4]
    kv.commit("b", b, len(b))
    assert registered(kv, b) == [0, 1, 3]
    kv.check_invariants()
    kv.free("a")                                 # 2 unhashed: plain free; 0, 1 still held by b
    assert refs(kv, 5) == [1, 1, 0, 1, 1] and counts(kv) == (12, 4, 0)
    kv.free("b")                                 # 4 plain free; 3, 1, 0 cached
    assert counts(kv) == (13, 0, 3)
    kv.check_invariants()


def test_at_least_one_token_is_left_to_compute():
    kv = make(16)
    prompt = list(range(12))                     # exactly 3 full blocks
    kv.lookup_prefix("a", prompt)
    kv.grow("a", 12)
    kv.commit("a", prompt, 12)
    assert registered(kv, prompt) == [0, 1, 2]
    # the same 12 tokens: the last block is recomputed, so the last token gets its logits
    assert kv.lookup_prefix("b", prompt) == 8 and list(kv.block_ids("b")) == [0, 1]
    assert kv.lookup_prefix("c", prompt + [99]) == 12 and list(kv.block_ids("c")) == [0, 1, 2]
    assert kv.lookup_prefix("d", prompt[:4]) == 0 and list(kv.block_ids("d")) == []
    assert kv.lookup_prefix("e", prompt[:5]) == 4 and list(kv.block_ids("e")) == [0]
    assert kv.lookup_prefix("f", prompt[:1]) == 0
    assert refs(kv, 3) == [4, 3, 2]          # held by a, b, c, e / a, b, c / a, c
    kv.check_invariants()


def test_cached_free_blocks_are_taken_back():
    kv = make(8)
    prompt = list(range(9))                      # 2 full blocks + 1 token
    kv.lookup_prefix("a", prompt)
    kv.grow("a", 9)                              # [0, 1, 2]
    kv.commit("a", prompt, 9)
    kv.free("a")                                 # 2 plain free; 1, 0 cached
    assert counts(kv) == (6, 0, 2)
    assert kv.lookup_prefix("b", prompt) == 8
    assert list(kv.block_ids("b")) == [0, 1] and counts(kv) == (6, 2, 0)
    assert kv.grow("b", 9) == [2]
    kv.check_invariants()


def test_eviction_takes_the_tail_first_and_a_lookup_stops_at_the_first_miss():
    kv = make(4)
    prompt = list(range(13))                     # 3 full blocks + 1 token
    kv.lookup_prefix("a", prompt)
    assert kv.grow("a", 13) == [0, 1, 2, 3]
    kv.commit("a", prompt, 13)
    kv.free("a")                                 # 3 plain free; cached LRU: 2, 1, 0
    assert counts(kv) == (1, 0, 3)
    assert kv.grow("x", 5) == [3, 2]             # the plain free block, then the tail is evicted
    assert kv.pool.num_evictions == 1
    assert registered(kv, prompt) == [0, 1, None]
    # block 2's hash is gone: the chain is found up to it only
    assert kv.lookup_prefix("b", prompt) == 8 and list(kv.block_ids("b")) == [0, 1]
    assert kv.grow("b", 13) is None              # all or nothing: b keeps its hits only
    assert list(kv.block_ids("b")) == [0, 1] and counts(kv) == (0, 4, 0)
    kv.free("x")
    assert kv.grow("b", 13) == [3, 2]
    kv.commit("b", prompt, 13)                   # the missed block's hash, kept from the lookup, is reused
    assert registered(kv, prompt) == [0, 1, 3]
    kv.check_invariants()


def test_a_lookup_stops_at_the_first_miss_even_when_a_later_block_is_cached():
    """Blocks are found as a chain: a cached block whose parent block is gone is not a hit."""
    kv = make(8)
    prompt = list(range(13))                     # 3 full blocks + 1 token
    kv.lookup_prefix("a", prompt)
    kv.lookup_prefix("b", prompt)
    assert kv.grow("a", 8) == [0, 1] and kv.grow("b", 8) == [2, 3]
    kv.commit("a", prompt, 8)
    kv.commit("b", prompt, 8)                    # a was first: b's 2, 3 get no hash
    assert kv.grow("b", 13) == [4, 5]
    kv.commit("b", prompt, 12)                   # b's third block is the first with its hash
    assert registered(kv, prompt) == [0, 1, 4]
    kv.free("a")                                 # cached LRU: 1, 0
    kv.free("b")                                 # 5, 3, 2 plain free; cached LRU: 1, 0, 4
    assert counts(kv) == (5, 0, 3)
    assert kv.grow("x", 28) == [2, 3, 5, 6, 7, 1, 0]
    assert registered(kv, prompt) == [None, None, 4]
    kv.free("x")
    assert kv.lookup_prefix("c", prompt) == 0 and list(kv.block_ids("c")) == []
    kv.check_invariants()


def test_a_failed_admission_gives_its_hits_back_to_the_cache():
    """The scheduler's admission: lookup, grow fails, free; the hit blocks are cached-free again."""
    kv = make(4)
    prompt = list(range(9))
    kv.lookup_prefix("a", prompt)
    kv.grow("a", 9)                              # [0, 1, 2]
    kv.commit("a", prompt, 9)
    kv.free("a")                                 # 2 plain free; cached LRU: 1, 0
    assert kv.grow("x", 8) == [2, 3]
    assert counts(kv) == (0, 2, 2)
    longer = prompt[:8] + [50, 51, 52, 53, 54]
    assert kv.lookup_prefix("b", longer) == 8 and counts(kv) == (0, 4, 0)
    assert kv.grow("b", len(longer)) is None
    kv.free("b")
    assert counts(kv) == (0, 2, 2) and kv.num_requests == 1
    assert registered(kv, prompt) == [0, 1]
    assert kv.grow("y", 4) == [1]                # LRU order kept: b freed its tail (1) first
    kv.check_invariants()


def test_a_resumed_request_hits_its_own_output_blocks():
    """Preemption frees the table; the lookup at resumption passes prompt + output tokens."""
    kv = make(8)
    tokens = [1, 2, 3, 4, 5, 6]
    kv.lookup_prefix("r", tokens)
    kv.grow("r", 6)                              # [0, 1]
    kv.commit("r", tokens, 6)
    for token in (50, 51, 52):                   # decode: one token per step
        kv.commit("r", tokens, len(tokens))
        tokens.append(token)
        kv.grow("r", len(tokens))
    kv.commit("r", tokens, len(tokens))
    assert list(kv.block_ids("r")) == [0, 1, 2] and registered(kv, tokens) == [0, 1]
    kv.free("r")                                 # preempted
    assert counts(kv) == (6, 0, 2)
    assert kv.lookup_prefix("r", tokens) == 8    # block 1 holds outputs 50, 51
    assert list(kv.block_ids("r")) == [0, 1]
    kv.check_invariants()


def test_a_freed_request_looked_up_again_starts_fresh():
    kv = make(8)
    first, second = list(range(9)), list(range(200, 209))
    kv.lookup_prefix("a", first)
    kv.grow("a", 9)
    kv.commit("a", first, 9)
    kv.free("a")
    assert kv.lookup_prefix("a", second) == 0    # the same id, other tokens: no stale hashes
    assert kv.grow("a", 9) == [2, 3, 4]
    kv.commit("a", second, 9)
    assert registered(kv, second) == [2, 3] and registered(kv, first) == [0, 1]
    kv.check_invariants()


def test_a_second_lookup_without_free_is_a_bug():
    kv = make(4)
    kv.lookup_prefix("a", [1, 2, 3])
    with pytest.raises(AssertionError):
        kv.lookup_prefix("a", [1, 2, 3])


def test_the_same_block_computed_twice_is_registered_once():
    kv = make(8)
    prompt = list(range(9))
    assert kv.lookup_prefix("a", prompt) == 0 and kv.lookup_prefix("b", prompt) == 0
    assert kv.grow("a", 9) == [0, 1, 2] and kv.grow("b", 9) == [3, 4, 5]
    kv.commit("a", prompt, 9)
    kv.commit("b", prompt, 9)                    # first writer wins: 3, 4 get no hash
    assert registered(kv, prompt) == [0, 1]
    assert kv.lookup_prefix("c", prompt) == 8 and list(kv.block_ids("c")) == [0, 1]
    kv.free("b")                                 # unhashed: plain free, not cached
    assert counts(kv) == (5, 3, 0) and refs(kv, 3) == [2, 2, 1]
    kv.check_invariants()


# commit -----------------------------------------------------------------------------------------
def test_commit_registers_only_computed_full_blocks():
    kv = make(8)
    prompt = list(range(10))
    kv.lookup_prefix("a", prompt)
    assert kv.grow("a", 6) == [0, 1]             # a chunk of 6 tokens
    kv.commit("a", prompt, 3)
    assert registered(kv, prompt) == [None, None]
    kv.commit("a", prompt, 6)                    # block 1 is half computed: not registered
    assert registered(kv, prompt) == [0, None]
    assert kv.grow("a", 10) == [2]
    kv.commit("a", prompt, 10)
    assert registered(kv, prompt) == [0, 1]
    with pytest.raises(AssertionError):
        kv.commit("a", prompt + [1, 2, 3], 13)    # K/V beyond the table
    kv.check_invariants()


def test_commit_is_idempotent():
    kv = make(8)
    prompt = list(range(9))
    kv.lookup_prefix("a", prompt)
    kv.grow("a", 9)
    kv.commit("a", prompt, 9)
    before = (registered(kv, prompt), counts(kv), refs(kv, 3))
    kv.commit("a", prompt, 9)
    kv.commit("a", prompt, 4)                    # fewer tokens than committed: nothing to do
    kv.commit("a", prompt, 0)
    assert (registered(kv, prompt), counts(kv), refs(kv, 3)) == before == ([0, 1], (5, 3, 0), [1, 1, 1])
    kv.check_invariants()


def test_commit_hashes_and_registers_each_block_once(monkeypatch):
    """The cost contract: commit runs every step for every request; it touches only new full blocks."""
    calls = {"hash": 0, "register": 0}
    real_hash, real_register = manager_module.hash_block, BlockPool.register

    def counting_hash(parent, token_ids, cache_salt=None):
        calls["hash"] += 1
        return real_hash(parent, token_ids, cache_salt)

    def counting_register(self, block_id, block_hash):
        calls["register"] += 1
        return real_register(self, block_id, block_hash)

    monkeypatch.setattr(manager_module, "hash_block", counting_hash)
    monkeypatch.setattr(BlockPool, "register", counting_register)
    kv = make(32)
    tokens = list(range(14))                     # 3 full blocks + 2 tokens
    kv.lookup_prefix("a", tokens)                # hashes block 0 (a miss) and stops
    assert calls == {"hash": 1, "register": 0}
    kv.grow("a", 14)
    kv.commit("a", tokens, 14)                   # block 0's hash is reused
    assert calls == {"hash": 3, "register": 3}
    for step in range(22):                       # decode
        tokens.append(1000 + step)
        kv.grow("a", len(tokens))
        kv.commit("a", tokens, len(tokens))
    assert len(tokens) == 36
    assert calls == {"hash": 9, "register": 9}   # one per full block, never again
    assert registered(kv, tokens) == list(kv.block_ids("a"))
    # a request hitting 8 blocks hashes 9 (the miss included) and registers only what it computes
    other = tokens[:32] + [7, 7, 7, 7, 7]
    assert kv.lookup_prefix("b", other) == 32
    assert calls == {"hash": 18, "register": 9}
    kv.grow("b", 37)
    kv.commit("b", other, 37)
    assert calls == {"hash": 18, "register": 10}
    kv.check_invariants()


# prefix caching off ----------------------------------------------------------------------------
def test_prefix_caching_off_shares_nothing():
    kv = make(8, prefix_caching=False)
    prompt = list(range(9))
    assert kv.lookup_prefix("a", prompt) == 0 and list(kv.block_ids("a")) == []
    assert kv.grow("a", 9) == [0, 1, 2]
    kv.commit("a", prompt, 9)
    assert registered(kv, prompt) == [None, None]
    assert kv.lookup_prefix("b", prompt) == 0 and list(kv.block_ids("b")) == []
    assert kv.grow("b", 9) == [3, 4, 5]
    kv.free("a")
    kv.free("b")
    assert counts(kv) == (8, 0, 0)               # nothing cached
    kv.check_invariants()


def test_num_requests_counts_tables_from_lookup_or_grow_until_free():
    kv = make(8)
    kv.lookup_prefix("a", [1, 2, 3])
    kv.grow("b", 4)
    assert kv.num_requests == 2
    kv.free("a")
    kv.free("x")
    assert kv.num_requests == 1


# invariants -------------------------------------------------------------------------------------
def test_check_invariants_catches_a_ref_count_no_table_explains():
    kv = make(8)
    kv.grow("a", 8)                              # [0, 1]
    kv.check_invariants()
    kv.pool.ref([0])                             # a second reference, but only one table
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_check_invariants_catches_a_used_block_in_no_table():
    kv = make(8)
    kv.grow("a", 4)
    kv.pool.allocate(1)                          # behind the manager's back
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_kv_imports_neither_torch_nor_config():
    import subprocess
    import sys
    code = ("import sys, kvfit.kv.manager, kvfit.kv.pool, kvfit.kv.prefix; "
            "bad = [m for m in ('torch', 'kvfit.config') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# common prefix (cascade attention) ----------------------------------------------------------------
def _admit(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    kv.lookup_prefix(request_id, tokens)
    kv.grow(request_id, len(tokens))
    kv.commit(request_id, tokens, len(tokens))


def test_num_common_prefix_blocks_counts_leading_blocks_every_table_holds():
    kv = make(30)
    shared = list(range(1, 13))                                  # three full blocks
    _admit(kv, "a", shared + [50, 51])
    assert kv.num_common_prefix_blocks("a") == 3                 # alone: its computed full blocks
    _admit(kv, "b", shared + [60, 61, 62, 63, 64])
    _admit(kv, "c", shared[:8] + [70, 71, 72, 73, 74])           # shares two blocks only
    a, b, c = (list(kv.block_ids(r)) for r in "abc")
    assert a[:3] == b[:3] and c[:2] == a[:2] and c[2] != a[2]
    assert [kv.num_common_prefix_blocks(r) for r in "abc"] == [2, 2, 2]
    kv.free("c")
    assert kv.num_common_prefix_blocks("a") == 3 and kv.num_common_prefix_blocks("b") == 3
    _admit(kv, "d", [90, 91, 92, 93, 94])                        # shares nothing
    assert kv.num_common_prefix_blocks("a") == 0
    assert kv.num_common_prefix_blocks("unknown") == 0


def test_num_common_prefix_blocks_is_zero_with_prefix_caching_off():
    kv = make(30, prefix_caching=False)
    for rid in "ab":
        _admit(kv, rid, list(range(1, 13)))
    assert kv.num_common_prefix_blocks("a") == 0


def test_duplicate_blocks_of_one_prompt_count_as_common_and_only_once_computed():
    # requests admitted together compute a shared prompt each: different block ids, the same contents
    kv = make(30)
    shared = list(range(1, 13))
    for rid, tail in (("a", [50]), ("b", [60, 61])):
        kv.lookup_prefix(rid, shared + tail)
        kv.grow(rid, len(shared) + len(tail))
    assert kv.num_common_prefix_blocks("a") == 0               # nothing computed (committed) yet
    kv.commit("a", shared + [50], 8)
    kv.commit("b", shared + [60, 61], 13)
    assert set(kv.block_ids("a")[:3]).isdisjoint(kv.block_ids("b")[:3])
    assert kv.num_common_prefix_blocks("a") == 2 and kv.num_common_prefix_blocks("b") == 2   # a has 2 computed
    kv.commit("a", shared + [50], 13)
    assert kv.num_common_prefix_blocks("b") == 3
    _admit(kv, "c", shared + [70])                               # hits the registered copy
    assert kv.num_common_prefix_blocks("c") == 3
    kv.check_invariants()
    for rid in "abc":
        kv.free(rid)
    kv.check_invariants()
    assert kv._content_holders == {}


def test_a_salted_prompt_shares_no_prefix_with_an_unsalted_one():
    kv = make(30)
    shared = list(range(1, 13))
    _admit(kv, "a", shared + [50])
    kv.lookup_prefix("b", shared + [60], cache_salt="tenant-b")
    kv.grow("b", 13)
    kv.commit("b", shared + [60], 13)
    assert kv.num_common_prefix_blocks("a") == 0 == kv.num_common_prefix_blocks("b")
