"""FP8 (float8_e4m3fn) weights and the GEMMs that read them: quantization, a torch reference, the CUDA paths.

A quantized weight stays in FP8 in memory (one byte a parameter) with fp32 scales, W ~= Wq * scale:
- per channel: scale [N, 1], one per output row (per-tensor checkpoints are widened to this at load:
  same values, one GEMM path);
- per block: scale [ceil(N / bn), ceil(K / bk)], one per [bn, bk] tile.
Activations are quantized the same way on every device, so the CPU reference and the GPU agree up to
the order of fp32 sums: dynamically per token (scale [T, 1] = amax / 448), per token and bk-column group
for block weights (scale [T, ceil(K / bk)]), or with the checkpoint's static per-tensor input_scale.
y = (xq * x_scale) @ (Wq * w_scale)^T (+ bias) in fp32, rounded once to the activation dtype.

Paths (fp8_gemm.py): `fp8_linear` runs torch._scaled_mm (cuBLASLt, rowwise scales, bf16 out) for per-channel weights
on CUDA where its shape rules hold (K and N multiples of 16), for block weights on CUDA _scaled_mm with block
scales from 1,024 rows where its rules hold and the Triton block GEMM (fp8_block_gemm.py) otherwise, and
`fp8_linear_reference` (dequantize in fp32, matmul) everywhere else: the CPU path and the GPU paths' test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfit.kernels.fp8_quantize import FP8_DTYPE, quantize_kernel_applies, quantize_rows
from kvfit.quant_scheme import FP8_MAX, MIN_AMAX


@dataclass
class Fp8Weight:
    """One quantized linear weight (or several fused by output rows): what its GEMM reads."""

    weight: torch.Tensor                     # [N, K] float8_e4m3fn
    scale: torch.Tensor                      # fp32 [N, 1] (per channel) or [ceil(N/bn), ceil(K/bk)] (block)
    block_size: tuple[int, int] | None       # (bn, bk), or None for per channel
    input_scale: torch.Tensor | None = None  # fp32 [1]: static activations; None: dynamic
    input_scale_ub: float | None = None      # dynamic per token: each token's amax capped at it (fbgemm_fp8)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantize(self) -> torch.Tensor:
        """W in fp32 [N, K] (the reference's weight; tests build the transformers model from it)."""
        return dequantize_weight(self.weight, self.scale, self.block_size)


@dataclass(frozen=True)
class PreQuantized:
    """An FP8 linear's input with its dynamic quantization made by the kernel that made it (the RMSNorm or the
    SiLU-and-mul before it: fused_ops.add_rms_norm_quant, silu_mul_quant): x and what quantize_activations(x, w)
    returns for a weight whose activation group (activation_group) is `group`. The GEMMs that quantize x take
    (xq, scale); the others read x."""

    x: torch.Tensor          # [T, K] 16-bit
    xq: torch.Tensor         # [T, K] float8_e4m3fn
    scale: torch.Tensor      # fp32 [T, K / group]
    group: int               # columns a scale: K per token, the block width for block weights

    def quantized_for(self, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
        """(xq, scale) if they are w's dynamic quantization of x, else quantize_activations(x, w)."""
        if activation_group(w, self.x.shape[1]) == self.group:
            return self.xq, self.scale
        return quantize_activations(self.x, w)


def split_prequantized(x: torch.Tensor | PreQuantized) -> tuple[torch.Tensor, PreQuantized | None]:
    """(the 16-bit x, the PreQuantized it came in, or None): for code that reads x and hands the pair on."""
    return (x.x, x) if isinstance(x, PreQuantized) else (x, None)


def quantize_input(x: torch.Tensor, w: Fp8Weight, pre: PreQuantized | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """w's quantization of its input x: pre's pair where it is that (PreQuantized.quantized_for), else made now."""
    return pre.quantized_for(w) if pre is not None else quantize_activations(x, w)


def activation_group(w: Fp8Weight, k: int) -> int | None:
    """Columns per dynamic activation scale of w's GEMM on inputs of k columns (the block width, k per token);
    None for a static input scale or a capped amax (no dynamic quantization to fuse)."""
    if w.input_scale is not None or w.input_scale_ub is not None:     # (the fused kernels cap no amax)
        return None
    return k if w.block_size is None else w.block_size[1]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None
                      ) -> torch.Tensor:
    """Wq [N, K] fp8 with a per-channel [N, 1] (or per-tensor [1]) or block scale -> fp32 [N, K]."""
    w = weight.float()
    if block_size is None:
        return w * scale.float().reshape(-1, 1) if scale.numel() > 1 else w * scale.float().reshape(())
    return w * _expand_blocks(scale.float(), block_size, *w.shape)                      # [N, K]


def _expand_blocks(scale: torch.Tensor, block_size: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """A block scale [ceil(N/bn), ceil(K/bk)] repeated over its tiles: one value per weight, [N, K]."""
    bn, bk = block_size
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (Wq [N, K] fp8, scale [N, 1] fp32), scale = row amax / 448."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return _to_fp8(w / scale), scale


def quantize_weight_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (Wq fp8, scale [ceil(N/bn), ceil(K/bk)] fp32): the block layout's weight_scale_inv."""
    bn, bk = block_size
    n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros((rows * bn, cols * bk), dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(rows, bn, cols, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX            # [rows, cols]
    return _to_fp8(weight.float() / _expand_blocks(scale, block_size, n, k)), scale


def quantize_weight_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (Wq fp8, scale [1] fp32): one scale for the whole tensor."""
    w = weight.float()
    scale = w.abs().amax().clamp(min=MIN_AMAX).reshape(1) / FP8_MAX
    return _to_fp8(w / scale), scale


def quantize_activations(x: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] fp8, x_scale fp32: [T, 1] per token or static, [T, ceil(K/bk)] per group).

    Scratch beyond x: on CUDA (dynamic) the fp8 result only; else one fp32 copy of x (divided and clamped
    in place) and the fp8 result (quant_scheme's *ACTIVATION_SCRATCH_BYTES, counted by the estimate)."""
    if w.input_scale is not None:
        scale = w.input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
        return _to_fp8_(x.to(torch.float32, copy=True).div_(scale)), scale
    if quantize_kernel_applies(x):        # CUDA: one launch, the same numbers
        return quantize_rows(x, None if w.block_size is None else w.block_size[1], w.input_scale_ub)
    if w.block_size is None:
        x32 = x.to(torch.float32, copy=True)
        scale = _amax(x32, dim=1).clamp(min=MIN_AMAX, max=w.input_scale_ub).unsqueeze(1) / FP8_MAX      # [T, 1]
        return _to_fp8_(x32.div_(scale)), scale
    return quantize_groups(x, w.block_size[1])


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] fp8, scale [T, ceil(K / group)] fp32): per token and group of columns."""
    t, k = x.shape
    groups = -(-k // group)
    x32 = x.to(torch.float32, copy=True)
    if groups * group != k:                 # a last partial group: zero columns quantize to zero
        x32 = torch.nn.functional.pad(x32, (0, groups * group - k))
    tiles = x32.view(t, groups, group)
    scale = _amax(tiles, dim=2).clamp(min=MIN_AMAX) / FP8_MAX                               # [T, G]
    xq = _to_fp8_(tiles.div_(scale.unsqueeze(2))).view(t, groups * group)[:, :k]
    return xq, scale


def _amax(x32: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along dim without an |x| temporary as large as x."""
    return torch.maximum(x32.amax(dim=dim), x32.amin(dim=dim).neg())


def _to_fp8_(x32: torch.Tensor) -> torch.Tensor:
    return x32.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _to_fp8(x32: torch.Tensor) -> torch.Tensor:
    return x32.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_activations(xq: torch.Tensor, scale: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The fp32 values the GEMM multiplies: xq * its per-token (or per-group) scale."""
    if scale.shape[1] == 1:
        return xq.float() * scale
    bk = w.block_size[1]
    return xq.float() * scale.repeat_interleave(bk, 1)[:, :xq.shape[1]]


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b as the FP8 GEMMs compute it: x quantized (quantize_activations), both sides
    dequantized to fp32, one fp32 matmul, rounded once to x's dtype. x [T, K] -> [T, N]."""
    xq, x_scale = quantize_activations(x, w)
    y = dequantize_activations(xq, x_scale, w) @ w.dequantize().t()                 # [T, N] fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
