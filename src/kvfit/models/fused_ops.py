"""Fused Triton kernels for the decoder's small ops on CUDA: residual add + RMSNorm, RoPE, SiLU x mul.

At decode batch sizes each torch op is a separate tiny kernel (RMSNorm alone is five); these cut a
layer to a handful of launches. Every row/token index is cast to int64 before it meets a stride.
On CPU (and wherever Triton is missing) the callers keep their plain-torch path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(t: torch.Tensor) -> bool:
    """Use the fused kernels for this tensor (CUDA with Triton)."""
    return triton is not None and t.is_cuda


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                             stride_res_out, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            # the sum is rounded to the model dtype, as `x + residual` in torch would be
            x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * stride_out + cols, normed * w, mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, pos_ptr, freq_ptr, stride_tok, stride_head, num_heads,
                     HALF: tl.constexpr, BLOCK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, BLOCK)
        mask = i < HALF
        pos = tl.load(pos_ptr + tok).to(tl.float32)
        angle = pos * tl.load(freq_ptr + i, mask=mask, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        base = x_ptr + tok * stride_tok + head * stride_head
        x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + i, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF + i, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n_cols
        g = tl.load(gu_ptr + row * stride_gu + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + col, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty),
                 mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); x, residual: [T, hidden]."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
        (residual if residual is not None else x).stride(0), out.stride(0), res_out.stride(0), cols, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return out, res_out


def rope_(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (last dim contiguous) in place by positions [T]; freqs [D // 2] float32."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and dim % 2 == 0
    if tokens:
        _rope_kernel[(tokens, heads)](x, positions, freqs, x.stride(0), x.stride(1), heads,
                                      HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2), num_warps=1)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate then up) -> silu(gate) * up: [T, I]."""
    rows, double = gate_up.shape
    cols = double // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                          BLOCK=block, num_warps=4)
    return out
