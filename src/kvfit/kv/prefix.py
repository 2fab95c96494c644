"""Chained hashes of full blocks for prefix caching. No torch.

hash(block i) = H(hash(block i-1), token ids of block i): equal hashes mean equal whole prefixes.
blake2b (16 bytes) keeps collisions out of reach, unlike Python's 64-bit hash().
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

NONE_HASH = b"\x00" * 16


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block given its parent block's hash (None for the first block)."""
    h = hashlib.blake2b(parent or NONE_HASH, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of token_ids, reusing the first len(known) already computed."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
