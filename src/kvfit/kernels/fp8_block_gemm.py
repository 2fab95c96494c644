"""Block-wise FP8 GEMM in Triton: y = (xq * x_scale) @ (Wq * w_scale)^T with [bn, bk] weight-scale tiles.

The layout of the `fp8` method's checkpoints (weight_block_size [128, 128], `weight_scale_inv`; DeepSeek-V3,
Qwen3-*-FP8) and compressed-tensors' block strategy. Activations come quantized per token and bk-column
group (fp8.quantize_groups), so every K step of BLOCK_K = bk columns has one activation scale per row and
one weight scale per output column: acc += dot(xq, Wq^T) * x_scale[:, None] * w_scale[None, :], in fp32.
The fp8 x fp8 dot runs on Hopper's tensor cores. Offsets are int64 (indices cast before they meet a stride).
"""

from __future__ import annotations

import torch

from kvfit.kernels.fp8 import Fp8Weight, PreQuantized, quantize_input
from kvfit.platforms.gate import on_gpu, triton_applies

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# (BLOCK_M, BLOCK_N, num_warps, num_stages[, SPLIT_K]); BLOCK_K is the block's columns (one scale per K step). The
# wide tile takes 8 warps: with 4, its fp32 accumulator and the K step's partial product spill (ptxas, sm_90).
# K is a compile-time constant (one compile per layer width): with a runtime K,
# Triton 3.6 does not software-pipeline the loads (tests/kernels/test_fp8_gemm.py checks that it does).
# Picked from bench_fp8_block_gemm.py's sweep (H100, 2026-12-07, qwen3-30b-a3b's qkv N=5120 K=2048 and o_proj
# N=2048 K=4096, benchmarks/results/2026-12-07-h100-fp8-block-gemm-sweep.log): below 1,024 rows the best tiles
# were 64 columns wide, 16 rows up to 16 rows and 64 above; split-K 4 won where the output tiles were fewer than
# 64 (o_proj up to 64 rows: 10.6-12.6 us against 20.0-20.6 for the earlier (16, 128) / (64, 128) picks).
SMALL_M_CONFIG, MID_M_CONFIG, LARGE_M_CONFIG = (16, 64, 4, 4), (64, 64, 4, 4), (64, 128, 8, 3)
LARGE_M = 1024
FEW_TILES, SPLIT_K = 64, 4


def block_gemm_applies(x: torch.Tensor) -> bool:
    """Triton is installed and x is a CUDA tensor."""
    return triton_applies(x)


