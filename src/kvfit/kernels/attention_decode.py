"""Paged decode attention (every sequence has one query token): split-K flash decoding.

Program (seq, kv head [, head chunk], split) reads the query heads that share that KV head, walks its
split of the context in tiles of BLOCK_N tokens (gathering each token's block id from the block
table) and keeps an online softmax in fp32. With one split it writes the output directly; with more,
each split writes a partial (max, sum, acc) and a reduce kernel combines them.

Scores are kept in the log2 domain (scale * log2(e) folded into the scale) so exp2 is used throughout.
All offsets are int64 (see attention_common.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvfit.kernels import pdl
from kvfit.kernels.attention_common import (attend_paged_pairs_tile, attend_paged_tile, attention_operands,
                                             dot_ieee, head_dim_mask, kv_tile_tokens, next_pow2, out_scale_operand,
                                             padded_head_dim, pairs_fit, pairs_views, query_in_f16)
from kvfit.platforms.gate import on_gpu

LOG2_E = 1.4426950408889634
# Split-K tuning (H200, benchmarks/bench_decode_attention.py --sweep): about this many programs fit on an SM at
# once; never split a context into pieces shorter than this many tokens.
PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_head_programs: int, num_sms: int) -> int:
    """Splits per context: as many as still fit the GPU in one wave of programs, none shorter than
    MIN_SPLIT_TOKENS.

    Rounded down: a second, partly filled wave costs more than the splits gain (the 2026-12-03 sweep at
    batch 32 x 8 KV heads on 132 SMs: 3 splits, 768 programs, reached 0.70-0.91 of copy bandwidth, 2 splits
    0.92-1.05, 4 splits 0.84-1.05; at batch 64, 1 split was best).
    """
    programs = max(1, num_seqs * num_kv_head_programs)
    wanted = PROGRAMS_PER_SM * num_sms // programs
    by_length = max(1, -(-max_seq_len // MIN_SPLIT_TOKENS))
    return max(1, min(wanted, by_length, MAX_SPLITS))


# Cascade (a prefix every sequence shares, attended once for all of them): worth its two extra launches from
# this many sequences and shared tokens on (vLLM's thresholds; benchmarks/bench_decode_attention.py --cascade)
CASCADE_MIN_SEQS = 8
CASCADE_MIN_TOKENS = 256
CASCADE_MIN_SHARED_READS = 32000      # sequences x shared tokens
MIN_PREFIX_SPLITS = 4
MAX_PREFIX_SPLITS = 16


def choose_prefix_splits(num_seqs: int, group: int, num_kv_heads: int, elem_bytes: int, num_sms: int) -> int:
    """Splits of the shared prefix: a power of two, at least one program per SM, at least MIN_PREFIX_SPLITS
    (the best of 2-16 at batch 64 and 256, 2,000 shared tokens, on the H200: 2026-12-04)."""
    row_programs = num_kv_heads * -(-num_seqs * group // shared_prefix_rows(elem_bytes))
    wanted = next_pow2(max(1, num_sms // max(1, row_programs)))
    return max(MIN_PREFIX_SPLITS, min(wanted, MAX_PREFIX_SPLITS))


FP8_MAX = tl.constexpr(448.0)          # e4m3's largest
# an fp8 cache's decode launch: (tokens per tile, warps, pipeline stages or None for Triton's default, the dots:
# "query" (bf16), "fp16", "fp8" or "pairs").
# The best of 24 on the H100 over batch 64 and 256 at contexts 647 and 2,048 (benchmarks/probe_fp8_decode.py,
# 2026-12-07): pairs at 64-token tiles, 692 us in all against 904 for the fp16 dots' best launch (128 tokens, 4
# warps, 2 stages); at batch 256 x 2,048 it reads at 0.91 of copy bandwidth, a bf16 cache's decode at 1.01
FP8_DECODE_CONFIG = (64, 4, 3, "pairs")
DOTS = ("query", "fp16", "fp8", "pairs")


def heads_per_program(group: int) -> int:
    """Query heads one program handles: the GQA group padded to >= 16 rows (tl.dot's smallest M), <= 64."""
    return max(16, min(next_pow2(group), 64))


# step-dependent ints are not specialized (== 1, divisible by 16): a variant first met in a long run
# would compile there, in the timed region (the first throughput repetition lost 30% to two compiles)
@triton.jit(do_not_specialize=["num_splits", "prefix_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, prefix_len_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,     # [B, Hq, P + S], [B, Hq, P + S], [B, Hq, P + S, D_PAD] fp32
    scale_log2, num_splits, prefix_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_CHUNKS: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr, IEEE: tl.constexpr, CASCADE: tl.constexpr, PDL: tl.constexpr,
    DOT_F16: tl.constexpr = False, DOT_FP8: tl.constexpr = False, OUT_SCALED: tl.constexpr = False,
    PAIRS: tl.constexpr = False, CVT_ASM: tl.constexpr = False,
):
    # OUT_SCALED: the output (or the partial acc, which the reduce sums linearly) times out_scale_ptr[kv_head] (an
    # fp8 cache's v scale), in fp32 before the rounding
    # DOT_F16 (an fp8 cache under a bf16 query): the dots run in fp16, to which e4m3 converts in one instruction
    # and exactly (to bf16 it goes through fp16). The query is scaled by a power of two into fp16's range first
    # (exact; undone in the score scale), so no query overflows.
    # DOT_FP8 (an fp8 cache): fp8 x fp8 dots, no conversion of K or V at all: each query row quantized to e4m3
    # with its own scale (undone in the score scale), the probabilities times FP8_MAX (448: e4m3's range)
    # before their cast, undone at the end (FlashAttention-3's fp8 scheme; less exact: probe_fp8_decode.py says
    # how much)
    # PAIRS (an fp8 cache, with DOT_F16, HEAD_DIM == D_PAD): the caches are int16 views (strides in pairs of
    # e4m3); attend_paged_pairs_tile's dots run over the even and odd columns apart
    # with CASCADE the context starts after the shared prefix (prefix_len_ptr[0] tokens, attended by
    # _shared_prefix_kernel into partials 0..prefix_splits-1); this kernel's go after them. prefix_splits is
    # a runtime int (0 without CASCADE) so each bucket's split count compiles no variant of its own
    if PDL:     # before any load (pdl.py)
        gdc_wait()
    seq = tl.program_id(0).to(tl.int64)
    kv_head = (tl.program_id(1) // HEAD_CHUNKS).to(tl.int64)
    chunk = tl.program_id(1) % HEAD_CHUNKS
    split = tl.program_id(2)

    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    has_query = tl.load(query_start_loc_ptr + seq + 1) > tok
    seq_len = tl.load(seq_lens_ptr + seq)
    if CASCADE:
        base = tl.load(prefix_len_ptr)
    else:
        base = 0
    # splits are whole tiles; a short context leaves trailing splits empty (they write m = -inf, l = 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
    lo = base + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    hi = tl.where(has_query, hi, lo)

    offs_g = chunk * G_PAD + tl.arange(0, G_PAD)
    head_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g.to(tl.int64)                       # [G_PAD] query heads
    offs_d = tl.arange(0, D_PAD)
    d_mask = head_dim_mask(HEAD_DIM, D_PAD)
    q_mask = head_mask[:, None] & d_mask[None, :] & has_query
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_F16:
        q, scale_log2 = query_in_f16(q, scale_log2)
    if DOT_FP8:
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30) / FP8_MAX         # [G_PAD]
        q = (q.to(tl.float32) / q_scale[:, None]).to(k_cache_ptr.dtype.element_ty)
        scale_log2 = scale_log2 * q_scale[:, None]                                         # [G_PAD, 1]
        P_SCALE: tl.constexpr = FP8_MAX
    else:
        P_SCALE: tl.constexpr = 1.0

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    if PAIRS:
        q_even, q_odd = tl.split(tl.reshape(q, [G_PAD, D_PAD // 2, 2]))
        acc_even = tl.zeros([G_PAD, D_PAD // 2], tl.float32)
        acc_odd = tl.zeros([G_PAD, D_PAD // 2], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            m_i, l_i, acc_even, acc_odd = attend_paged_pairs_tile(
                q_even, q_odd, m_i, l_i, acc_even, acc_odd, k_cache_ptr, v_cache_ptr, table_row, offs_n, n_mask,
                n_mask[None, :], kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, PAGE, D_PAD // 2, CVT_ASM, False)
        acc = tl.reshape(tl.join(acc_even, acc_odd), [G_PAD, D_PAD])
    else:
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            m_i, l_i, acc = attend_paged_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, offs_n, n_mask, n_mask[None, :], d_mask,
                kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                PAGE, D_PAD, IEEE, False, P_SCALE)
    if PDL:
        gdc_launch_dependents()

    if DOT_FP8:
        acc = acc / P_SCALE
    if OUT_SCALED:
        acc = acc * tl.load(out_scale_ptr + kv_head)
    if DIRECT_OUT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * NUM_Q_HEADS + heads) * (prefix_splits + num_splits) + prefix_splits + split   # [G_PAD]
        tl.store(part_m_ptr + part, m_i, mask=head_mask)
        tl.store(part_l_ptr + part, l_i, mask=head_mask)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=head_mask[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "prefix_splits"])
def _shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_scale_ptr, block_tables_ptr, query_start_loc_ptr, prefix_len_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,     # as _decode_split_kernel's; this kernel writes partials 0..P-1
    scale_log2, num_seqs, num_splits, prefix_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    OUT_SCALED: tl.constexpr = False,
):
    """Cascade attention's first level: the prefix_len_ptr[0] tokens every sequence shares (read through
    block_tables row 0's blocks), once per tile for ROWS query rows of many sequences, instead of once per
    sequence. Program (kv head, row block, split); row r is sequence r // GROUP's query head
    kv_head * GROUP + r % GROUP."""
    if PDL:     # before any load (pdl.py)
        gdc_wait()
    kv_head = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    split = tl.program_id(2)
    seq = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP                                          # [ROWS] int64
    in_batch = seq < num_seqs
    tok = tl.load(query_start_loc_ptr + seq, mask=in_batch, other=0).to(tl.int64)
    row_ok = in_batch & (tl.load(query_start_loc_ptr + seq + 1, mask=in_batch, other=0) > tok)
    offs_d = tl.arange(0, D_PAD)
    d_mask = head_dim_mask(HEAD_DIM, D_PAD)
    q_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask,
                other=0.0)
    prefix_len = tl.load(prefix_len_ptr)
    split_len = tl.cdiv(tl.cdiv(prefix_len, prefix_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, prefix_len)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        m_i, l_i, acc = attend_paged_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, offs_n, n_mask, n_mask[None, :],
            d_mask, kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE, D_PAD, IEEE, False)
    if PDL:
        gdc_launch_dependents()
    if OUT_SCALED:
        acc = acc * tl.load(out_scale_ptr + kv_head)
    part = (seq * NUM_Q_HEADS + heads) * (prefix_splits + num_splits) + split        # [ROWS] int64
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr, query_start_loc_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    num_splits, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    HEADS: tl.constexpr, PDL: tl.constexpr,
):
    # program (seq, block of HEADS query heads): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
    # Several heads per program: one per (seq, head) made 8,000 programs of 5 x 128 floats each at batch
    # 256 x 32 heads, and the reduce cost a quarter of the cascade decode's time
    if PDL:     # before any load and before the early return (pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * HEADS + tl.arange(0, HEADS)       # [HEADS]
    h_mask = heads < NUM_Q_HEADS
    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    if tl.load(query_start_loc_ptr + seq + 1) == tok:
        return                                                                # no query, no output row
    offs_s = tl.arange(0, S_PAD)
    hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]               # [HEADS, S_PAD]
    offs_d = tl.arange(0, D_PAD)
    part = (seq * NUM_Q_HEADS + heads)[:, None] * num_splits + offs_s[None, :]       # [HEADS, S_PAD] int64
    m = tl.load(part_m_ptr + part, mask=hs_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=hs_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, :, None] * D_PAD + offs_d[None, None, :], mask=hs_mask[:, :, None],
                  other=0.0)                                                  # [HEADS, S_PAD, D_PAD]
    m_max = tl.where(h_mask, tl.max(m, 1), 0.0)                               # heads past the last: all -inf
    w = tl.exp2(m - m_max[:, None])                                           # empty splits weigh 0
    denom = tl.where(h_mask, tl.sum(l * w, 1), 1.0)
    out = tl.sum(acc * w[:, :, None], 1) / denom[:, None]                     # [HEADS, D_PAD]
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & head_dim_mask(HEAD_DIM, D_PAD)[None, :])


