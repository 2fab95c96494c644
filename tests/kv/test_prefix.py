"""Chained full-block hashes: equal hashes mean equal whole prefixes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfit.kv.prefix import NONE_HASH, hash_block, hash_full_blocks

BS = 4


def test_equal_prefixes_give_equal_chained_hashes():
    a = list(range(10, 22))                      # 3 full blocks
    b = list(range(10, 22)) + [99, 98]           # the same 3 blocks and a partial one
    assert hash_full_blocks(a, BS) == hash_full_blocks(b, BS)
    assert len(hash_full_blocks(a, BS)) == 3


def test_hashes_chain_through_the_parent():
    tokens = list(range(12))
    hashes = hash_full_blocks(tokens, BS)
    parent = None
    for i, block_hash in enumerate(hashes):
        assert block_hash == hash_block(parent, tokens[i * BS:(i + 1) * BS])
        parent = block_hash
    assert all(len(x) == 16 for x in hashes)
    # the first block's parent is the all-zero hash
    assert hash_block(None, tokens[:BS]) == hash_block(NONE_HASH, tokens[:BS])


def test_a_differing_earlier_block_changes_every_later_hash():
    base = list(range(100, 120))                 # 5 blocks
    changed = list(base)
    changed[5] += 1                              # inside block 1
    h0, h1 = hash_full_blocks(base, BS), hash_full_blocks(changed, BS)
    assert h0[0] == h1[0]
    assert all(x != y for x, y in zip(h0[1:], h1[1:]))


def test_the_same_block_at_another_position_hashes_differently():
    block = [5, 6, 7, 8]
    hashes = hash_full_blocks(block * 3, BS)
    assert len(set(hashes)) == 3


def test_partial_blocks_are_not_hashed():
    assert hash_full_blocks([], BS) == []
    assert hash_full_blocks([1, 2, 3], BS) == []
    assert len(hash_full_blocks([1, 2, 3, 4], BS)) == 1
    assert len(hash_full_blocks(list(range(7)), BS)) == 1
    assert len(hash_full_blocks(list(range(8)), BS)) == 2
    # appending to a partial block does not change the full blocks' hashes
    assert hash_full_blocks(list(range(7)), BS) == hash_full_blocks(list(range(4)), BS)


def test_known_hashes_are_reused():
    tokens = list(range(30))
    full = hash_full_blocks(tokens, BS)
    for k in range(len(full) + 1):
        assert hash_full_blocks(tokens, BS, known=full[:k]) == full
    # known hashes are trusted, not recomputed: a request grows block by block
    grown = hash_full_blocks(tokens[:9], BS)
    assert hash_full_blocks(tokens[:17], BS, known=grown) == full[:4]
    fake = [b"\x01" * 16]
    assert hash_full_blocks(tokens[:8], BS, known=fake)[0] == fake[0]
    assert hash_full_blocks(tokens[:8], BS, known=fake)[1] == hash_block(fake[0], tokens[4:8])


def test_block_size_matters():
    tokens = list(range(16))
    assert hash_full_blocks(tokens, 4)[1] != hash_full_blocks(tokens, 8)[0]
    assert len(hash_full_blocks(tokens, 16)) == 1 and len(hash_full_blocks(tokens, 1)) == 16


def test_large_token_ids_are_hashed():
    assert hash_block(None, [2**40, 151_935, 0, 1]) != hash_block(None, [0, 151_935, 0, 1])


token_lists = st.lists(st.integers(0, 200_000), max_size=64)


@settings(max_examples=200, deadline=None)
@given(a=token_lists, b=token_lists, block_size=st.sampled_from([1, 2, 4, 16]))
def test_equal_hash_iff_equal_prefix(a, b, block_size):
    ha, hb = hash_full_blocks(a, block_size), hash_full_blocks(b, block_size)
    assert len(ha) == len(a) // block_size
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[:(i + 1) * block_size] == b[:(i + 1) * block_size]
        assert (ha[i] == hb[i]) == same_prefix


@settings(max_examples=100, deadline=None)
@given(tokens=token_lists, cut=st.integers(0, 64), block_size=st.sampled_from([1, 2, 4, 16]))
def test_incremental_hashing_equals_hashing_at_once(tokens, cut, block_size):
    known = hash_full_blocks(tokens[:cut], block_size)
    assert hash_full_blocks(tokens, block_size, known=known) == hash_full_blocks(tokens, block_size)
