"""Triton KV-cache write kernel, and the helpers the decode and prefill kernels share.

Every element offset is computed in int64: block ids, slots, token indices and head indices are cast
to ``tl.int64`` before they meet a stride, so ``block_id * block_stride`` cannot wrap at 2^31 (the bug
that crashed another engine past 2^31 elements). Strides arrive as kernel arguments that Triton may
specialise to int32; an int64 index times an int32 stride is an int64 product, so no cast of the
stride is needed once the index is int64.

Kernels here and in attention_decode.py / attention_prefill.py; the backend is attention/triton_backend.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvfit.kernels import pdl
from kvfit.kv.spec import PADDING_SLOT_ID


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def padded_head_dim(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (tl.dot's smallest K); pad lanes are masked."""
    return max(16, next_pow2(head_dim))


def pairs_fit(head_dim: int) -> bool:
    """Whether an fp8 cache's rows can be read as int16 words of two e4m3 (attend_paged_pairs_tile): whole rows of
    pairs with no padded lanes, and half a row (a dot's K) 16 at least."""
    return head_dim == padded_head_dim(head_dim) and head_dim >= 32


def pairs_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache pair as the int16 views attend_paged_pairs_tile reads (strides in words, from the views)."""
    assert k_cache.element_size() == 1 and k_cache.stride(3) == v_cache.stride(3) == 1, (k_cache.dtype,)
    return k_cache.view(torch.int16), v_cache.view(torch.int16)


def largest_element_offset(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes when it addresses every element of `t`."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)


def kv_tile_tokens(elem_bytes: int, d_pad: int, gpu: bool) -> int:
    """Tokens per K/V tile: 64 for 16-bit queries up to head_dim 128, else 32; 16 in the interpreter.

    elem_bytes is the query dtype's (K/V are converted to it). Sized so Hopper needs no register
    spills and little shared memory (checked by the sm_90 compile test in tests/attention).
    """
    if not gpu:
        return 16
    return 64 if elem_bytes <= 2 and d_pad <= 128 else 32


def dot_ieee(dtype: torch.dtype) -> bool:
    """fp32 inputs take IEEE fp32 dot products (no tf32), so fp32 results match the reference closely."""
    return dtype == torch.float32


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Caches: [num_blocks, block_size, Hkv, D], head_dim contiguous (the layout KVSpec owns)."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)


def check_step_tensors(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """The kernels index these with unit inner strides (block table rows, per-seq vectors)."""
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, block_tables.stride()
    assert seq_lens.stride(0) == 1 and query_start_loc.stride(0) == 1
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1, (query_start_loc.shape, seq_lens.shape)


def head_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with stride(2) == 1 (any token/head strides are fine: the kernels take them)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def out_scale_operand(out_scale: torch.Tensor | None, num_kv_heads: int, unused: torch.Tensor
                      ) -> tuple[torch.Tensor, bool]:
    """(what a kernel's out_scale_ptr takes, OUT_SCALED): out_scale checked (fp32 [Hkv], an fp8 cache's v scales),
    or `unused` (any tensor: not read) and False without one."""
    if out_scale is None:
        return unused, False
    assert out_scale.dtype == torch.float32 and out_scale.shape == (num_kv_heads,), out_scale
    return out_scale, True


def attention_operands(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                       out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a step's tensors for the decode/prefill kernels -> (query, out), both [T, Hq, D], head_dim contiguous."""
    check_cache_pair(k_cache, v_cache)
    check_step_tensors(block_tables, seq_lens, query_start_loc)
    query = head_dim_contiguous(query)
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1, (out.shape, out.stride())
    return query, out


@triton.jit
def head_dim_mask(HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """[D_PAD] lanes < HEAD_DIM; all-true as a constant when nothing is padded, so loads vectorise."""
    if HEAD_DIM == D_PAD:
        mask = tl.full([D_PAD], 1, tl.int1)
    else:
        mask = tl.arange(0, D_PAD) < HEAD_DIM
    return mask


@triton.jit
def tile_dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE fp32 products (no tf32) when IEEE."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def load_paged_tile(cache_ptr, blk, within, kv_head, stride_b, stride_s, stride_h, kv_mask,
                    D_PAD: tl.constexpr, DTYPE: tl.constexpr):
    """[BLOCK_N, D_PAD] rows of one KV head at (block id, in-block position), as DTYPE; masked rows are 0."""
    off = blk * stride_b + within * stride_s + kv_head * stride_h             # [BLOCK_N] int64
    return tl.load(cache_ptr + off[:, None] + tl.arange(0, D_PAD)[None, :], mask=kv_mask, other=0.0).to(DTYPE)


