"""y = x @ W^T for one row of x (batch-1 decode) in Triton, reading W once at full bandwidth.

At one token per step every linear layer is a matrix-vector product bound by reading its weight;
program n reads BLOCK_N whole rows of W (contiguous along K, so loads are wide and coalesced) and
reduces them against x in fp32. Offsets are int64 (row * stride), as everywhere in kvfit.
The MLP's fused gate/up weight has its own kernel (gemv_silu_mul): each program reads a gate row and the
matching up row and writes silu(gate) * up, so a decode step has no separate SiLU-and-multiply launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfit.attention import pdl

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
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
        tl.store(out_ptr + offs, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=offs < N)


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
    return (triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
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
