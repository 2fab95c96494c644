"""cache_salt (vLLM's prefix-cache isolation) in the hashes and the manager: a salt enters the first
block's hash only, so the whole chain differs; same salt -> hit, other salt or none -> miss."""

from __future__ import annotations

from array import array

from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.kv.prefix import NONE_HASH, hash_block, hash_full_blocks

BS = 4
TOKENS = list(range(100, 110))          # 2 full blocks + 2 tokens


def test_a_salt_changes_every_block_hash_and_only_the_same_salt_repeats_them():
    plain, a, a_again, b = (hash_full_blocks(TOKENS, BS, cache_salt=s) for s in (None, "a", "a", "b"))
    assert a == a_again
    assert all(x != y for x, y in zip(plain, a)) and all(x != y for x, y in zip(a, b))
    assert a[1] == hash_block(a[0], TOKENS[4:8])          # later blocks chain on the salted first one
    assert hash_full_blocks(TOKENS, BS, cache_salt=None) == hash_full_blocks(TOKENS, BS)


def test_no_salt_can_be_chosen_to_equal_an_unsalted_hash():
    # the salted hash reads (parent, tokens, salt) under its own personalization; a salt spelling
    # what an unsalted hash reads still gives another hash
    forged = (NONE_HASH + array("q", TOKENS[:BS]).tobytes()).decode("latin-1")
    assert hash_block(None, TOKENS[:BS], forged) != hash_block(None, TOKENS[:BS])
    assert hash_block(None, [], forged) != hash_block(None, TOKENS[:BS])


def serve(kv: KVCacheManager, request_id: str, salt: str | None) -> int:
    """Look up, compute and commit TOKENS under salt, then free; the tokens found in the cache."""
    num_hit = kv.lookup_prefix(request_id, TOKENS, cache_salt=salt)
    assert kv.grow(request_id, len(TOKENS)) is not None
    kv.commit(request_id, TOKENS, len(TOKENS))
    kv.check_invariants()
    kv.free(request_id)
    return num_hit


def test_only_requests_with_the_same_salt_share_blocks():
    kv = KVCacheManager(BlockPool(32, enable_prefix_caching=True), BS)
    assert serve(kv, "s1", "tenant-a") == 0
    assert serve(kv, "s2", "tenant-a") == 8                # same salt: both full blocks hit
    assert serve(kv, "other", "tenant-b") == 0             # another salt: nothing
    assert serve(kv, "plain", None) == 0                   # no salt does not see salted blocks
    assert serve(kv, "plain2", None) == 8                  # ...and shares with unsalted ones as before
    assert serve(kv, "s3", "tenant-b") == 8
    kv.check_invariants()
