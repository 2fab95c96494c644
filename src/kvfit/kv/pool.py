"""BlockPool: the free list, reference counts and the prefix cache of KV blocks. No torch.

Invariants (checked by check_invariants and the state-machine test):
- free + used + cached == num_blocks; a block is in exactly one of the three states.
- used blocks have ref count >= 1; a block shared by prefix caching is in several tables and its
  ref count equals the number of tables holding it.
- cached blocks (free, but holding a registered full-block hash) are evicted least recently freed first.
Every operation is O(1) per block: construction does not touch the blocks (never-used ids are
handed out from a counter), so it costs the same at 10^4 and 10^7 blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class BlockPool:
    """Allocates block ids in [0, num_blocks)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False):
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._next_fresh = 0                    # ids >= this were never handed out
        self._free: list[int] = []              # returned blocks without a hash (a stack)
        self._cached: OrderedDict[int, None] = OrderedDict()   # free blocks with a hash, LRU first
        # ref count by block id, grown as fresh ids are handed out (0: not in use). A list, not a
        # dict: a dict never shrinks after the whole pool was in use once, and its oversized table
        # makes every later allocate/free miss the cache.
        self._ref: list[int] = []
        self._num_used = 0
        self._hash_of: dict[int, bytes] = {}    # block -> its registered hash
        self._block_of: dict[bytes, int] = {}   # hash -> block
        self.num_evictions = 0

    # counts -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free blocks holding no cached prefix."""
        return len(self._free) + self.num_blocks - self._next_fresh

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached full block (reusable until evicted)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_allocatable_blocks(self) -> int:
        return self.num_free_blocks + self.num_cached_blocks

    # allocation ---------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """num_blocks fresh blocks (ref count 1), or None when fewer are allocatable (all or nothing)."""
        if num_blocks > self.num_allocatable_blocks:
            return None
        out = [self._take_one() for _ in range(num_blocks)]
        ref = self._ref
        for block in out:
            ref[block] = 1
        self._num_used += num_blocks
        return out

    def _take_one(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next_fresh < self.num_blocks:
            self._next_fresh += 1
            self._ref.append(0)
            return self._next_fresh - 1
        block, _ = self._cached.popitem(last=False)   # evict the least recently freed
        del self._block_of[self._hash_of.pop(block)]
        self.num_evictions += 1
        return block

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; pass a table in order, its tail is evicted first."""
        ref = self._ref
        for block in reversed(block_ids):
            count = ref[block] - 1
            assert count >= 0, f"block {block} freed but not in use"
            ref[block] = count
            if count:
                continue
            self._num_used -= 1
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    # prefix caching -----------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this full-block hash, used or cached, or None."""
        return self._block_of.get(block_hash)

    def ref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks found by lookup; a cached block becomes used again."""
        for block in block_ids:
            if not self._ref[block]:
                del self._cached[block]
                self._num_used += 1
            self._ref[block] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record that a used block now holds a full block with this hash (first writer wins)."""
        assert self.ref_count(block_id), f"block {block_id} is not in use"
        if not self.enable_prefix_caching or block_hash in self._block_of or block_id in self._hash_of:
            return
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    def unregister(self, block_id: int, block_hash: bytes) -> None:
        """Forget that a used block holds this hash (its K/V were never written: the step failed)."""
        if self._hash_of.get(block_id) == block_hash:
            del self._hash_of[block_id]
            del self._block_of[block_hash]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id] if 0 <= block_id < len(self._ref) else 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; cached free blocks become plain free blocks."""
        for block in self._cached:
            self._free.append(block)
        self._cached.clear()
        for block in [b for b in self._hash_of if not self._ref[b]]:
            del self._block_of[self._hash_of.pop(block)]

    def check_invariants(self) -> None:
        free = set(self._free) | set(range(self._next_fresh, self.num_blocks))
        cached, used = set(self._cached), {b for b, c in enumerate(self._ref) if c}
        assert len(self._ref) == self._next_fresh and len(used) == self._num_used
        assert len(free) == self.num_free_blocks, "a block is twice on the free list"
        assert not (free & cached) and not (free & used) and not (cached & used), "a block in two states"
        assert len(free) + len(cached) + len(used) == self.num_blocks
        assert all(c >= 0 for c in self._ref)
        assert all(b in self._hash_of for b in cached)
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
