"""KVCacheManager: per-request block tables over one BlockPool (prefix lookup and commit, grow, free). No torch.

The scheduler decides who runs; this module is the mechanism it asks for blocks. A request's table
lives here from its first lookup_prefix (or grow) until free.

Invariants (checked by check_invariants and tests/kv/test_manager_state_machine.py):
- Tables are append-only between lookup_prefix and free: grow only appends, so a runner that holds a
  copy of a table needs only the new block ids of each step.
- A used block's ref count equals the number of tables holding it; no block is twice in one table;
  every used block of the pool is in some table. After every request is freed no block is used.
- block_hashes[i] of a request is the chained hash (kv/prefix.py) of its tokens [i*block_size,
  (i+1)*block_size), its cache salt in the first (set at lookup_prefix); the list is a prefix of the chain, never longer than the full blocks seen.
- The first num_committed_blocks blocks of a table have been offered to pool.register (prefix hits
  count as committed: they are registered already), so commit registers each block once, and hashes
  and registers only blocks that became full since the last call: O(new blocks) per call.
- For each hash, the count of tables whose first num_committed_blocks hashes include it is kept
  (num_common_prefix_blocks reads it).
"""

from __future__ import annotations

from typing import Sequence

from kvfit.kv.pool import BlockPool
from kvfit.kv.prefix import hash_block
from kvfit.kv.spec import num_blocks_for_tokens


class _Table:
    """One request's blocks and the hashes of its full blocks."""

    __slots__ = ("block_ids", "block_hashes", "num_committed_blocks", "cache_salt")

    def __init__(self, cache_salt: str | None = None) -> None:
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.cache_salt = cache_salt     # mixed into the first block's hash: no sharing across salts