REDUCE_TILE_FLOATS = 8192
# fewer reduce programs than this and several heads a program cost more than they save: at batch 1 (32 heads,
# 4 programs of 8) the 8B decode ran 1.5% slower than with one head a program (H200, 2026-12-04)
REDUCE_MIN_PROGRAMS = 512


def reduce_heads_per_program(num_q_heads: int, s_pad: int, d_pad: int, num_seqs: int | None = None) -> int:
    """Query heads one reduce program combines: a power of two, as many as keep its [heads, splits, head_dim]
    fp32 partials within 64 registers a thread at 4 warps (8,192 floats), at most the (padded) head count,
    and (num_seqs given) fewer while the grid would have under REDUCE_MIN_PROGRAMS programs."""
    fit = max(1, REDUCE_TILE_FLOATS // (s_pad * d_pad))
    heads = max(1, min(next_pow2(num_q_heads), 1 << (fit.bit_length() - 1)))
    while num_seqs is not None and heads > 1 and num_seqs * -(-num_q_heads // heads) < REDUCE_MIN_PROGRAMS:
        heads //= 2
    return heads


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, num_splits: int, block_n: int | None = None,
                           num_warps: int | None = None, out: torch.Tensor | None = None,
                           prefix_len: torch.Tensor | None = None, prefix_splits: int = 0,
                           num_stages: int | None = None, dots: str | None = None,
                           out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query: [T, Hq, D] (token query_start_loc[i] belongs to seq i); caches: [num_blocks, PAGE, Hkv, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 -> out [T, Hq, D] in query's dtype.
    Cascade (prefix_splits > 0): prefix_len, a [1] int32 device tensor, is a number of tokens (a multiple
    of PAGE, 0 allowed) whose K/V every sequence shares with block_tables[0]'s blocks (the same blocks, or
    copies), and every sequence with a query has more tokens than; those are attended once for all
    sequences through row 0's blocks, in prefix_splits splits.
    out_scale: fp32 [Hkv] or None: query head h's output times out_scale[h // group] (AttentionBackend.attend).
    """
    num_seqs = seq_lens.shape[0]
    _, num_q_heads, head_dim = query.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    query, out = attention_operands(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    d_pad = padded_head_dim(head_dim)
    g_pad = heads_per_program(group)
    head_chunks = -(-group // g_pad)
    # an fp8 cache under a bf16 query on a GPU, head_dim <= 128: FP8_DECODE_CONFIG for the split kernel (the
    # cascade's shared-prefix kernel keeps kv_tile_tokens: 128-token tiles spill there); an argument given wins
    fp8 = k_cache.element_size() == 1 and query.dtype == torch.bfloat16 and d_pad <= 128 and on_gpu(query)
    tile, warps, stages, config_dots = FP8_DECODE_CONFIG if fp8 else (None, 4, None, "query")
    prefix_block_n = block_n or kv_tile_tokens(query.element_size(), d_pad, on_gpu(query))
    block_n = block_n or tile or prefix_block_n
    num_warps = num_warps or warps
    num_stages = stages if num_stages is None else num_stages
    if dots is None:        # the config's pairs where they fit, else fp16
        dots = "fp16" if config_dots == "pairs" and not pairs_fit(head_dim) else config_dots
    assert dots in DOTS and (dots == "query" or k_cache.element_size() == 1), (dots, k_cache.dtype)
    pairs = dots == "pairs"
    assert not pairs or pairs_fit(head_dim), "pairs: whole rows of pairs, head_dim >= 32"
    num_splits = max(1, int(num_splits))
    cascade = prefix_splits > 0
    assert not cascade or (prefix_len is not None and prefix_len.shape == (1,)), "cascade needs prefix_len [1]"
    direct = num_splits == 1 and not cascade
    total = num_splits + prefix_splits
    # partials [B, Hq, S] (max, sum) and [B, Hq, S, D_PAD] (acc); one split writes out directly
    parts = (1, 1, 1) if direct else (num_seqs, num_q_heads, total)
    part_m = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_l = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_acc = torch.empty((*parts, d_pad), dtype=torch.float32, device=query.device)
    ieee, launch = dot_ieee(query.dtype), pdl.launch_args(query)
    out_scale, scaled = out_scale_operand(out_scale, num_kv_heads, seq_lens)
    strides = _cache_strides(k_cache, v_cache)
    # pairs: the split kernel reads the caches as int16 (two e4m3 a word), in the views' own strides
    k_split, v_split = pairs_views(k_cache, v_cache) if pairs else (k_cache, v_cache)
    split_strides = _cache_strides(k_split, v_split)
    if cascade:
        rows = shared_prefix_rows(query.element_size())
        _shared_prefix_kernel[(num_kv_heads, triton.cdiv(num_seqs * group, rows), prefix_splits)](
            query, k_cache, v_cache, out_scale, block_tables, query_start_loc, prefix_len, part_m, part_l, part_acc,
            scale * LOG2_E, num_seqs, num_splits, prefix_splits, query.stride(0), query.stride(1), *strides,
            NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_N=prefix_block_n,
            ROWS=rows, IEEE=ieee, OUT_SCALED=scaled, num_warps=4, **launch)
    _decode_split_kernel[(num_seqs, num_kv_heads * head_chunks, num_splits)](
        query, k_split, v_split, out, out_scale, block_tables, seq_lens, query_start_loc,
        prefix_len if cascade else seq_lens, part_m, part_l, part_acc, scale * LOG2_E, num_splits, prefix_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *split_strides, block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_CHUNKS=head_chunks, G_PAD=g_pad,
        HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_N=block_n,
        DIRECT_OUT=direct, IEEE=ieee, CASCADE=cascade, DOT_F16=dots in ("fp16", "pairs"), DOT_FP8=dots == "fp8",
        OUT_SCALED=scaled, PAIRS=pairs, CVT_ASM=pairs and on_gpu(query), num_warps=num_warps,
        **launch,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if not direct:
        s_pad = next_pow2(total)
        reduce_heads = reduce_heads_per_program(num_q_heads, s_pad, d_pad, num_seqs)
        _decode_reduce_kernel[(num_seqs, triton.cdiv(num_q_heads, reduce_heads))](
            out, query_start_loc, part_m, part_l, part_acc, total, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=s_pad, HEADS=reduce_heads,
            num_warps=4, **launch,
        )
    return out


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def shared_prefix_rows(elem_bytes: int) -> int:
    """Query rows (sequences x group) per shared-prefix program: 64 for 16-bit queries, 32 for fp32."""
    return 64 if elem_bytes <= 2 else 32


def decode_read_bytes(seq_lens: list[int], num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> int:
    """Bytes of K and V a decode step must read: every context token's K and V once."""
    elem = torch.empty((), dtype=cache_dtype).element_size()
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * elem
