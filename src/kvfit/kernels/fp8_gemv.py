"""y = x @ (Wq * scale)^T for one row of x (batch-1 decode) with W in FP8: the weight read once, in 8 bits.

At one token a linear layer is bound by reading its weight, so FP8 halves the step's floor only if the GEMV
reads the FP8 bytes and nothing else: cuBLASLt's _scaled_mm at M = 1 (plus the activation's quantize kernel)
ran no faster than the bf16 GEMV (H100, 2026-12-06: 5.40 ms/token on llama-3.1-8b either way). Here program n
reads BLOCK_N whole rows of Wq (contiguous along K), widens them to fp32 and reduces them against x, as
gemv.py does for 16-bit weights. The activation stays in its 16-bit dtype (not quantized: one rounding fewer,
closer to the dequantized model than the W8A8 GEMM); the scale is applied in fp32: per row after the sum
(per-channel weights), or per [bn, bk] tile inside it (block weights: BLOCK_K divides bk, so a tile has one
scale per row). Offsets are int64, as everywhere in kvfit.
"""

from __future__ import annotations

import torch

from kvfit.kernels import pdl
from kvfit.kernels.fp8 import Fp8Weight
from kvfit.platforms.gate import triton_applies

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs
    triton = None

# (BLOCK_N, BLOCK_K, num_warps). benchmarks/bench_gemv.py --fp8 on the H100 (2026-12-06, llama-3.1-8b's shapes,
# per channel): (2, 2048, 4) was fastest for q/k/v, gate/up, down and lm_head (2.3-3.1 TB/s of FP8 weight read)
# and within 3% of (4, 1024, 4) on o_proj; the step's linears 2.80 ms against _scaled_mm's 4.91 ms.
CONFIG = (2, 2048, 4)


def config_for(k: int, block_k: int | None) -> tuple[int, int, int]:
    """The launch config for an FP8 weight of k columns (block_k: its scale tiles' width, or None per channel)."""
    bn, bk, warps = CONFIG
    bk = min(bk, triton.next_power_of_2(k))
    if block_k is not None:
        bk = min(bk, block_k & -block_k)          # the largest power of two dividing the scale tile's width
    return bn, bk, warps


if triton is not None:
    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, N, stride_wn, stride_sn,
                         K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr,
                         SCALE_BK: tl.constexpr, BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_mask = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_row = w_ptr + rows[:, None] * stride_wn
        s_row = s_ptr + (rows // SCALE_BN) * stride_sn             # block: the row's scale row; else its scale
        if PDL:
            gdc_wait()
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + cols) < K
            x = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_row + (k + cols)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(tl.float32)
            if BLOCKWISE:   # the tile lies inside one scale block along K: one scale per row
                w = w * tl.load(s_row + k // SCALE_BK, mask=row_mask, other=0.0)[:, None]
            acc += w * x[None, :]
        if PDL:
            gdc_launch_dependents()
        y = tl.sum(acc, 1)
        if not BLOCKWISE:
            y = y * tl.load(s_row, mask=row_mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def fp8_gemv_applies(x: torch.Tensor, w: Fp8Weight) -> bool:
    """One 16-bit (or fp32) token on CUDA with Triton; the weight with unit stride along K; no cap on the token's
    amax (fbgemm_fp8's input_scale_ub: the GEMV reads x unquantized, so a capped weight's token takes the
    quantizing GEMM, which caps it, as at every other batch size)."""
    return (triton_applies(x) and x.dim() == 2 and x.shape[0] == 1 and w.input_scale_ub is None
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.weight.stride(1) == 1)


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
             config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] -> [1, N] in x's dtype, y = x (Wq * scale)^T + bias. config: (BLOCK_N, BLOCK_K, num_warps); None:
    config_for the weight's shape. On the CPU it runs under Triton's interpreter (tests)."""
    n, k = w.weight.shape
    assert x.shape == (1, k), (x.shape, w.weight.shape)
    block = w.block_size
    block_n, block_k, warps = config or config_for(k, None if block is None else block[1])
    if block is not None:
        assert block[1] % block_k == 0, (block, block_k)
    scale = w.scale if block is not None else w.scale.reshape(-1)
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w.weight, scale, bias if bias is not None else x, out, n, w.weight.stride(0),
        scale.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE_BN=block[0] if block is not None else 1, SCALE_BK=block[1] if block is not None else 1,
        BLOCKWISE=block is not None, HAS_BIAS=bias is not None, num_warps=warps, **pdl.launch_args(x))
    return out
