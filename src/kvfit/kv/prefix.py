"""Chained hashes of full blocks for prefix caching. No torch.

hash(block i) = H(hash(block i-1), token ids of block i): equal hashes mean equal whole prefixes.
blake2b (16 bytes) keeps collisions out of reach, unlike Python's 64-bit hash().

A request's cache_salt (vLLM's field) enters the hash of its first block only; every later block
chains on it, so requests with different salts (or one salted, one not) share no block. Salted
first blocks are hashed under their own blake2b personalization, so no salt can be chosen to
make a salted hash equal an unsalted one.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

NONE_HASH = b"\x00" * 16
_SALTED = b"kvfit-cache-salt"      # blake2b personalization (16 bytes) of salted first blocks


def hash_block(parent: bytes | None, token_ids: Sequence[int], cache_salt: str | None = None) -> bytes:
    """Hash of a full block given its parent block's hash (None for the first block); cache_salt
    goes into the first block's hash only (a later block carries it through its parent)."""
    assert cache_salt is None or parent is None, "the salt goes into the first block only"
    h = hashlib.blake2b(parent or NONE_HASH, digest_size=16, person=_SALTED if cache_salt is not None else b"")
    h.update(array("q", token_ids).tobytes())
    if cache_salt is not None:         # after the block's fixed-size tokens: no ambiguity
        h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = (),
                     cache_salt: str | None = None) -> list[bytes]:
    """Hashes of every full block of token_ids, reusing the first len(known) already computed."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], cache_salt if parent is None else None)
        hashes.append(parent)
    return hashes
