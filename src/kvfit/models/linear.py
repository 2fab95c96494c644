"""Which linear layer a projection is, chosen once at construction: 16-bit or FP8, fused or not.

Column-parallel projections that read the same input (q/k/v, gate/up) are fused by output rows when they
are built: one parameter per tensor kind, one GEMM, each checkpoint tensor loaded into its rows (the
parameters' ParamParts; parallel.py). Where the parts cannot share one GEMM the layer is a SplitColumnLinear
instead, one GEMM per part with the outputs side by side (the same rows a fused layer gives):
- quantization_config's ignore list leaves some of the parts in 16 bits and quantizes the others;
- FP8 block scales: a part before the last does not end on a row block, so one scale block would hold two
  parts' rows.
FP8 static input scales are known only after loading: a fused Fp8Linear whose parts' input scales differ is
a ConfigError naming the layer (Fp8Linear.finalize), never a silent wrong load.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfit.models.parallel import MergedColumnLinear, OutputPart, RowLinear
from kvfit.models.quant.linear import Fp8Linear
from kvfit.quant_scheme import Fp8Scheme


class SplitColumnLinear(torch.nn.Module):
    """Column-parallel parts that cannot share one GEMM (see the module docstring): one linear each, their
    outputs concatenated by columns, as a fused layer's rows."""

    dense_weight = None                # no single 16-bit matrix for a fused one-token kernel to read

    def __init__(self, linears: Sequence[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, sum of the parts' rows here]
        return torch.cat([linear(x) for linear in self.parts], dim=1)


def _scales_join(parts: Sequence[OutputPart], scheme: Fp8Scheme) -> bool:
    """Whether the parts' FP8 weight scales can be one tensor: block scales only when every part but the last
    is whole row blocks on this rank."""
    if scheme.weight_strategy != "block":
        return True
    return all(part.size % scheme.block_size[0] == 0 for part in parts[:-1])


def make_column(in_features: int, parts: Sequence[OutputPart], bias: bool, dtype, device, scheme: Fp8Scheme | None,
                name: str, tp_size: int = 1) -> torch.nn.Module:
    """The column-parallel layer of `parts` (checkpoint linears reading the same input), named `name` (its module
    name, for errors): MergedColumnLinear when all are 16-bit, a fused Fp8Linear when all are FP8 with scales
    that join, else a SplitColumnLinear of one such layer per part. tp_size: the ranks it is split over (for errors)."""
    quantized = [scheme is not None and scheme.quantizes(part.name) for part in parts]
    if not any(quantized):
        return MergedColumnLinear(in_features, parts, bias, dtype, device)
    if all(quantized) and _scales_join(parts, scheme):
        return Fp8Linear(in_features, parts, bias, dtype, device, scheme, name, tp_size=tp_size)
    return SplitColumnLinear([make_column(in_features, [part], bias, dtype, device, scheme, part.name, tp_size)
                              for part in parts])


def make_row(in_features: int, out_features: int, bias: bool, dtype, device, scheme: Fp8Scheme | None, name: str,
             in_start: int = 0, in_size: int | None = None, tp_size: int = 1) -> torch.nn.Module:
    """The row-parallel layer `name` (its checkpoint name): input columns [in_start, in_start + in_size) here,
    summed over ranks; Fp8Linear where scheme quantizes it, else parallel.RowLinear."""
    if scheme is not None and scheme.quantizes(name):
        return Fp8Linear(in_features, [OutputPart(name, out_features, 0, out_features)], bias, dtype, device, scheme,
                         name, in_start, in_size, row=True, tp_size=tp_size)
    return RowLinear(in_features, out_features, bias, dtype, device, in_start, in_size, tp_size)
