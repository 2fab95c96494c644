"""The torch reference backend: plain indexing, float32 math (torch's scaled_dot_product_attention, in query
chunks of bounded size). Runs anywhere; the oracle for the rest."""

from __future__ import annotations

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata
from kvfit.attention.registry import backend_max_offset
from kvfit.kv.spec import PADDING_SLOT_ID, num_blocks_for_tokens


class TorchReferenceBackend(AttentionBackend):
    """Gathers each sequence's K/V from its block table and runs causal attention over it in fp32."""

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

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale, out_scale=None):
        starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
        lens = meta.seq_lens_host or meta.seq_lens.tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        num_heads, num_kv_heads, head_dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
        max_q, max_ctx, num_seqs = max(q_lens, default=0), max(lens, default=0), len(lens)
        out = torch.empty_like(query)
        if max_q == 0:
            return out
        # [Hq] fp32: each query head's output scale (its KV head's), applied before the rounding to out's dtype
        head_scale = None if out_scale is None else out_scale.float().repeat_interleave(num_heads // num_kv_heads)
        if num_seqs * max_ctx * max(num_heads * max_q, num_kv_heads * head_dim) <= MAX_SCORE_ELEMENTS:
            # every sequence in one padded call (decode steps, the profile's widest step)
            q = _padded_queries(query, starts, q_lens, max_q)                          # [B, Lmax, Hq, D]
            k, v = _gather_kv(k_cache, v_cache, meta.block_tables[:num_seqs], max_ctx, lens)   # [B, Smax, Hkv, D]
            # a shorter sequence's padding holds whatever its blocks (or block 0) held, NaN included: a
            # masked key still multiplies its value by 0, so it must be a number
            pad = torch.arange(max_ctx, device=query.device)[None, :] >= torch.tensor(lens, device=query.device)[:, None]
            k, v = k.masked_fill_(pad[:, :, None, None], 0.0), v.masked_fill_(pad[:, :, None, None], 0.0)
            o = padded_causal_attention(q, k, v, q_lens, lens, scale)                  # [B, Lmax, Hq, D]
            if head_scale is not None:
                o = o.float() * head_scale[:, None]
            return out.copy_(o.reshape(-1, num_heads, head_dim)[_valid_rows(q_lens, max_q, query.device)])
        for i, ctx_len in enumerate(lens):
            if q_lens[i] == 0:
                continue
            k, v = _gather_kv(k_cache, v_cache, meta.block_tables[i:i + 1], ctx_len)   # [1, S, Hkv, D]
            # query rows in chunks, so one chunk's scores stay under MAX_SCORE_ELEMENTS: a chunk ending at
            # position p is a sequence of p + 1 tokens whose last c are queries
            chunk = max(1, MAX_SCORE_ELEMENTS // (num_heads * ctx_len))
            for first in range(0, q_lens[i], chunk):
                c = min(chunk, q_lens[i] - first)
                end = ctx_len - q_lens[i] + first + c
                rows = slice(starts[i] + first, starts[i] + first + c)
                o = padded_causal_attention(query[None, rows].float(), k[:, :end], v[:, :end], [c], [end], scale)
                if head_scale is not None:
                    o = o.float() * head_scale[:, None]
                out[rows] = o[0].to(query.dtype)
        return out


# One attention call's fp32 scores ([B, Hq, Lmax, Smax], if SDPA takes its math path) and padded K/V stay
# under this many elements: 2^26 (256 MiB). A prefill of 8,192 tokens over 16 heads then takes 512 query rows
# at a time, where its whole [16, 8192, 8192] scores would be 4 GiB (and the mask and softmax copies more).
MAX_SCORE_ELEMENTS = 1 << 26


def _gather_kv(k_cache, v_cache, block_tables, max_ctx: int, ctx_lens=None) -> tuple[torch.Tensor, torch.Tensor]:
    # block_tables: [B, W] int32 -> K, V [B, max_ctx, Hkv, D] fp32 (past a sequence's length: padding).
    # ctx_lens (host ints): a table column past a sequence's own blocks holds a stale id (an earlier request's,
    # or the profile's larger scratch cache's), read as block 0 instead
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    blocks = block_tables[:, :num_blocks_for_tokens(max_ctx, block_size)].long()  # [B, nb]
    if ctx_lens is not None:
        own = torch.tensor([num_blocks_for_tokens(n, block_size) for n in ctx_lens], device=blocks.device)
        blocks = blocks.masked_fill(torch.arange(blocks.shape[1], device=blocks.device)[None, :] >= own[:, None], 0)
    shape = (blocks.shape[0], -1, num_kv_heads, head_dim)
    return (k_cache[blocks].reshape(shape)[:, :max_ctx].float(), v_cache[blocks].reshape(shape)[:, :max_ctx].float())


def _padded_queries(query, starts, q_lens, max_q: int) -> torch.Tensor:
    # query: [T, Hq, D] -> [B, max_q, Hq, D] fp32; a padding row repeats its sequence's first query
    last = query.shape[0] - 1                      # (a sequence with no query this step: any real row)
    index = [min(starts[i] + min(j, max(n - 1, 0)), last) for i, n in enumerate(q_lens) for j in range(max_q)]
    picked = query.index_select(0, torch.tensor(index, dtype=torch.int64, device=query.device))
    return picked.float().reshape(len(q_lens), max_q, *query.shape[1:])


def _valid_rows(q_lens, max_q: int, device) -> torch.Tensor:
    # positions in the flattened [B x max_q] of the real query rows, in token order
    index = [i * max_q + j for i, n in enumerate(q_lens) for j in range(n)]
    return torch.tensor(index, dtype=torch.int64, device=device)


def padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens, ctx_lens,
                            scale: float) -> torch.Tensor:
    """Causal attention of each sequence's last q_lens[i] of ctx_lens[i] positions, fp32.

    q: [B, L, Hq, D]; k, v: [B, S, Hkv, D] (Hq a multiple of Hkv: grouped-query heads share a K/V head);
    q_lens, ctx_lens: B host ints -> [B, L, Hq, D]. Query row l of sequence i sits at position
    ctx_lens[i] - q_lens[i] + l and sees keys up to it; padding rows (l >= q_lens[i]) see the sequence's
    real keys and are the caller's to drop. One scaled_dot_product_attention call: the query heads of a
    group ride in its sequence dimension ([B, Hkv, group x L, D]), so K and V are never repeated per head.
    """
    num_seqs, q_len, num_heads, head_dim = q.shape
    ctx_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    ctx = torch.tensor(ctx_lens, dtype=torch.int64, device=device)[:, None]      # [B, 1]
    last = ctx - torch.tensor(q_lens, dtype=torch.int64, device=device)[:, None] + torch.arange(q_len, device=device)
    last = torch.minimum(last, ctx - 1)                                          # [B, L]: the last key each row sees
    mask = torch.arange(ctx_len, device=device)[None, None, :] <= last[:, :, None]   # [B, L, S]
    mask = mask[:, None].repeat(1, 1, group, 1)                                 # [B, 1, group x L, S]
    qh = q.reshape(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qh = qh.reshape(num_seqs, num_kv_heads, group * q_len, head_dim)             # [B, Hkv, group x L, D]
    o = torch.nn.functional.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask, scale=scale)   # [B, Hkv, group x L, D]
    return o.reshape(num_seqs, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(
        num_seqs, q_len, num_heads, head_dim)
