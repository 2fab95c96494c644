"""Fuse projections that read the same input (q/k/v, gate/up) into one matmul after loading.

The fused weight is one tensor; each original parameter is re-pointed at its rows of it, so the
memory is not doubled and the parameter names (and parameters()) stay the checkpoint's.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def fuse_rows(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) by output rows; return (weight, bias)."""
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)          # [sum(out), in]
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears], dim=0) if has_bias else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[row:row + n]
        if has_bias:
            lin.bias.data = bias[row:row + n]
        row += n
    return weight, bias