def config_for(m: int, n: int, k_steps: int) -> tuple[int, ...]:
    """The launch config for M rows of an [N, K] weight with k_steps blocks along K (see the sweep above)."""
    if m >= LARGE_M:
        return LARGE_M_CONFIG
    base = SMALL_M_CONFIG if m <= 16 else MID_M_CONFIG
    tiles = -(-m // base[0]) * -(-n // base[1])
    if tiles < FEW_TILES and k_steps % SPLIT_K == 0 and k_steps >= 2 * SPLIT_K:
        return (*base, SPLIT_K)
    return base


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _block_fp8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr, M, N, K: tl.constexpr,
                               stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk,
                               stride_bsn, stride_bsk, stride_cs, stride_cm, stride_cn,
                               GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                               DOT_FP32: tl.constexpr, PER_CHANNEL: tl.constexpr):
        # c[m, n] = sum_kb a_scale[m, kb] * b_scale[n // GROUP_N, kb] * (a[m, kb] . b[n, kb]); with SPLIT_K > 1
        # program pid_k sums its share of the K steps into the fp32 partial c[pid_k] (block_fp8_gemm adds them).
        # PER_CHANNEL: one scale per row and per output column for all of K (a_scale [M, 1], b_scale [N, 1]),
        # applied once to the sum: c[m, n] = a_scale[m] * b_scale[n] * (a[m, :] . b[n, :])
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        pid_k = tl.program_id(2).to(tl.int64)
        STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K // SPLIT_K         # K steps per program (they divide)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        m_mask, n_mask = offs_m < M, offs_n < N
        first = pid_k * STEPS                                                                # this program's
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + (first * BLOCK_K + offs_k[None, :]) * stride_ak  # [BM, BK]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + (first * BLOCK_K + offs_k[:, None]) * stride_bk  # [BK, BN]
        a_scale_ptrs = a_scale_ptr + offs_m * stride_asm                                     # [BM]
        b_scale_ptrs = b_scale_ptr + (offs_n // GROUP_N) * stride_bsn                        # [BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for step in range(0, STEPS):
            kb = first + step
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k < k_left)[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k < k_left)[:, None] & n_mask[None, :], other=0.0)
            if DOT_FP32:    # the interpreter has no fp8 dot: the same products, exact in fp32
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b)
            if PER_CHANNEL:
                acc += part
            else:
                a_s = tl.load(a_scale_ptrs + kb * stride_ask, mask=m_mask, other=0.0)
                b_s = tl.load(b_scale_ptrs + kb * stride_bsk, mask=n_mask, other=0.0)
                acc += part * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if PER_CHANNEL:
            a_s = tl.load(a_scale_ptrs, mask=m_mask, other=0.0)
            b_s = tl.load(b_scale_ptrs, mask=n_mask, other=0.0)
            acc = acc * a_s[:, None] * b_s[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """xq [M, K] fp8 with x_scale [M, ceil(K/bk)] fp32, w a block Fp8Weight [N, K] -> [M, N] in out_dtype.

    config: (BLOCK_M, BLOCK_N, num_warps, num_stages[, SPLIT_K]); None: config_for(M, N, K steps). SPLIT_K > 1
    (it must divide the K steps, ceil(K / bk)) splits the K steps over that many programs per output tile, for few rows, where
    the tiles alone leave most SMs idle: each writes an fp32 partial [SPLIT_K, M, N], summed here in fixed order
    (the same result on every run), then the bias and the cast."""
    assert w.block_size is not None and xq.shape[1] == w.weight.shape[1], (xq.shape, w.weight.shape)
    bn, bk = w.block_size
    m, k = xq.shape
    block_m, block_n, warps, stages, *rest = config or config_for(m, w.out_features, -(-k // bk))
    return _launch(xq, x_scale, x_scale.stride(1), w.scale, w.scale.stride(1), w, bias, out_dtype,
                   (block_m, block_n, warps, stages, rest[0] if rest else 1, bk), group_n=bn, per_channel=False)


def _launch(xq: torch.Tensor, x_scale: torch.Tensor, x_scale_k_stride: int, w_scale: torch.Tensor,
            w_scale_k_stride: int, w: Fp8Weight, bias: torch.Tensor | None, out_dtype: torch.dtype,
            config: tuple[int, ...], group_n: int, per_channel: bool) -> torch.Tensor:
    """The kernel's launch for both scale layouts: config (BLOCK_M, BLOCK_N, warps, stages, SPLIT_K, BLOCK_K);
    SPLIT_K must divide the K steps, ceil(K / BLOCK_K)."""
    block_m, block_n, warps, stages, split, block_k = config
    m, k = xq.shape
    n = w.out_features
    steps = -(-k // block_k)
    if split < 1 or steps % split:
        raise ValueError(f"SPLIT_K {split} does not divide the {steps} K steps of K={k} (BLOCK_K {block_k})")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
    fused_bias = bias is not None and split == 1
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _block_fp8_gemm_kernel[grid](
        xq, x_scale, w.weight, w_scale, target, bias if fused_bias else target, m, n, k,
        xq.stride(0), xq.stride(1), x_scale.stride(0), x_scale_k_stride, w.weight.stride(0), w.weight.stride(1),
        w_scale.stride(0), w_scale_k_stride, target.stride(0) if split > 1 else 0, target.stride(-2),
        target.stride(-1), GROUP_N=group_n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        HAS_BIAS=fused_bias, DOT_FP32=not on_gpu(xq), PER_CHANNEL=per_channel, num_warps=warps, num_stages=stages)
    return _finish(out, target, bias, split)


def _finish(out: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, split: int) -> torch.Tensor:
    """out as the kernel left it (split 1), or the sum of its SPLIT_K fp32 partials in fixed order, plus the bias."""
    if split > 1:
        total = target.sum(dim=0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out


def channel_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                     out_dtype: torch.dtype, config: tuple[int, ...]) -> torch.Tensor:
    """xq [M, K] fp8 with x_scale [M, 1] fp32 (per token, or a static scale expanded), w a per-channel Fp8Weight
    (scale [N, 1]) -> [M, N] in out_dtype: the block kernel with one scale per row and column, applied once.

    config: (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_K, BLOCK_K), a tuned entry of fp8_channel_configs
    (cuBLASLt's _scaled_mm is the default: this runs only where a sweep on the device found it faster). SPLIT_K
    must divide ceil(K / BLOCK_K)."""
    assert w.block_size is None and xq.shape[1] == w.weight.shape[1], (xq.shape, w.weight.shape)
    n = w.out_features
    w_scale = w.scale.reshape(-1, 1).expand(n, 1) if w.scale.numel() == 1 else w.scale.reshape(n, 1)
    return _launch(xq, x_scale, 0, w_scale, 0, w, bias, out_dtype, tuple(config), group_n=1, per_channel=True)


def block_fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                     pre: PreQuantized | None = None) -> torch.Tensor:
    """x [T, K] (16-bit or fp32) -> [T, N] in x's dtype: per-token-group quantization (pre's, when it is x's
    for w), then the block GEMM."""
    xq, x_scale = quantize_input(x, w, pre)                                    # per token and bk columns
    return block_fp8_gemm(xq.contiguous(), x_scale, w, bias, x.dtype)
