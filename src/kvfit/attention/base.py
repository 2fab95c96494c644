"""The attention backend interface and the per-step metadata every backend reads.

One step is a flat batch of T query tokens from B sequences. Sequence i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]``; those are the *last* tokens of its context of
``seq_lens[i]`` tokens (cached prefix + new), so query j of sequence i sits at position
``seq_lens[i] - q_len_i + j`` and attends causally to keys at positions <= its own. Decode is the
case q_len_i == 1; prefill over a cached prefix is q_len_i < seq_lens[i].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step tensors, built by the runner and passed to every layer (never stored globally)."""

    slot_mapping: torch.Tensor      # [T] int64; PADDING_SLOT_ID (-1) = do not write
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # host copies, so the reference backend and launch-size decisions need no device sync
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # cascade (decode steps only): the first prefix_len[0] tokens ([1] int32, a multiple of the block size) of
    # every sequence have the K/V that block_tables[0]'s blocks hold (the same blocks, or copies equal up to the
    # rounding of the batch that computed them, as with a prefix-cache hit), and every
    # sequence has more tokens than that; a backend may attend them once for all sequences through row 0's
    # blocks. None: no such prefix (or the backend declined it).
    prefix_len: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """A backend declares the largest element offset its kernels compute (the planner's index limit)."""

    name: str = "abstract"
    max_element_offset: int = 2**63 - 1
    # write_kv stores token t's key/value, cast to the cache dtype, at slot_mapping[t] and does nothing else
    # (no scales, no layout of its own): a model may then do that write in a kernel of its own
    plain_cache_write: bool = False

    def cascade_tokens(self, shared_tokens: int, num_seqs: int) -> int:
        """Of the shared_tokens every one of a decode step's num_seqs sequences has in the same blocks, how
        many this backend attends once for all of them (AttentionMetadata.prefix_len); 0: none, it reads
        each sequence's context whole."""
        return 0

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; writes token t to slot t."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query: [T, Hq, D] -> output [T, Hq, D] in query's dtype."""
        raise NotImplementedError
