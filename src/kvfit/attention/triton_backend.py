"""The Triton backend: reshape-and-cache by slot mapping, paged decode (split-K) and paged prefill.

Decode-only steps (meta.max_query_len == 1) go to the split-K decode kernel (with meta.prefix_len, the
shared prefix first, once for all sequences: cascade), every other step
(prefill, chunked prefill over a cached prefix, mixed prefill + decode) to the prefill kernel.
Launch sizes come from host ints in the metadata (max_query_len, max_seq_len, tensor shapes), so
attend never synchronises with the device. Every kernel offset is int64 (kernels/attention_common.py).
Its cache write (write_kv_cache) is a cast copy to the slot (fp8 at scale 1.0), so FusedCacheWrite folds it
into the RoPE and one-token projection kernels.
"""

from __future__ import annotations

import os

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata
from kvfit.attention.fused_write import FusedCacheWrite
from kvfit.attention.registry import backend_max_offset
from kvfit.errors import ConfigError
from kvfit.kernels.attention_common import write_kv_cache
from kvfit.kernels.attention_decode import (CASCADE_MIN_SEQS, CASCADE_MIN_SHARED_READS, CASCADE_MIN_TOKENS,
                                            choose_num_splits,
                                            choose_prefix_splits, heads_per_program, paged_decode_attention)
from kvfit.kernels.attention_prefill import paged_prefill_attention
from kvfit.platforms.gate import on_gpu

# SMs assumed when kernels run in Triton's CPU interpreter (tests): small, so splits stay few.
_INTERPRETER_NUM_SMS = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(FusedCacheWrite, AttentionBackend):
    """Paged attention in Triton kernels; `num_splits` pins decode's split-K count (None: chosen per step)."""

    name = "triton"
    # all kernels cast indices to int64 before multiplying by strides (declared in registry.py)
    max_element_offset = backend_max_offset("triton")
    graphs_any_step = True          # the prefill kernel's tile-mapped grid (meta.tile_maps)

    def __init__(self, num_splits: int | None = None):
        if num_splits is not None and num_splits < 1:
            raise ConfigError(f"num_splits must be >= 1 or None, got {num_splits}")
        self.num_splits = num_splits
        self._num_sms: dict[torch.device, int] = {}   # per device, read once (no device sync)

    def _check_device(self, t: torch.Tensor) -> None:
        if not on_gpu(t) and not _interpreting():
            raise ConfigError(f"the triton attention backend needs a CUDA device, got tensors on {t.device}; "
                              "use --attention-backend torch (or TRITON_INTERPRET=1 for tests)")

    def num_sms(self, t: torch.Tensor) -> int:
        """Streaming multiprocessors of t's GPU (the interpreter's stand-in off the GPU)."""
        if not on_gpu(t):
            return _INTERPRETER_NUM_SMS
        device = t.device
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]

    def decode_num_splits(self, meta: AttentionMetadata, query: torch.Tensor, num_kv_heads: int) -> int:
        """Split-K count for a decode step, from host ints only."""
        if self.num_splits is not None:
            return self.num_splits
        group = query.shape[1] // num_kv_heads
        head_programs = num_kv_heads * -(-group // heads_per_program(group))
        return choose_num_splits(meta.max_seq_len, meta.num_seqs, head_programs, self.num_sms(query))

    def cascade_tokens(self, shared_tokens: int, num_seqs: int) -> int:
        if (num_seqs < CASCADE_MIN_SEQS or shared_tokens < CASCADE_MIN_TOKENS
                or num_seqs * shared_tokens < CASCADE_MIN_SHARED_READS):
            return 0
        return shared_tokens

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        # key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64
        self._check_device(key)
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale, out_scale=None):
        # query: [T, Hq, D] -> [T, Hq, D] in query's dtype
        self._check_device(query)
        num_kv_heads = k_cache.shape[2]
        assert query.shape[1] % num_kv_heads == 0, (query.shape, k_cache.shape)
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == query.shape[2], (k_cache.shape, query.shape)
        if meta.decode_only:
            prefix_splits = 0
            if meta.prefix_len is not None:
                prefix_splits = choose_prefix_splits(meta.num_seqs, query.shape[1] // num_kv_heads, num_kv_heads,
                                                     query.element_size(), self.num_sms(query))
            return paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                num_splits=self.decode_num_splits(meta, query, num_kv_heads), prefix_len=meta.prefix_len,
                prefix_splits=prefix_splits, out_scale=out_scale)
        return paged_prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            max_query_len=meta.max_query_len, scale=scale, tile_maps=meta.tile_maps, out_scale=out_scale)
