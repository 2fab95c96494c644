"""Dynamic FP8 activation quantization in one Triton launch (CUDA): what fp8.quantize_activations computes
with seven torch kernels, per token or per token and column group.

Groups of up to MAX_TILE_GROUP columns (per token for hidden sizes up to it; the block layout's 128-column
groups) go through the tiled kernel: a program holds a tile of rows x whole groups in registers and reads x
once (2.4-4.4x the two-pass kernel at 128-column groups, H100). Wider groups (a per-token row of llama's 14,336
MLP channels, which the SiLU kernel quantizes itself where it can) take the two-pass kernel, which walks the row
in MAX_ROW_BLOCK pieces and reads it twice.

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
MAX_ROW_BLOCK = 4096        # two-pass kernel: columns a program holds at once
# tiled kernel: the widest group (after rounding up to a power of two) it takes. At 14,336 columns per token (a
# 16,384-wide tile) it ran 0.83x the two-pass kernel at 8,192 rows (1.01x at 1,024, 1.31x at 64; H100, 2026-12-07,
# bench_fp8_quantize.py), so rows that wide keep the two-pass kernel
MAX_TILE_GROUP = 8192
TILE_ELEMENTS = 4096        # tiled kernel: values a program holds (rows x groups x group, powers of two)


def quantize_kernel_applies(x: torch.Tensor) -> bool:
    """Triton is installed and x is a 2-D CUDA tensor with unit stride along its rows."""
    return triton_applies(x) and x.dim() == 2 and x.stride(1) == 1


if triton is not None:
    @triton.jit
    def fp8_scale(amax, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
        """A group's scale from its amax: max(amax, MIN_AMAX) / 448, IEEE division (every quantize kernel's)."""
        return tl.div_rn(tl.maximum(amax, MIN_AMAX_C), FP8_MAX_C)

    @triton.jit
    def capped(amax, UB: tl.constexpr):
        """amax, at most UB (fbgemm_fp8's activation_scale_ub; 0: no cap)."""
        if UB > 0:
            amax = tl.minimum(amax, UB)
        return amax

    @triton.jit
    def fp8_values(x, scale, FP8_MAX_C: tl.constexpr):
        """x / scale (IEEE division) clamped to +-448, in fp32; the caller's store casts it to float8_e4m3fn."""
        return tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, stride_s, K: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
                         MIN_AMAX_C: tl.constexpr, UB: tl.constexpr = 0.0):
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
        scale = fp8_scale(capped(tl.max(amax, 0), UB), FP8_MAX_C, MIN_AMAX_C)
        for k in range(0, GROUP, BLOCK):
            mask = (k + cols < GROUP) & (start + k + cols < K)
            x = tl.load(x_row + k + cols, mask=mask, other=0.0).to(tl.float32)
            q = fp8_values(x, scale, FP8_MAX_C)
            tl.store(q_ptr + row * stride_q + start + k + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row * stride_s + group, scale)


    @triton.jit
    def _quantize_tile_kernel(x_ptr, q_ptr, scale_ptr, num_rows, stride_x, stride_q, stride_s, K, NUM_GROUPS,
                              GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUPS: tl.constexpr,
                              ROWS: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr,
                              UB: tl.constexpr = 0.0):
        # program (row tile, group tile): rows [ROWS] x groups [GROUPS] x columns [GROUP_P2] of a group, read once
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        inner = tl.arange(0, GROUP_P2)
        cols = groups[:, None] * GROUP + inner[None, :]                                  # [GROUPS, GROUP_P2]
        col_ok = (inner[None, :] < GROUP) & (groups[:, None] < NUM_GROUPS) & (cols < K)
        mask = (rows < num_rows)[:, None, None] & col_ok[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None] * stride_x + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
        scale = fp8_scale(capped(tl.max(tl.abs(x), 2), UB), FP8_MAX_C, MIN_AMAX_C)     # [ROWS, GROUPS]
        q = fp8_values(x, scale[:, :, None], FP8_MAX_C)
        tl.store(q_ptr + rows[:, None, None] * stride_q + cols[None, :, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        s_mask = (rows < num_rows)[:, None] & (groups < NUM_GROUPS)[None, :]
        tl.store(scale_ptr + rows[:, None] * stride_s + groups[None, :], scale, mask=s_mask)


def tile_shape(group: int, num_groups: int) -> tuple[int, int, int]:
    """The tiled kernel's (group width rounded up to a power of two, groups a program, rows a program)."""
    group_p2 = triton.next_power_of_2(group)
    groups = max(1, min(triton.next_power_of_2(num_groups), TILE_ELEMENTS // group_p2))
    return group_p2, groups, max(1, TILE_ELEMENTS // (group_p2 * groups))


def tile_warps(group_p2: int, groups: int, rows: int) -> int:
    """Warps for a tile: about 16 values a thread (4 to 16 warps)."""
    return max(4, min(16, rows * groups * group_p2 // 512))


def quantize_rows(x: torch.Tensor, group: int | None = None, ub: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] fp8, scale fp32 [T, 1] per token, or [T, ceil(K / group)] per group); ub: each group's
    amax capped at it first (fbgemm_fp8's activation_scale_ub)."""
    num_rows, k = x.shape
    group = k if group is None else group
    xq = torch.empty((num_rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, -(-k // group)), dtype=torch.float32, device=x.device)
    if num_rows:
        launch = quantize_tiled if triton.next_power_of_2(group) <= MAX_TILE_GROUP else quantize_two_pass
        launch(x, group, xq, scale, float(ub or 0.0))
    return xq, scale


def quantize_tiled(x: torch.Tensor, group: int, xq: torch.Tensor, scale: torch.Tensor, ub: float = 0.0) -> None:
    """The tiled kernel into xq, scale (quantize_rows' outputs; group up to MAX_TILE_GROUP)."""
    (num_rows, k), num_groups = x.shape, scale.shape[1]
    group_p2, groups, rows = tile_shape(group, num_groups)
    grid = (triton.cdiv(num_rows, rows), triton.cdiv(num_groups, groups))
    _quantize_tile_kernel[grid](x, xq, scale, num_rows, x.stride(0), xq.stride(0), scale.stride(0), k, num_groups,
                                GROUP=group, GROUP_P2=group_p2, GROUPS=groups, ROWS=rows, FP8_MAX_C=FP8_MAX,
                                MIN_AMAX_C=MIN_AMAX, UB=ub, num_warps=tile_warps(group_p2, groups, rows))


def quantize_two_pass(x: torch.Tensor, group: int, xq: torch.Tensor, scale: torch.Tensor, ub: float = 0.0) -> None:
    """The two-pass kernel into xq, scale (any group width)."""
    (num_rows, k), num_groups = x.shape, scale.shape[1]
    block = min(triton.next_power_of_2(group), MAX_ROW_BLOCK)
    _quantize_kernel[(num_rows, num_groups)](x, xq, scale, x.stride(0), xq.stride(0), scale.stride(0), K=k,
                                             GROUP=group, BLOCK=block, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, UB=ub,
                                             num_warps=4 if block <= 1024 else 8)
