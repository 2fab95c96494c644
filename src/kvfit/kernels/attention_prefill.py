"""Paged prefill attention: variable-length, causal, over a cached prefix; also serves mixed batches.

Query j of sequence i sits at position ``seq_lens[i] - q_len_i + j`` and attends to keys at positions
<= its own; all keys (prefix and new) are read from the paged cache, since write_kv runs first.

Program (seq, row tile, kv head) packs the query heads that share a KV head into its rows:
row r is token ``r // GROUP`` of the sequence, query head ``kv_head * GROUP + r % GROUP``, so each K/V
tile is loaded once for the whole group and a decode sequence (q_len 1) in a mixed batch still fills
GROUP rows. Keys are walked in tiles of BLOCK_N tokens with an online softmax in fp32 (log2 domain).
All offsets are int64 (see attention_common.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfit.kernels.attention_common import (attend_paged_pairs_tile, attend_paged_tile, attention_operands,
                                             dot_ieee, head_dim_mask, kv_tile_tokens, out_scale_operand,
                                             padded_head_dim, pairs_fit, pairs_views, query_in_f16)
from kvfit.kernels.attention_decode import LOG2_E
from kvfit.platforms.gate import on_gpu


# stride_bt is the step's block-table width: not specialized, so a long step never compiles a new
# variant (== 1, divisible by 16) in the middle of serving (see _decode_split_kernel)
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_seqs_ptr, tile_rows_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    MAPPED: tl.constexpr, OUT_SCALED: tl.constexpr = False, PAIRS: tl.constexpr = False,
    CVT_ASM: tl.constexpr = False,
):
    # OUT_SCALED: the output times out_scale_ptr[kv_head] (an fp8 cache's v scale), in fp32 before the rounding
    # PAIRS (an fp8 cache, HEAD_DIM == D_PAD): the caches are int16 views (strides in pairs of e4m3), the dots in
    # fp16 over the even and odd columns apart (attend_paged_pairs_tile, as the decode's)
    if MAPPED:      # program (tile, 0, kv head): its sequence and first row from the tile map (-1: no work)
        tile_seq = tl.load(tile_seqs_ptr + tl.program_id(0))
        if tile_seq < 0:
            return
        seq = tile_seq.to(tl.int64)
        row_start = tl.load(tile_rows_ptr + tl.program_id(0))
    else:           # program (sequence, row tile, kv head)
        seq = tl.program_id(0).to(tl.int64)
        row_start = tl.program_id(1) * BLOCK_M
    kv_head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - tl.load(query_start_loc_ptr + seq)
    if row_start >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = row_start + tl.arange(0, BLOCK_M)
    tok = rows // GROUP                                   # token index within this sequence's queries
    row_mask = tok < q_len
    heads = kv_head * GROUP + (rows % GROUP).to(tl.int64)
    # rows past q_len attend like the last query (finite softmax, never stored)
    q_pos = tl.where(row_mask, prefix_len + tok, seq_len - 1)
    offs_d = tl.arange(0, D_PAD)
    d_mask = head_dim_mask(HEAD_DIM, D_PAD)
    q_mask = row_mask[:, None] & d_mask[None, :]
    q_tok = q_start + tok.to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    last_tok = tl.minimum((row_start + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_hi = prefix_len + last_tok + 1                     # keys any row of this tile may see
    table_row = block_tables_ptr + seq * stride_bt
    # SPLIT: the whole tiles every row of this tile sees (keys < the first row's position + 1) go
    # first, without masks; only the tiles on the causal diagonal pay for them
    kv_full = (prefix_len + row_start // GROUP + 1) // BLOCK_N * BLOCK_N if SPLIT else 0
    if PAIRS:
        q, scale_log2 = query_in_f16(q, scale_log2)
        q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_M, D_PAD // 2, 2]))
        acc_even = tl.zeros([BLOCK_M, D_PAD // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_M, D_PAD // 2], tl.float32)
        for start in range(0, kv_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc_even, acc_odd = attend_paged_pairs_tile(
                q_even, q_odd, m_i, l_i, acc_even, acc_odd, k_cache_ptr, v_cache_ptr, table_row, offs_n,
                offs_n < kv_hi, None, kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, PAGE, D_PAD // 2, CVT_ASM, True)
        for start in range(kv_full, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < kv_hi
            m_i, l_i, acc_even, acc_odd = attend_paged_pairs_tile(
                q_even, q_odd, m_i, l_i, acc_even, acc_odd, k_cache_ptr, v_cache_ptr, table_row, offs_n, n_mask,
                (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], kv_head, scale_log2, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, PAGE, D_PAD // 2, CVT_ASM, False)
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_M, D_PAD])
    else:
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for start in range(0, kv_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = attend_paged_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, offs_n, offs_n < kv_hi, None, d_mask,
                kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                PAGE, D_PAD, IEEE, True)
        for start in range(kv_full, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < kv_hi
            # every row saw a whole unmasked tile already, or this tile holds key 0, which every row sees:
            # the running max is finite from the first tile on
            causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]      # [BLOCK_M, BLOCK_N]
            m_i, l_i, acc = attend_paged_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, offs_n, n_mask, causal, d_mask,
                kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                PAGE, D_PAD, IEEE, False)

    out = acc / l_i[:, None]
    if OUT_SCALED:
        out = out * tl.load(out_scale_ptr + kv_head)
    tl.store(out_ptr + q_tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tile_rows(elem_bytes: int, gpu: bool) -> int:
    """Query rows per program: 64, or 32 for fp32 (IEEE dots without tensor cores spill at 64 on Hopper)."""
    if not gpu:
        return 16
    return 64 if elem_bytes <= 2 else 32


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit queries on a GPU; None keeps the defaults
# (prefill_tile_rows, kv_tile_tokens, 4 warps, Triton's stages). benchmarks/bench_prefill_attention.py
# --sweep times the candidates: on the H200 (2026-12-03) 128 x 128, 8 warps, 3 stages was 5-10% faster
# on 8,000-token prompts and 3-7% slower on 1,024-token ones, and no faster end to end on the
# long-context workload (qwen3-0.6b shape; docs/benchmarks.md), so the defaults stay.
PREFILL_CONFIG: tuple[int, int, int, int] | None = None
# an fp8 cache's dots under a bf16 query on a GPU where pairs_fit: "query" (K and V converted to bf16) or "pairs" (read
# as int16 words of two e4m3, fp16 dots over the even and odd columns, as the decode's FP8_DECODE_CONFIG). At 64 query
# rows the dots are Hopper's wgmma with both operands in shared memory, so either converts a tile in registers and
# stores it back (sm_90 PTX, read on the CPU: no byte-wide loads, unlike the decode's 16-row mma.sync); "query" spends
# three cvt instructions on two values (e4m3x2 -> f16x2, then each f16 -> bf16), "pairs" one. The time each takes:
# benchmarks/bench_prefill_attention.py --kv-cache-dtype fp8_e4m3
FP8_PREFILL_DOTS = "query"


def prefill_tile_map(query_start_loc: torch.Tensor, group: int, block_m: int, num_tiles: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of num_tiles programs' (sequence, first row) for a launch grid fixed in advance (a CUDA graph).

    Sequence i has cdiv(q_len_i * group, block_m) row tiles; they are numbered in sequence order, and tile t
    gets its sequence's index and first row (t - the sequence's first tile) * block_m. Tiles past the last
    sequence's get sequence -1 (no work). Device ops only, no host sync. query_start_loc: [B + 1] int32
    -> (tile_seqs, tile_rows), each [num_tiles] int32."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)          # [B]
    tiles = (q_lens * group + block_m - 1) // block_m                              # [B]
    ends = torch.cumsum(tiles, 0)                                                  # [B]
    tile = torch.arange(num_tiles, dtype=torch.int64, device=query_start_loc.device)
    seq = torch.searchsorted(ends, tile, right=True)                              # [num_tiles]
    valid = seq < ends.numel()
    first = seq.clamp(max=ends.numel() - 1)
    rows = (tile - (ends[first] - tiles[first])) * block_m
    return torch.where(valid, seq, -1).to(torch.int32), torch.where(valid, rows, 0).to(torch.int32)


def mapped_tiles(num_tokens: int, num_seqs: int, group: int, block_m: int) -> int:
    """Programs (per KV head) a tile map needs for any split of num_tokens query tokens among num_seqs sequences:
    the sum over sequences of cdiv(q_len_i * group, block_m) is at most cdiv(T * group, block_m) + B."""
    return triton.cdiv(num_tokens * group, block_m) + num_seqs


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            max_query_len: int, scale: float, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            out: torch.Tensor | None = None, num_stages: int | None = None,
                            split: bool | None = None, tile_maps: dict | None = None,
                            out_scale: torch.Tensor | None = None, dots: str | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context.

    query: [T, Hq, D]; caches: [num_blocks, PAGE, Hkv, D]; block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32; query_start_loc: [B + 1] int32 -> out [T, Hq, D] in query's dtype.
    split: walk the tiles below the causal diagonal without masks (default: on, except fp32, whose IEEE
    dots spill with the second loop on Hopper).
    tile_maps: a launch whose grid depends on T and B only (AttentionMetadata.tile_maps, a CUDA graph's step):
    programs find their rows through prefill_tile_map, built once a step and kept in this dict for the
    other layers; None: the grid is (B, row tiles of max_query_len, Hkv).
    out_scale: fp32 [Hkv] or None: query head h's output times out_scale[h // group] (AttentionBackend.attend).
    dots: "query" (K and V converted to the query's dtype) or "pairs" (an fp8 cache under a 16-bit query, head_dim
    a power of two >= 32: attend_paged_pairs_tile); None: FP8_PREFILL_DOTS for an fp8 cache under a bf16 query on a
    GPU where pairs fit, else "query".
    """
    num_seqs = seq_lens.shape[0]
    _, num_q_heads, head_dim = query.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    query, out = attention_operands(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    if num_seqs == 0 or query.shape[0] == 0 or max_query_len == 0:
        return out
    d_pad = padded_head_dim(head_dim)
    fp8 = k_cache.element_size() == 1
    if dots is None:
        gpu_fp8 = fp8 and query.dtype == torch.bfloat16 and on_gpu(query) and pairs_fit(head_dim)
        dots = FP8_PREFILL_DOTS if gpu_fp8 else "query"
    assert dots == "query" or (dots == "pairs" and fp8 and query.element_size() == 2 and pairs_fit(head_dim)), (
        dots, k_cache.dtype, query.dtype, head_dim)
    pairs = dots == "pairs"
    if PREFILL_CONFIG is not None and query.element_size() <= 2 and d_pad <= 128 and on_gpu(query):
        tuned_m, tuned_n, tuned_warps, tuned_stages = PREFILL_CONFIG
        block_m, block_n = block_m or tuned_m, block_n or tuned_n
        num_warps, num_stages = num_warps or tuned_warps, num_stages or tuned_stages
    block_m = block_m or prefill_tile_rows(query.element_size(), on_gpu(query))
    block_n = block_n or kv_tile_tokens(query.element_size(), d_pad, on_gpu(query))
    num_warps = num_warps or 4
    stages = {} if num_stages is None else {"num_stages": num_stages}
    ieee = dot_ieee(query.dtype)
    split = not ieee if split is None else split
    if tile_maps is None:
        grid = (num_seqs, triton.cdiv(max_query_len * group, block_m), num_kv_heads)
        tile_seqs = tile_rows = query_start_loc         # not read
    else:
        num_tiles = mapped_tiles(query.shape[0], num_seqs, group, block_m)
        key = (group, block_m, num_tiles)
        if key not in tile_maps:
            tile_maps[key] = prefill_tile_map(query_start_loc, group, block_m, num_tiles)
        tile_seqs, tile_rows = tile_maps[key]
        grid = (num_tiles, 1, num_kv_heads)
    out_scale, scaled = out_scale_operand(out_scale, num_kv_heads, seq_lens)
    k_arg, v_arg = pairs_views(k_cache, v_cache) if pairs else (k_cache, v_cache)     # pairs: strides in words
    _prefill_kernel[grid](
        query, k_arg, v_arg, out, out_scale, block_tables, seq_lens, query_start_loc,
        tile_seqs, tile_rows, scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_arg.stride(0), k_arg.stride(1), k_arg.stride(2),
        v_arg.stride(0), v_arg.stride(1), v_arg.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=ieee, SPLIT=split, MAPPED=tile_maps is not None, OUT_SCALED=scaled, PAIRS=pairs,
        CVT_ASM=pairs and on_gpu(query), num_warps=num_warps, **stages,
    )
    return out
