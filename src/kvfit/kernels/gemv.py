"""y = x @ W^T for one row of x (batch-1 decode) in Triton, reading W once at full bandwidth.

At one token per step every linear layer is a matrix-vector product bound by reading its weight;
program n reads BLOCK_N whole rows of W (contiguous along K, so loads are wide and coalesced) and
reduces them against x in fp32. Offsets are int64 (row * stride), as everywhere in kvfit.
Two variants carry their layer's next op in the epilogue, so a one-token step has fewer launches: the MLP's
fused gate/up weight (gemv_silu_mul: a program reads a gate row and its up row and writes silu(gate) * up) and
the fused q/k/v weight (gemv_rope_write_kv: a program reads the two rows RoPE rotates together, rotates q and k
and writes k and v to the token's KV-cache slot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfit.kernels import pdl
from kvfit.kv.spec import PADDING_SLOT_ID
from kvfit.platforms.gate import triton_applies

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from kvfit.kernels.fused_ops import rotate_halves, silu_times, store_kv_halves
except ImportError:  # CPU-only installs
    triton = None

# (BLOCK_N, BLOCK_K, num_warps, num_stages) by weight shape, from benchmarks/bench_gemv.py's sweep on the H200
# (2026-12-03, launched with PDL, 8B shapes; read bandwidth against (2, 2048, 4) for all): long rows
# (down, K 14336) one row per program, 4.12 vs 3.72 TB/s; many rows (gate/up, lm_head) 2 x 4096 with 8
# warps, 4.28 vs 4.22 and 4.60 vs 4.52; the rest (q/k/v, o) 2 x 1024, 3.71 vs 3.53 and 3.57 vs 3.35.
# The decode step's linears: 3.63 ms against 3.80 ms. The loop's loads are not software-pipelined
# (no dot), so stages do not matter.
LONG_ROW_CONFIG, MANY_ROWS_CONFIG, DEFAULT_CONFIG = (1, 2048, 4, 1), (2, 4096, 8, 1), (2, 1024, 4, 1)
LONG_ROW_K, MANY_ROWS_N = 8192, 16384


def config_for(n: int, k: int) -> tuple[int, int, int, int]:
    """The launch config for an [n, k] weight; BLOCK_K never wider than k (padded to a power of two)."""
    block_n, block_k, warps, stages = (LONG_ROW_CONFIG if k >= LONG_ROW_K else
                                       MANY_ROWS_CONFIG if n >= MANY_ROWS_N else DEFAULT_CONFIG)
    return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages


if triton is not None:
    @triton.jit
    def _rows_times_x(x_ptr, w_ptr, rows, row_mask, bias_ptr, stride_wn, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """fp32 (W[rows] @ x + bias[rows]) for a program's rows (int64 indices; K a compile-time constant:
        static loop bounds)."""
        cols = tl.arange(0, BLOCK_K)
        w_row = w_ptr + rows[:, None] * stride_wn
        # the first weight tile is read-only data: with PDL it streams in while the previous kernel ends
        w = tl.load(w_row + cols[None, :], mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
        if PDL:
            gdc_wait()
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
        for k in range(BLOCK_K, K, BLOCK_K):
            k_mask = (k + cols) < K
            x = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_row + (k + cols)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        if PDL:
            gdc_launch_dependents()
        y = tl.sum(acc, 1)
        if HAS_BIAS:    # added in fp32 before the one rounding, as cuBLAS's epilogue does
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        y = _rows_times_x(x_ptr, w_ptr, rows.to(tl.int64), row_mask, bias_ptr, stride_wn, K, BLOCK_K, HAS_BIAS, PDL)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _gemv_silu_mul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        # w: [2 N, K], gate rows then up rows. Program p reads gate rows p*BLOCK_N.. and the up rows N above
        # them (tile row r: output row r // 2, gate for even r, up for odd), so it writes silu(gate) * up itself
        r = tl.arange(0, 2 * BLOCK_N)
        out_rows = tl.program_id(0) * BLOCK_N + r // 2
        rows = out_rows.to(tl.int64) + (r % 2).to(tl.int64) * N
        y = _rows_times_x(x_ptr, w_ptr, rows, out_rows < N, bias_ptr, stride_wn, K, BLOCK_K, HAS_BIAS, PDL)
        # rounded to the output dtype first, as the unfused gate/up matmul stores them, then as silu_mul
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(y, [BLOCK_N, 2]))
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + offs, silu_times(gate, up).to(out_ptr.dtype.element_ty), mask=offs < N)


if triton is not None:
    @triton.jit
    def _gemv_rope_write_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr,
                                slot_ptr, num_pairs, stride_wn, stride_kcb, stride_kcs, stride_kch, stride_vcb,
                                stride_vcs, stride_vch, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                                HALF: tl.constexpr, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                                HAS_BIAS: tl.constexpr, PAGE: tl.constexpr, PAD_SLOT: tl.constexpr,
                                PDL: tl.constexpr):
        # w: the fused [q; k; v] projection, heads of 2 * HALF rows. Pair p is column j = p % HALF of head
        # p // HALF: rows j and j + HALF, the two RoPE rotates together (tile row r: pair r // 2, half r % 2).
        # q and k heads are rotated, v heads not; k and v go to the token's cache slot, as the backend's
        # plain write would, and all of q, k, v to out (the qkv row after RoPE, as qk_norm_rope_ leaves it)
        r = tl.arange(0, 2 * BLOCK_P)
        pair = tl.program_id(0) * BLOCK_P + r // 2
        head = pair // HALF
        rows = (head * 2 * HALF + pair % HALF + (r % 2) * HALF).to(tl.int64)
        y = _rows_times_x(x_ptr, w_ptr, rows, pair < num_pairs, bias_ptr, stride_wn, K, BLOCK_K, HAS_BIAS, PDL)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)         # the projection's output, as stored unfused
        a, b = tl.split(tl.reshape(y, [BLOCK_P, 2]))               # halves j and j + HALF of each pair
        pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        heads, j = pairs // HALF, pairs % HALF
        mask = pairs < num_pairs
        angle = tl.load(pos_ptr).to(tl.float32) * tl.load(freq_ptr + j, mask=mask, other=0.0)
        r1, r2 = rotate_halves(a, b, angle)
        rotate = heads < NUM_Q + NUM_KV                          # q and k heads; v heads keep their values
        o1 = tl.where(rotate, r1, a).to(out_ptr.dtype.element_ty)
        o2 = tl.where(rotate, r2, b).to(out_ptr.dtype.element_ty)
        first = heads.to(tl.int64) * 2 * HALF + j
        tl.store(out_ptr + first, o1, mask=mask)
        tl.store(out_ptr + first + HALF, o2, mask=mask)
        slot = tl.load(slot_ptr).to(tl.int64)
        kv_head = (heads - NUM_Q).to(tl.int64)
        store_kv_halves(k_cache_ptr, slot, kv_head, NUM_KV, j, o1, o2, mask, stride_kcb, stride_kcs, stride_kch,
                        PAGE, HALF, PAD_SLOT)
        store_kv_halves(v_cache_ptr, slot, kv_head - NUM_KV, NUM_KV, j, o1, o2, mask, stride_vcb, stride_vcs,
                        stride_vch, PAGE, HALF, PAD_SLOT)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [1, K] (contiguous), weight: [N, K] with unit stride along K, bias [N] -> [1, N] in x's dtype.

    config: (BLOCK_N, BLOCK_K, num_warps, num_stages); None: config_for the weight's shape."""
    assert x.shape[0] == 1 and x.shape[1] == weight.shape[1] and weight.stride(1) == 1, (x.shape, weight.shape)
    n, k = weight.shape
    block_n, block_k, warps, stages = config or config_for(n, k)
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else x, out, n, weight.stride(0),
                                             K=k, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                                             num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One token on CUDA with Triton, a float weight with unit stride along K."""
    return (triton_applies(x) and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the Triton GEMV for a single token on CUDA (batch-1 decode)."""
    if not gemv_applies(x, weight):
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias)


def gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for one token in one launch: x [1, K], gate_up [2 I, K] (gate rows, then up
    rows; unit stride along K), bias [2 I] -> [1, I]. Equal to silu_mul(gemv(x, gate_up, bias)), without the
    second kernel or the [1, 2 I] intermediate. config: as gemv's, BLOCK_N counting weight rows (even)."""
    assert x.shape[0] == 1 and x.shape[1] == gate_up.shape[1] and gate_up.stride(1) == 1, (x.shape, gate_up.shape)
    rows, k = gate_up.shape
    assert rows % 2 == 0, gate_up.shape
    n = rows // 2
    block_rows, block_k, warps, stages = config or config_for(rows, k)
    block_n = max(block_rows // 2, 1)                          # output rows: a gate row and an up row each
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_silu_mul_kernel[(triton.cdiv(n, block_n),)](
        x, gate_up, bias if bias is not None else x, out, n, gate_up.stride(0), K=k, BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def gemv_rope_write_kv(x: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                       freqs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       num_q_heads: int, num_kv_heads: int, config: tuple[int, int, int, int] | None = None
                       ) -> torch.Tensor:
    """One token's fused q/k/v projection, RoPE of q and k, and the KV-cache write of k and v, in one launch.

    x [1, K]; qkv [(Hq + 2 Hkv) D, K] (q rows, then k, then v; unit stride along K), bias or None; positions [1];
    freqs [D / 2] fp32; caches [num_blocks, block_size, Hkv, D] (written as the backend's plain write does: cast
    to the cache dtype; a PADDING_SLOT_ID slot is skipped); slot_mapping [1]. -> [1, (Hq + 2 Hkv) D]: the
    projection after RoPE, equal to linear() then fused_ops.qk_norm_rope_write_kv_ without q/k norms.
    """
    from kvfit.kernels.attention_common import check_cache_pair    # (needs Triton, as this path does)
    rows, k = qkv.shape
    head_dim = k_cache.shape[3]
    assert x.shape == (1, k) and qkv.stride(1) == 1 and head_dim % 2 == 0, (x.shape, qkv.shape, k_cache.shape)
    assert rows == (num_q_heads + 2 * num_kv_heads) * head_dim and k_cache.shape[2] == num_kv_heads, (
        qkv.shape, k_cache.shape, num_q_heads, num_kv_heads)
    assert positions.numel() == 1 and slot_mapping.numel() == 1 and freqs.numel() == head_dim // 2
    check_cache_pair(k_cache, v_cache)
    block_rows, block_k, warps, stages = config or config_for(rows, k)
    block_p = max(block_rows // 2, 1)                          # pairs: two rows each
    x = x.contiguous()
    out = torch.empty((1, rows), dtype=x.dtype, device=x.device)
    num_pairs = rows // 2
    _gemv_rope_write_kernel[(triton.cdiv(num_pairs, block_p),)](
        x, qkv, bias if bias is not None else x, out, positions, freqs, k_cache, v_cache, slot_mapping,
        num_pairs, qkv.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_Q=num_q_heads, NUM_KV=num_kv_heads, HALF=head_dim // 2, K=k, BLOCK_P=block_p, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, PAGE=k_cache.shape[1], PAD_SLOT=PADDING_SLOT_ID, num_warps=warps,
        num_stages=stages, **pdl.launch_args(x))
    return out
