"""KVCacheManager driven like the scheduler drives it (hypothesis RuleBasedStateMachine).

Requests are admitted (lookup_prefix, then grow or free), compute chunks and decode tokens (grow,
then commit), are preempted (free, later resumed with prompt + output) and finish (free). The model
records, for every block, the tokens whose K/V it holds (a block's K/V at a position depends on every
token up to it, so the model keeps the whole prefix). The properties:
- a prefix hit hands out only blocks holding exactly the request's prefix, and stops at the first
  block the cache does not hold (or one short of the last token);
- nobody writes into a block another table holds;
- grow is all or nothing and only appends; num_blocks_short agrees with it;
- after every step kv.check_invariants() passes (ref counts == tables holding each block) and
  after every request ends no block is used.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.kv.prefix import hash_full_blocks

BS = 2                                                         # tokens per block: blocks fill fast
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=9)   # a tiny alphabet: prefixes collide


class _Req:
    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.num_computed_tokens = 0


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 14), prefix_caching=st.sampled_from([True, True, False]))
    def start(self, num_blocks, prefix_caching):
        self.kv = KVCacheManager(BlockPool(num_blocks, enable_prefix_caching=prefix_caching), BS)
        self.prefix_caching = prefix_caching
        self.running: dict[str, _Req] = {}
        self.waiting: dict[str, _Req] = {}
        self.next_id = 0
        self.content: dict[int, tuple[int, ...]] = {}   # block -> the token prefix its K/V was computed for

    # model helpers ----------------------------------------------------------------------------
    def pick(self, requests: dict[str, _Req], index: int) -> str:
        return sorted(requests)[index % len(requests)]

    def admit(self, request_id: str, req: _Req, num_chunk_tokens: int) -> None:
        """The scheduler's admission: look up the prefix, grow for a chunk, or give the hits back."""
        kv, tokens = self.kv, req.token_ids
        num_hit_tokens = kv.lookup_prefix(request_id, tokens)
        self.check_hits(request_id, tokens, num_hit_tokens)
        num_tokens = min(num_hit_tokens + num_chunk_tokens, len(tokens))
        if self.grow(request_id, num_tokens) is None:
            kv.free(request_id)
            self.waiting[request_id] = req
            return
        req.num_computed_tokens = num_hit_tokens
        self.running[request_id] = req

    def check_hits(self, request_id: str, tokens: list[int], num_hit_tokens: int) -> None:
        table = list(self.kv.block_ids(request_id))
        num_hit_blocks = num_hit_tokens // BS
        assert num_hit_tokens == num_hit_blocks * BS and len(table) == num_hit_blocks
        assert num_hit_tokens < len(tokens), "one token is left to compute"
        if not self.prefix_caching:
            assert num_hit_tokens == 0
            return
        hashes = hash_full_blocks(tokens, BS)
        for index, block in enumerate(table):
            assert self.kv.pool.lookup(hashes[index]) == block
            assert self.content.get(block) == tuple(tokens[:(index + 1) * BS]), "a hit with other K/V"
        if num_hit_blocks < (len(tokens) - 1) // BS:
            assert self.kv.pool.lookup(hashes[num_hit_blocks]) is None, "the lookup stopped before a miss"

    def grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """grow, checked: all or nothing, append only, exactly the blocks num_blocks_short named."""
        kv = self.kv
        before = list(kv.block_ids(request_id))
        num_short_blocks = kv.num_blocks_short(request_id, num_tokens)
        allocatable = kv.pool.num_allocatable_blocks
        new_blocks = kv.grow(request_id, num_tokens)
        after = list(kv.block_ids(request_id))
        if new_blocks is None:
            assert num_short_blocks > allocatable and after == before
            return None
        assert len(new_blocks) == num_short_blocks and after == before + new_blocks
        assert len(after) * BS >= num_tokens and kv.num_blocks_short(request_id, num_tokens) == 0
        for block in new_blocks:
            self.content.pop(block, None)        # a reused block holds stale K/V until written
        return new_blocks

    def compute(self, request_id: str, req: _Req, num_new_tokens: int) -> None:
        """The runner writes K/V for the next tokens; then the scheduler commits them."""
        table = self.kv.block_ids(request_id)
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new_tokens
        for index in range(start // BS, (end - 1) // BS + 1):
            block = table[index]
            assert self.kv.pool.ref_count(block) == 1, f"writing into block {block}, shared"
            self.content[block] = tuple(req.token_ids[:min((index + 1) * BS, end)])
        req.num_computed_tokens = end
        self.kv.commit(request_id, req.token_ids, end)

    # rules ------------------------------------------------------------------------------------
    @rule(tokens=TOKENS, num_chunk_tokens=st.integers(1, 9))
    def add_request(self, tokens, num_chunk_tokens):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.admit(request_id, _Req(list(tokens)), num_chunk_tokens)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100), num_chunk_tokens=st.integers(1, 9))
    def resume(self, index, num_chunk_tokens):
        request_id = self.pick(self.waiting, index)
        self.admit(request_id, self.waiting.pop(request_id), num_chunk_tokens)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), num_new_tokens=st.integers(1, 9), sampled=st.integers(0, 1))
    def step(self, index, num_new_tokens, sampled):
        """One step of a running request: a prefill chunk or a decode token; a full pool preempts it."""
        request_id = self.pick(self.running, index)
        req = self.running[request_id]
        num_new_tokens = min(num_new_tokens, len(req.token_ids) - req.num_computed_tokens)
        if self.grow(request_id, req.num_computed_tokens + num_new_tokens) is None:
            self.preempt_request(request_id)
            return
        self.compute(request_id, req, num_new_tokens)
        if req.num_computed_tokens == len(req.token_ids) and len(req.token_ids) < 16:
            req.token_ids.append(sampled)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), num_ahead_tokens=st.integers(0, 6))
    def grow_ahead(self, index, num_ahead_tokens):
        """A multi-step round allocates for tokens not sampled yet; the table keeps them."""
        request_id = self.pick(self.running, index)
        req = self.running[request_id]
        self.grow(request_id, req.num_computed_tokens + num_ahead_tokens)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        self.preempt_request(self.pick(self.running, index))

    def preempt_request(self, request_id: str) -> None:
        """Preemption by recompute: the table goes back; the tokens (prompt + output) stay."""
        req = self.running.pop(request_id)
        self.kv.free(request_id)
        req.num_computed_tokens = 0
        self.waiting[request_id] = req

    @precondition(lambda self: self.running or self.waiting)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        request_id = self.pick({**self.running, **self.waiting}, index)
        self.running.pop(request_id, None) or self.waiting.pop(request_id)
        self.kv.free(request_id)
        self.kv.free(request_id)                 # twice: the second is a no-op

    @rule()
    def end_every_request(self):
        """After every request ends, all blocks are free or cached-free."""
        for request_id in list(self.running) + list(self.waiting):
            self.kv.free(request_id)
        self.running.clear()
        self.waiting.clear()
        pool = self.kv.pool
        assert self.kv.num_requests == 0 and pool.num_used_blocks == 0
        assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
        if not self.prefix_caching:
            assert pool.num_cached_blocks == 0

    # invariants -------------------------------------------------------------------------------
    @invariant()
    def manager_invariants(self):
        self.kv.check_invariants()

    @invariant()
    def tables_match_the_requests(self):
        kv = self.kv
        assert kv.num_requests == len(self.running)
        for request_id, req in self.running.items():
            assert len(kv.block_ids(request_id)) * BS >= req.num_computed_tokens
        for request_id in self.waiting:
            assert len(kv.block_ids(request_id)) == 0


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheManagerStateMachine = ManagerMachine.TestCase
