"""Decoder building blocks in plain torch: RMSNorm, SwiGLU MLP, cacheless causal attention.

The (vocab-parallel) embedding lives in parallel.py with the other sharded layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfit.kernels import fused_ops
from kvfit.kernels.gemv import gemv_applies, gemv_silu_mul
from kvfit.models.parallel import make_param, split_evenly
from kvfit.models.quant.linear import fuse_projection, make_linear, project


class RMSNorm(torch.nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), None, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); one fused kernel on CUDA."""
        if fused_ops.available(x) and x.dim() == 2:
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x if residual is None else x + residual
        return self.forward(total), total


class SwiGLU(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up split by intermediate channel, down by input column.

    scheme: FP8 weights (models/quant) for the projections it quantizes; prefix: the MLP's checkpoint name
    (model.layers.N.mlp), which the scheme's ignore list is matched against."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype, device,
                 tp_rank: int = 0, tp_size: int = 1, scheme=None, prefix: str = "mlp"):
        super().__init__()
        start, size = split_evenly(intermediate_size, tp_rank, tp_size, "MLP channels (intermediate_size)")
        col = (hidden_size, intermediate_size, bias, dtype, device, scheme)
        self.gate_proj = make_linear(*col, f"{prefix}.gate_proj", start, size)
        self.up_proj = make_linear(*col, f"{prefix}.up_proj", start, size)
        self.down_proj = make_linear(intermediate_size, hidden_size, bias, dtype, device, scheme, f"{prefix}.down_proj",
                                     start, size, row=True, tp_size=tp_size)
        self.gate_up_weight = self.gate_up_bias = None     # set by fuse_projections() after loading

    def fuse_projections(self) -> None:
        self.gate_up_weight, self.gate_up_bias = fuse_projection([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if isinstance(self.gate_up_weight, torch.Tensor) and gemv_applies(x, self.gate_up_weight):
            # one token: gate/up, SiLU and product in one kernel
            return self.down_proj(gemv_silu_mul(x, self.gate_up_weight, self.gate_up_bias))
        gate_up = project(x, self.gate_up_weight, self.gate_up_bias)              # [T, 2 I]
        if fused_ops.available(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=1)
        return self.down_proj(F.silu(gate) * up)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: list[int],
                     scale: float) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens of this step, with no KV cache.

    q: [T, Hq, D], k/v: [T, Hkv, D]; sequence i is rows query_start_loc[i]:query_start_loc[i+1].
    Used when the model runs without a cache (a profile run): every sequence is a fresh prefill.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)                                    # [Hq, L, D]
        ks = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1)    # [Hq, L, D]
        vs = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
