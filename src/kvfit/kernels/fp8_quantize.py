"""Dynamic FP8 activation quantization in one Triton launch (CUDA): what fp8.quantize_activations computes
with seven torch kernels, per token or per token and column group.

Per row (or row and group): amax over |x| in fp32, scale = max(amax, MIN_AMAX) / 448, q = x / scale
(IEEE division, as torch's), clamped to +-448, rounded to float8_e4m3fn (round to nearest even, as torch's
cast). The same numbers as the torch path, so the CPU reference and the GPU agree on every quantized value.
"""

from __future__ import annotations

import torch

from kvfit.platforms.gate import triton_applies
from kvfit.quant_scheme import FP8_MAX, MIN_AMAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
MAX_ROW_BLOCK = 4096        # columns a program holds at once; wider rows take two passes over the row


def quantize_kernel_applies(x: torch.Tensor) -> bool:
    """Triton is installed and x is a 2-D CUDA tensor with unit stride along its rows."""
    return triton_applies(x) and x.dim() == 2 and x.stride(1) == 1


if triton is not None:
    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, stride_s, K: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
                         MIN_AMAX_C: tl.constexpr):
        # program (row, group): columns [group * GROUP, (group + 1) * GROUP) of one row (GROUP = K: per token)
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
        start = group * GROUP
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x + start
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, GROUP, BLOCK):
            mask = (k + cols < GROUP) & (start + k + cols < K)
            x = tl.load(x_row + k + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(amax, 0), MIN_AMAX_C), FP8_MAX_C)
        for k in range(0, GROUP, BLOCK):
            mask = (k + cols < GROUP) & (start + k + cols < K)
            x = tl.load(x_row + k + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
            tl.store(q_ptr + row * stride_q + start + k + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row * stride_s + group, scale)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] fp8, scale fp32 [T, 1] per token, or [T, ceil(K / group)] per group)."""
    num_rows, k = x.shape
    group = k if group is None else group
    num_groups = -(-k // group)
    xq = torch.empty((num_rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return xq, scale
    block = min(triton.next_power_of_2(group), MAX_ROW_BLOCK)
    _quantize_kernel[(num_rows, num_groups)](x, xq, scale, x.stride(0), xq.stride(0), scale.stride(0), K=k,
                                             GROUP=group, BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
                                             num_warps=4 if block <= 1024 else 8)
    return xq, scale