class KVCacheManager:
    """Per-request block tables over one BlockPool: prefix lookup and commit, grow, free."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        assert block_size >= 1
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, _Table] = {}
        # hash -> tables whose committed blocks include a block of that content (num_common_prefix_blocks)
        self._content_holders: dict[bytes, int] = {}

    # queries ------------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        """Requests holding a table (possibly still empty): looked up or grown, not yet freed."""
        return len(self._tables)

    def block_ids(self, request_id: str) -> Sequence[int]:
        """The request's table, empty if it has none. Read only: callers do not mutate it."""
        table = self._tables.get(request_id)
        return table.block_ids if table is not None else ()

    def num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of the request's table whose contents every table holds, computed, at the same
        positions (vLLM's get_num_common_prefix_blocks): the prefix a decode step may attend once for all its
        sequences, through this request's blocks.

        Contents, not block ids: a request can hold its own copy of a shared prompt (one asking for prompt
        logprobs computes every position; a block registered first by another request stays that one's),
        equal by chained hash (the same tokens at the same positions, the same cache salt) but not by id;
        counting ids would find no common prefix for as long as such a copy is in use. A copy's K/V equal
        row 0's up to the rounding of the batch it was computed in, as a prefix-cache hit's do. Only
        committed blocks count (written, or written by the step being scheduled before it attends). Needs
        prefix caching (hashes); O(blocks counted + 1)."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        num_tables, holders, hashes = len(self._tables), self._content_holders, table.block_hashes
        count = 0
        while count < table.num_committed_blocks and holders.get(hashes[count], 0) == num_tables:
            count += 1
        return count

    def _hold(self, hashes: Sequence[bytes], delta: int) -> None:
        holders = self._content_holders
        for block_hash in hashes:
            count = holders.get(block_hash, 0) + delta
            if count:
                holders[block_hash] = count
            else:
                del holders[block_hash]

    def num_blocks_short(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request's table lacks to cover num_tokens (0 if it covers them)."""
        num_needed_blocks = num_blocks_for_tokens(num_tokens, self.block_size)
        return max(num_needed_blocks - len(self.block_ids(request_id)), 0)

    # prefix cache -------------------------------------------------------------------------------
    def lookup_prefix(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Start the request's table with the leading cached full blocks of token_ids; return the
        tokens found (a multiple of block_size). At least one token is always left to compute, so at
        most (len(token_ids) - 1) // block_size blocks are taken. Blocks are hashed lazily and only
        up to the first miss; commit hashes the rest as they are computed. cache_salt: only blocks
        committed under the same salt (or both without one) are found, and commit uses it too. (The
        prefix-cache hit counters are the scheduler's: it knows which lookups are a prompt's first.)"""
        assert request_id not in self._tables, f"request {request_id} already has a table"
        table = self._tables[request_id] = _Table(cache_salt)
        return self._take_cached_prefix(table, token_ids) if self.pool.enable_prefix_caching else 0

    def _take_cached_prefix(self, table: _Table, token_ids: Sequence[int]) -> int:
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        for _ in range(max_hit_blocks):
            block_hash = self._hash_next_block(table, token_ids)
            block = self.pool.lookup(block_hash)
            if block is None:
                break            # the hash stays: commit reuses it when this block is computed
            hits.append(block)
        self.pool.ref(hits)
        table.block_ids.extend(hits)
        table.num_committed_blocks = len(hits)     # found by their hash: registered already
        self._hold(table.block_hashes[:len(hits)], 1)
        return len(hits) * self.block_size

    def _hash_next_block(self, table: _Table, token_ids: Sequence[int]) -> bytes:
        """Append the chained hash of the request's next full block (which must exist in token_ids)."""
        hashes, block_size = table.block_hashes, self.block_size
        start = len(hashes) * block_size
        block_tokens = token_ids[start:start + block_size]
        assert len(block_tokens) == block_size, "only full blocks are hashed"
        if hashes:
            block_hash = hash_block(hashes[-1], block_tokens)
        else:
            block_hash = hash_block(None, block_tokens, table.cache_salt)
        hashes.append(block_hash)
        return block_hash

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The first num_computed_tokens of token_ids have their K/V in the table, or get it in the step
        being scheduled (which runs before any step that could read them): register every full block among
        them in the prefix cache. Only blocks not committed before are hashed and
        registered (one decode step costs O(1) unless it fills a block). No-op with caching off."""
        if not self.pool.enable_prefix_caching:
            return
        table = self._tables[request_id]
        assert num_computed_tokens <= len(token_ids), "computed tokens beyond the request's tokens"
        assert num_computed_tokens <= len(table.block_ids) * self.block_size, "computed tokens beyond the table"
        num_full_blocks = num_computed_tokens // self.block_size
        for index in range(table.num_committed_blocks, num_full_blocks):
            if index == len(table.block_hashes):
                self._hash_next_block(table, token_ids)
            self.pool.register(table.block_ids[index], table.block_hashes[index])
        if num_full_blocks > table.num_committed_blocks:
            self._hold(table.block_hashes[table.num_committed_blocks:num_full_blocks], 1)
            table.num_committed_blocks = num_full_blocks

    def num_committed_blocks(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return table.num_committed_blocks if table is not None else 0

    def uncommit(self, request_id: str, keep: int) -> None:
        """Forget the hashes of the request's committed blocks past its first `keep`: the step that was to
        compute them failed, so no later request may find them (the pool keeps whichever hash a block
        was registered under first; another table's copy stays registered)."""
        table = self._tables.get(request_id)
        if table is None or table.num_committed_blocks <= keep:
            return
        for index in range(keep, table.num_committed_blocks):
            self.pool.unregister(table.block_ids[index], table.block_hashes[index])
        self._hold(table.block_hashes[keep:table.num_committed_blocks], -1)
        table.num_committed_blocks = keep

    # grow and free ------------------------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make the table cover num_tokens; return the new block ids appended (possibly []), or None
        when the pool cannot give them all (then nothing changed, not even a table started). Starts a
        table for a request that has none."""
        new_blocks = self.pool.allocate(self.num_blocks_short(request_id, num_tokens))
        if new_blocks is None:
            return None
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = _Table()
        table.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Give the table back, tail first (so the tail is evicted first), and forget the request's
        table and hashes. Freeing an unknown id is a no-op."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.free(table.block_ids)     # pool.free walks the table from its tail
            self._hold(table.block_hashes[:table.num_committed_blocks], -1)

    # checks -------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The pool's invariants, plus: each used block's ref count is the number of tables holding
        it, every used block is in a table, no block is twice in one table."""
        self.pool.check_invariants()
        num_holders: dict[int, int] = {}
        for request_id, table in self._tables.items():
            blocks = table.block_ids
            assert len(set(blocks)) == len(blocks), f"a block twice in the table of {request_id}"
            assert table.num_committed_blocks <= min(len(blocks), len(table.block_hashes))
            for block in blocks:
                num_holders[block] = num_holders.get(block, 0) + 1
        assert self.pool.num_used_blocks == len(num_holders), "a used block is in no table"
        for block, holders in num_holders.items():
            assert self.pool.ref_count(block) == holders, \
                f"block {block}: ref count {self.pool.ref_count(block)}, held by {holders} tables"
        content: dict[bytes, int] = {}
        for table in self._tables.values():
            for block_hash in table.block_hashes[:table.num_committed_blocks]:
                content[block_hash] = content.get(block_hash, 0) + 1
        assert content == self._content_holders, "content holder counts differ from the tables' committed hashes"
