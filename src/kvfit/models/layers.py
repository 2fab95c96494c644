"""Decoder building blocks in plain torch, each choosing its kernels: RMSNorm, the SwiGLU MLP.

The (vocab-parallel) embedding and the linears live in parallel.py and linear.py; RoPE in rope.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfit.kernels import fused_ops
from kvfit.kernels.fp8 import PreQuantized
from kvfit.kernels.gemv import gemv_applies, gemv_silu_mul
from kvfit.models.linear import make_column, make_row
from kvfit.models.parallel import OutputPart, make_param, split_evenly
from kvfit.models.rope import rms_norm


class RMSNorm(torch.nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), None, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None, reader: torch.nn.Module | None = None
                    ) -> tuple[torch.Tensor | PreQuantized, torch.Tensor]:
        """(norm(x + residual), x + residual); one fused kernel on CUDA. reader: the linear the output goes to;
        where its FP8 GEMM would quantize the output (its prequantize_group), the same kernel quantizes it and
        the output is a PreQuantized for that linear."""
        if fused_ops.available(x) and x.dim() == 2:
            group = prequantize_group(reader, x)
            if group is not None and fused_ops.norm_quant_applies(x.shape[1], group):
                out, total, xq, scale = fused_ops.add_rms_norm_quant(x, residual, self.weight, self.eps, group)
                return PreQuantized(out, xq, scale, group), total
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x if residual is None else x + residual
        return self.forward(total), total


class SwiGLU(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused at construction (gate_up_proj: gate rows, then up rows,
    each split by intermediate channel), down split by input column.

    scheme: FP8 weights (models/quant) for the projections it quantizes; prefix: the MLP's checkpoint name
    (model.layers.N.mlp), which the scheme's ignore list is matched against."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype, device,
                 tp_rank: int = 0, tp_size: int = 1, scheme=None, prefix: str = "mlp"):
        super().__init__()
        start, size = split_evenly(intermediate_size, tp_rank, tp_size, "MLP channels (intermediate_size)")
        parts = [OutputPart(f"{prefix}.{name}", intermediate_size, start, size) for name in ("gate_proj", "up_proj")]
        self.gate_up_proj = make_column(hidden_size, parts, bias, dtype, device, scheme, f"{prefix}.gate_up_proj",
                                        tp_size)
        self.down_proj = make_row(intermediate_size, hidden_size, bias, dtype, device, scheme, f"{prefix}.down_proj",
                                  start, size, tp_size)

    def forward(self, x: torch.Tensor | PreQuantized) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden] (PreQuantized: for an FP8 gate_up_proj); an FP8 down_proj gets its input
        # quantized by the SiLU kernel
        return self.down_proj(silu_gate_up(self.gate_up_proj, x, self.down_proj))

    @property
    def input_projection(self) -> torch.nn.Module:
        """The linear that reads the MLP's input (RMSNorm.add_forward's reader)."""
        return self.gate_up_proj


def silu_gate_up(projection: torch.nn.Module, x: torch.Tensor | PreQuantized,
                 reader: torch.nn.Module | None = None) -> torch.Tensor | PreQuantized:
    """silu(gate) * up of a fused gate/up projection (gate rows, then up) of x [T, K] -> [T, I]: projection,
    SiLU and product in one GEMV launch for one token with a 16-bit weight on CUDA, else its GEMM, then silu_mul
    (reader: the linear its output goes to, as silu_mul's)."""
    weight = projection.dense_weight
    if weight is not None and not isinstance(x, PreQuantized) and gemv_applies(x, weight):
        return gemv_silu_mul(x, weight, projection.bias)
    return silu_mul(projection(x), reader)


def silu_mul(gate_up: torch.Tensor, reader: torch.nn.Module | None = None) -> torch.Tensor | PreQuantized:
    """[T, 2 I] (gate, then up) -> silu(gate) * up [T, I]: one Triton launch on CUDA, torch elsewhere. reader:
    the linear the output goes to; where its FP8 GEMM would quantize the output (its prequantize_group), the
    same launch quantizes it and the output is a PreQuantized for that linear."""
    if fused_ops.available(gate_up):
        cols = gate_up.shape[1] // 2
        group = prequantize_group(reader, gate_up[:, :cols])
        if group is not None and fused_ops.silu_quant_applies(cols, group):
            out, xq, scale = fused_ops.silu_mul_quant(gate_up, group)
            return PreQuantized(out, xq, scale, group)
        return fused_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=1)
    return F.silu(gate) * up


def prequantize_group(reader: torch.nn.Module | None, x: torch.Tensor) -> int | None:
    """The group in which the kernel making x [T, K] could quantize it for `reader` (an FP8 linear or FP8 experts:
    their prequantize_group); None for any other reader (16-bit layers) or none."""
    return reader.prequantize_group(x) if hasattr(reader, "prequantize_group") else None