@triton.jit
def attend_paged_tile(
    q, m_i, l_i, acc,                      # [M, D_PAD]; [M], [M], [M, D_PAD] fp32 running softmax state
    k_cache_ptr, v_cache_ptr, table_row,   # table_row: this sequence's block table row
    offs_n, n_mask, visible, d_mask,       # [BLOCK_N] context positions, in range; [M or 1, BLOCK_N]; [D_PAD]
    kv_head, scale_log2,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, D_PAD: tl.constexpr, IEEE: tl.constexpr, FULL: tl.constexpr,
    P_SCALE: tl.constexpr = 1.0,
):
    """One online-softmax step (log2 domain) of q over the paged K/V tile at offs_n -> (m_i, l_i, acc).

    K and V are read as q's dtype, and the probabilities multiplied by P_SCALE before their cast to it (fp8 dots:
    p <= 1 times 448 uses e4m3's range; the caller divides acc by P_SCALE). scale_log2 may be [M, 1] (a scale
    per query row).

    The caller owns the mask: `visible` says which (row, key) scores count (decode: the key is in the
    split; prefill: also causal). FULL says every key of the tile is in range and visible to every row
    (prefill tiles below the causal diagonal): no mask is applied, so loads vectorise and no scores are
    selected. Block ids and in-block positions are int64 before any stride.
    """
    within = (offs_n % PAGE).to(tl.int64)
    if FULL:
        blk = tl.load(table_row + offs_n // PAGE).to(tl.int64)
        kv_mask = tl.full(offs_n.shape, 1, tl.int1)[:, None] & d_mask[None, :]
    else:
        blk = tl.load(table_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    k = load_paged_tile(k_cache_ptr, blk, within, kv_head, stride_kb, stride_ks, stride_kh, kv_mask, D_PAD, q.dtype)
    s = tile_dot(q, tl.trans(k), IEEE)
    if FULL:
        s = s * scale_log2
    else:
        s = tl.where(visible, s * scale_log2, float("-inf"))                 # [M, BLOCK_N]
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
    v = load_paged_tile(v_cache_ptr, blk, within, kv_head, stride_vb, stride_vs, stride_vh, kv_mask, D_PAD, q.dtype)
    if P_SCALE == 1.0:
        pv = p.to(v.dtype)
    else:
        pv = (p * P_SCALE).to(v.dtype)
    acc = acc * alpha[:, None] + tile_dot(pv, v, IEEE)
    return m_new, l_i, acc


@triton.jit
def softmax_step(s, m_i, l_i):
    """The online softmax over one tile's scores s [M, BLOCK_N] (log2 domain) -> (new max [M], the factor the
    running acc is rescaled by [M], the tile's probabilities [M, BLOCK_N], new sum [M])."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


# a query scaled into fp16 for an fp8 cache's fp16 dots stays below this (2^14: a score sums 128+ products of it
# with keys up to 448, in fp32, so only the query itself must fit fp16's 65,504)
F16_QUERY_MAX = tl.constexpr(16384.0)


@triton.jit
def query_in_f16(q, scale_log2):
    """A query tile [M, D] for fp16 dots against an fp8 cache (e4m3 converts to fp16 exactly, in one instruction):
    each row scaled by a power of two so that its largest is at most F16_QUERY_MAX and above half of it (exact: a
    bf16 value has fewer mantissa bits than fp16; a loud row past fp16's range comes down, a tiny one comes up out of
    fp16's subnormals), the score scale times the inverse -> (fp16 q, scale_log2 [M, 1]). An all-zero row (a
    padding row) is scaled by 2^74 and stays zero."""
    q_max = tl.max(tl.abs(q.to(tl.float32)), 1)                                             # [M]
    shift = tl.ceil(tl.log2(tl.maximum(q_max, 8.673617379884035e-19) / F16_QUERY_MAX))[:, None]   # 2^-60 at least
    return (q.to(tl.float32) * tl.exp2(-shift)).to(tl.float16), scale_log2 * tl.exp2(shift)


@triton.jit
def e4m3_pairs_to_f16(w, CVT_ASM: tl.constexpr):
    """int16 words, each two e4m3 bytes (low: an even column, high: the odd one after it) -> (even, odd) fp16
    tensors, exactly. CVT_ASM: one cvt.rn.f16x2.e4m3x2 a word (sm_89+); else bit arithmetic (the interpreter):
    e4m3's sign/exponent/mantissa bits moved into fp16's read as the value / 2^8 (bias 15 against 7, subnormals
    included), times 2^8."""
    if CVT_ASM:
        lo, hi = tl.inline_asm_elementwise("{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
                                           "=h,=h,h", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:                   # e4m3's NaN (0x7F, 0xFF) stays NaN, as the cvt makes it (a poisoned slot shows)
        lo = tl.where((w & 0x7F) == 0x7F, float("nan"),
                      (((w & 0x7F) << 7) | ((w & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0)
        hi = tl.where((w & 0x7F00) == 0x7F00, float("nan"),
                      (((w & 0x7F00) >> 1) | (w & -32768)).to(tl.float16, bitcast=True) * 256.0)
    return lo.to(tl.float16), hi.to(tl.float16)


@triton.jit
def attend_paged_pairs_tile(
    q_even, q_odd, m_i, l_i, acc_even, acc_odd,    # fp16 [M, D_HALF] each (query_in_f16); the running softmax state
    k_cache_ptr, v_cache_ptr, table_row,           # the caches as int16 (two e4m3 a word), strides in words
    offs_n, n_mask, visible,                       # as attend_paged_tile's, and FULL
    kv_head, scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, D_HALF: tl.constexpr, CVT_ASM: tl.constexpr, FULL: tl.constexpr,
):
    """attend_paged_tile over an fp8 cache read as int16 pairs (strides in pairs): the dots in fp16 over the
    even and the odd columns apart. K and V reach shared memory as 16-bit words, so V's transposed operand
    loads by ldmatrix.trans (as a 16-bit cache's does); converted from fp8 after it, it was read a byte a load."""
    within = (offs_n % PAGE).to(tl.int64)
    if FULL:
        blk = tl.load(table_row + offs_n // PAGE).to(tl.int64)
        rows = tl.full(offs_n.shape, 1, tl.int1)[:, None]
    else:
        blk = tl.load(table_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = n_mask[:, None]
    k_even, k_odd = e4m3_pairs_to_f16(load_paged_tile(k_cache_ptr, blk, within, kv_head, stride_kb, stride_ks,
                                                      stride_kh, rows, D_HALF, tl.int16), CVT_ASM)  # [BLOCK_N, D_HALF]
    s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))                           # [G_PAD, BLOCK_N]
    if FULL:
        s = s * scale_log2
    else:
        s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
    v_even, v_odd = e4m3_pairs_to_f16(load_paged_tile(v_cache_ptr, blk, within, kv_head, stride_vb, stride_vs,
                                                      stride_vh, rows, D_HALF, tl.int16), CVT_ASM)
    pv = p.to(tl.float16)
    acc_even = acc_even * alpha[:, None] + tl.dot(pv, v_even)
    acc_odd = acc_odd * alpha[:, None] + tl.dot(pv, v_odd)
    return m_new, l_i, acc_even, acc_odd


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr,          # [T, Hkv, D]
    k_cache_ptr, v_cache_ptr,    # [num_blocks, PAGE, Hkv, D]
    slot_ptr,                    # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, PAD_SLOT: tl.constexpr, PDL: tl.constexpr,
):
    # one program per token: copies its [Hkv, D] key and value into the slot's row
    if PDL:     # before any load and before the early return (pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot == PAD_SLOT:
        return
    blk = slot // PAGE
    within = slot % PAGE
    offs_h = tl.arange(0, H_PAD).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & head_dim_mask(HEAD_DIM, D_PAD)[None, :]

    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_row = blk * stride_kcb + within * stride_kcs
    v_row = blk * stride_vcb + within * stride_vcs
    tl.store(k_cache_ptr + k_row + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_row + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [Hkv, D] to slot slot_mapping[t]; PADDING_SLOT_ID rows are skipped.

    key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] in their own dtype (values are
    cast, fp8 e4m3 with scale 1.0); slot_mapping: [T] int64.
    """
    check_cache_pair(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape[2:] == key.shape[1:], (key.shape, k_cache.shape)
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if num_tokens == 0:
        return
    key, value = head_dim_contiguous(key), head_dim_contiguous(value)
    slot_mapping = slot_mapping.to(torch.int64)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_kv_heads), D_PAD=next_pow2(head_dim),
        PAGE=k_cache.shape[1], PAD_SLOT=PADDING_SLOT_ID,
        num_warps=4 if num_kv_heads * head_dim <= 2048 else 8, **pdl.launch_args(key),
    )
