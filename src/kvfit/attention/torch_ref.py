"""The torch reference backend: plain indexing, float32 math. Runs anywhere; the oracle for the rest."""

from __future__ import annotations

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata
from kvfit.attention.registry import backend_max_offset
from kvfit.kv.spec import PADDING_SLOT_ID


class TorchReferenceBackend(AttentionBackend):
    """Gathers each sequence's K/V from its block table and runs masked softmax attention."""

    name = "torch"
    # torch indexes tensors with int64 offsets (declared in registry.py)
    max_element_offset = backend_max_offset("torch")

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        # key, value: [T, Hkv, D]; slot_mapping: [T] int64
        keep = slot_mapping != PADDING_SLOT_ID
        slots = slot_mapping[keep]
        block_size = k_cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
        v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale):
        starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
        lens = meta.seq_lens_host or meta.seq_lens.tolist()
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty_like(query)
        for i, ctx_len in enumerate(lens):
            q = query[starts[i]:starts[i + 1]].float()           # [L, Hq, D]
            q_len = q.shape[0]
            if q_len == 0:
                continue
            num_blocks = -(-ctx_len // block_size)
            blocks = meta.block_tables[i, :num_blocks].long()
            k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:ctx_len].float()  # [S, Hkv, D]
            v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:ctx_len].float()
            group = q.shape[1] // num_kv_heads
            k = k.repeat_interleave(group, dim=1)                 # [S, Hq, D]
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("lhd,shd->hls", q, k) * scale   # [Hq, L, S]
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(ctx_len, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            out[starts[i]:starts[i + 1]] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v).to(query.dtype)
        return out
