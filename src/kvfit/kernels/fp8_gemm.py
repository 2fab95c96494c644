"""The FP8 GEMM a quantized linear runs, chosen per call: on CUDA the Triton FP8 GEMV for one token (batch-1
decode, fp8_gemv.py), cuBLASLt's torch._scaled_mm (per-channel weights, rowwise scales) or, for the shapes and
batch sizes where a sweep on this device found it faster (fp8_channel_configs.py), the Triton GEMM with
per-channel scales (fp8_block_gemm.channel_fp8_gemm), and for block weights
cuBLASLt's blockwise-scaled _scaled_mm from BLOCK_SCALED_MM_MIN_ROWS rows of bf16 ([128, 128] weight blocks, 1 x
128 activation groups, K / 128 a multiple of 4; about 2x the Triton block GEMM at 8,192 rows on an H100,
2026-12-07) or the Triton block GEMM otherwise; the fp32 reference (fp8.py) elsewhere and for shapes cuBLASLt
refuses (K or N not a multiple of 16: correct, slower)."""

from __future__ import annotations

import torch

from kvfit.kernels.fp8 import (Fp8Weight, PreQuantized, activation_group, fp8_linear_reference, quantize_input,
                               split_prequantized)
from kvfit.kernels.fp8_block_gemm import block_fp8_linear, block_gemm_applies, channel_fp8_gemm
from kvfit.kernels.fp8_channel_configs import channel_config
from kvfit.kernels.fp8_gemv import fp8_gemv, fp8_gemv_applies
from kvfit.platforms.gate import on_gpu

BLOCK_SCALED_MM_MIN_ROWS = 1024     # below: the Triton block GEMM (its small-M configs; cuBLASLt unmeasured there)
_BLOCKWISE_SUPPORT: dict[int, bool] = {}    # device index -> whether this torch's _scaled_mm takes block scales


def scaled_mm_applies(x: torch.Tensor, w: Fp8Weight) -> bool:
    """cuBLASLt's FP8 GEMM takes this call: CUDA, per-channel scales, K and N multiples of 16."""
    return (on_gpu(x) and w.block_size is None and x.shape[1] % 16 == 0 and w.out_features % 16 == 0
            and hasattr(torch, "_scaled_mm"))


# fp8_linear's paths; the ones in QUANTIZING_PATHS quantize x dynamically before their GEMM
GEMV, SCALED_MM, CHANNEL_GEMM, BLOCK_SCALED_MM, BLOCK_GEMM, REFERENCE = (
    "gemv", "scaled_mm", "channel_gemm", "block_scaled_mm", "block_gemm", "ref")
QUANTIZING_PATHS = (SCALED_MM, CHANNEL_GEMM, BLOCK_SCALED_MM, BLOCK_GEMM)


def fp8_path(x: torch.Tensor, w: Fp8Weight) -> str:
    """The path fp8_linear runs for x [T, K] (the module docstring's order)."""
    if fp8_gemv_applies(x, w):
        return GEMV
    if scaled_mm_applies(x, w):
        tuned = block_gemm_applies(x) and channel_config(x.device, x.shape[0], w.out_features, x.shape[1])
        return CHANNEL_GEMM if tuned else SCALED_MM
    if block_scaled_mm_applies(x, w):
        return BLOCK_SCALED_MM
    if on_gpu(x) and w.block_size is not None and block_gemm_applies(x):
        return BLOCK_GEMM
    return REFERENCE


def fp8_linear(x: torch.Tensor | PreQuantized, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with W in FP8: x [..., K] -> [..., N] in x's dtype (see the module docstring's paths).
    A PreQuantized x ([T, K]) gives its quantization to the GEMMs that quantize x; the others read its x."""
    x, pre = split_prequantized(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                                  # [T, K]
    path = fp8_path(x2, w)
    if path == GEMV:
        y = fp8_gemv(x2, w, bias)
    elif path in (SCALED_MM, BLOCK_SCALED_MM):
        y = _cublas_linear(x2, w, bias, pre, blockwise=path == BLOCK_SCALED_MM)
    elif path == CHANNEL_GEMM:
        xq, x_scale = quantize_input(x2, w, pre)                                     # [T, K] fp8, [T, 1]
        config = channel_config(x2.device, x2.shape[0], w.out_features, x2.shape[1])
        y = channel_fp8_gemm(xq, x_scale, w, bias, x2.dtype, config)
    elif path == BLOCK_GEMM:
        y = block_fp8_linear(x2, w, bias, pre)
    else:
        y = fp8_linear_reference(x2, w, bias)
    return y.reshape(*lead, w.out_features)


def prequantize_group(x: torch.Tensor, w: Fp8Weight) -> int | None:
    """The columns per scale a kernel before fp8_linear(x, w) could quantize x in for it (PreQuantized): the
    dynamic group of the GEMM fp8_linear runs on x where that GEMM quantizes x; None where none does (one token:
    the GEMV reads x; the CPU's reference; a static input scale)."""
    if x.dim() != 2 or fp8_path(x, w) not in QUANTIZING_PATHS:
        return None
    return activation_group(w, x.shape[1])


def _cublas_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, pre: PreQuantized | None,
                   blockwise: bool) -> torch.Tensor:
    """torch._scaled_mm, bf16 out (the only out dtype cuBLASLt's rowwise and blockwise scaling take). Rowwise:
    scale_a [T, 1], scale_b [1, N]. Blockwise: scale_a [T, K/128] column-major (1 x 128 groups), scale_b
    [K/128, N/128] (the weight's [N/128, K/128] transposed: 128 x 128 blocks)."""
    xq, x_scale = quantize_input(x, w, pre)                                          # [T, K] fp8, [T, 1 or K/128]
    if blockwise:
        scale_a, scale_b = x_scale.t().contiguous().t(), w.scale.contiguous().t()
    else:
        scale_a, scale_b = x_scale.contiguous(), w.scale.view(1, -1)
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)  # [T, N]
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(x.dtype)


def block_scaled_mm_applies(x: torch.Tensor, w: Fp8Weight) -> bool:
    """cuBLASLt's blockwise-scaled FP8 GEMM takes this call: CUDA, a bf16 x (its only output dtype: no second
    rounding), [128, 128] weight blocks with dynamic activations, at least BLOCK_SCALED_MM_MIN_ROWS rows, K and N
    multiples of 128 with K / 128 a multiple of 4 (cuBLASLt reads the weight's scales with a K-block stride
    rounded up to 4, torch PR #166752, while _scaled_mm passes them unpadded: they agree only then), and a torch
    whose _scaled_mm gives the reference's numbers with block scales on this device (probed once)."""
    k, n = x.shape[1], w.out_features
    return (on_gpu(x) and x.dtype == torch.bfloat16 and w.block_size == (128, 128) and w.input_scale is None
            and x.shape[0] >= BLOCK_SCALED_MM_MIN_ROWS and k % 128 == 0 and n % 128 == 0 and (k // 128) % 4 == 0
            and tuple(w.scale.shape) == (n // 128, k // 128)
            and hasattr(torch, "_scaled_mm") and _blockwise_supported(x.device))


def _blockwise_supported(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BLOCKWISE_SUPPORT:
        if torch.cuda.is_current_stream_capturing():
            return False                # no probe inside a capture: the Triton GEMM for this call
        _BLOCKWISE_SUPPORT[index] = _blockwise_probe(device)
    return _BLOCKWISE_SUPPORT[index]


def _blockwise_probe(device: torch.device) -> bool:
    """Whether _scaled_mm with block scales, as _cublas_linear calls it, matches the dequantized product
    on a shape the gate admits (odd M, 2 N-blocks, 4 K-blocks, random values): a refusal or a wrong number is no."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 1025, 256, 512
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn).to(device)
    b = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn).to(device)
    sa = (torch.rand(m, k // 128, generator=g) + 0.5).to(device)
    sb = (torch.rand(n // 128, k // 128, generator=g) + 0.5).to(device)
    try:
        y = torch._scaled_mm(a, b.t(), scale_a=sa.t().contiguous().t(), scale_b=sb.t(), out_dtype=torch.bfloat16)
    except Exception:                   # noqa: BLE001 - any refusal means "not on this torch/GPU": the Triton GEMM
        return False
    ref = (a.float() * sa.repeat_interleave(128, 1)) @ (b.float() * sb.repeat_interleave(128, 0)
                                                         .repeat_interleave(128, 1)).t()
    return bool((y.float() - ref).abs().max() <= 1e-2 * ref.abs().max())
