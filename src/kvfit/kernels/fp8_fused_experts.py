"""FP8 experts in fused_moe's grouped GEMMs: the same pair grouping (moe_align) and launches, with FP8 weights
and FP8 activations on Hopper's tensor cores, so the experts read one byte a weight and CUDA graphs capture them.

1. x [T, H] quantized per token (per-channel weights) or per token and bk-column group (block weights);
2. gate/up: acc = dot(xq, Wq) per K step (block: times the step's activation and weight scales, one multiply-add
   per element where the tile lies in one row block; per channel: scaled once at the end), SiLU(gate) * up in
   fp32 -> act [T*k, I] in x's dtype;
3. act quantized as x was (per row, or per row and group);
4. down: the same GEMM, the routing weight multiplied in -> [T, k, H]; the k slots summed in fp32.
The quantization points equal Fp8Experts' reference loop (models/quant/experts.py), so the two agree up to
fp32 summation order and the reference rounding gate/up to x's dtype before SiLU. Offsets are int64.
Launch configs: TUNED_FP8_CONFIGS (swept by `benchmarks/bench_fused_moe.py --fp8`) where the shape is tuned,
else fused_moe's bf16 tuning fitted to FP8 (fallback_fp8_config).
"""

from __future__ import annotations

import torch

from kvfit.kernels import fused_moe as fm
from kvfit.kernels.fp8 import FP8_DTYPE, Fp8Weight, PreQuantized, quantize_activations, quantize_input
from kvfit.kernels.moe_align import moe_align
from kvfit.platforms.gate import on_gpu, triton_applies
from kvfit.quant_scheme import FP8_MAX, MIN_AMAX

try:
    import triton
    import triton.language as tl

    from kvfit.kernels.fp8_quantize import fp8_scale, fp8_values
except ImportError:  # CPU-only installs
    triton = None


def fused_experts_applies(x: torch.Tensor) -> bool:
    """Triton is installed and x is a CUDA tensor of a 16-bit or fp32 dtype."""
    return triton_applies(x) and x.dtype in fm.FLOAT_DTYPES


if triton is not None:
    # act's dtype inside the gate/up kernel when it writes fp8 (QUANT_OUT): the values are rounded to it first
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _scaled_dot(a_ptrs, w_ptrs, a_scale_ptrs, w_scale_ptrs, acc, row_mask, offs_k, n_mask, k_left, kb,
                    BLOCKWISE: tl.constexpr, WHOLE_K: tl.constexpr, WHOLE_N: tl.constexpr, DOT_FP32: tl.constexpr,
                    ONE_SCALE_ROW: tl.constexpr):
        """acc + one K step of fp8 rows . fp8 weights (block-wise: times this step's two scales; w_scale_ptrs
        one pointer when ONE_SCALE_ROW, else one per output column)."""
        a = fm._load_rows(a_ptrs, row_mask, offs_k, k_left, WHOLE_K)
        w = fm._load_weights(w_ptrs, offs_k, k_left, n_mask, WHOLE_K, WHOLE_N)
        if DOT_FP32:        # the interpreter has no fp8 dot: the same products, exact in fp32
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w)
        if BLOCKWISE and ONE_SCALE_ROW:     # the tile lies in one row block: one multiply per element
            a_s = tl.load(a_scale_ptrs + kb, mask=row_mask, other=0.0)
            acc += part * (a_s * tl.load(w_scale_ptrs + kb))[:, None]
        elif BLOCKWISE:
            a_s = tl.load(a_scale_ptrs + kb, mask=row_mask, other=0.0)
            acc += part * a_s[:, None] * tl.load(w_scale_ptrs + kb, mask=n_mask, other=0.0)[None, :]
        else:
            acc += part
        return acc

    @triton.jit
    def _pair_tile(sorted_pair_ids_ptr, block_experts_ptr, num_pairs, num_m_blocks, N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's expert (>= E past the last group), its BLOCK_M pairs and BLOCK_N output columns (the
        first, and all)."""
        pid_m, pid_n = fm._block_ids(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
        pid_m = pid_m.to(tl.int64)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        first_n = pid_n.to(tl.int64) * BLOCK_N
        offs_n = first_n + tl.arange(0, BLOCK_N)
        return expert, pairs, pairs < num_pairs, first_n, offs_n, offs_n < N

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _gate_up_fp8_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, act_ptr, act_scale_ptr, sorted_pair_ids_ptr,
                            block_experts_ptr, num_pairs, num_m_blocks, stride_xt, stride_xst, stride_we, stride_wn,
                            stride_wse, stride_wsn, stride_ap, stride_asp,
                            HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
                            NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUP_N: tl.constexpr,
                            DOT_FP32: tl.constexpr, QUANT_OUT: tl.constexpr, ACT_DTYPE: tl.constexpr,
                            FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
        # act[pair, n] = silu(xq[token] . w13[e, n]) * (xq[token] . w13[e, I + n]), scales applied;
        # GROUP_N 0: per-channel scales (w_scale [E, 2I, 1], x_scale [T, 1]), else [bn, BLOCK_K] blocks
        # (INTER a multiple of bn: the up half starts a row block). QUANT_OUT (block scales, BLOCK_N the down
        # launch's K step): the tile is one quantization group per row, so act is written as the down launch
        # reads it, fp8 plus a scale per (pair, group), with quantize_groups' numbers (rounded to ACT_DTYPE first)
        expert, pairs, row_mask, first_n, offs_n, n_mask = _pair_tile(
            sorted_pair_ids_ptr, block_experts_ptr, num_pairs, num_m_blocks, INTER, BLOCK_M, BLOCK_N, GROUP_M)
        if expert >= NUM_EXPERTS:       # past the last group: nothing to compute
            return
        tokens = pairs // TOP_K
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]                     # [BM, BK] fp8
        g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN] fp8
        u_ptrs = g_ptrs + INTER * stride_wn
        xs_ptrs = x_scale_ptr + tokens * stride_xst
        one_row: tl.constexpr = GROUP_N > 0 and GROUP_N % BLOCK_N == 0
        if GROUP_N == 0:
            gs_ptrs = w_scale_ptr + expert * stride_wse + offs_n * stride_wsn
            us_ptrs = gs_ptrs + INTER * stride_wsn
        elif one_row:
            gs_ptrs = w_scale_ptr + expert * stride_wse + (first_n // GROUP_N) * stride_wsn
            us_ptrs = w_scale_ptr + expert * stride_wse + ((first_n + INTER) // GROUP_N) * stride_wsn
        else:
            gs_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // GROUP_N) * stride_wsn
            us_ptrs = w_scale_ptr + expert * stride_wse + ((offs_n + INTER) // GROUP_N) * stride_wsn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, (HIDDEN + BLOCK_K - 1) // BLOCK_K):
            k_left = HIDDEN - kb * BLOCK_K
            acc_g = _scaled_dot(x_ptrs, g_ptrs, xs_ptrs, gs_ptrs, acc_g, row_mask, offs_k, n_mask, k_left, kb,
                                GROUP_N > 0, HIDDEN % BLOCK_K == 0, INTER % BLOCK_N == 0, DOT_FP32, one_row)
            acc_u = _scaled_dot(x_ptrs, u_ptrs, xs_ptrs, us_ptrs, acc_u, row_mask, offs_k, n_mask, k_left, kb,
                                GROUP_N > 0, HIDDEN % BLOCK_K == 0, INTER % BLOCK_N == 0, DOT_FP32, one_row)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if GROUP_N == 0:
            x_s = tl.load(xs_ptrs, mask=row_mask, other=0.0)[:, None]
            acc_g *= x_s * tl.load(gs_ptrs, mask=n_mask, other=0.0)[None, :]
            acc_u *= x_s * tl.load(us_ptrs, mask=n_mask, other=0.0)[None, :]
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                            # SiLU(gate) * up in fp32
        out_ptrs = act_ptr + pairs[:, None] * stride_ap + offs_n[None, :]
        out_mask = row_mask[:, None] & n_mask[None, :]
        if QUANT_OUT:
            act = tl.where(out_mask, act.to(ACT_DTYPE).to(tl.float32), 0.0)     # the values quantize_groups sees
            amax = tl.max(tl.abs(act), axis=1)                                              # [BM]
            scale = fp8_scale(amax, FP8_MAX_C, MIN_AMAX_C)
            q = fp8_values(act, scale[:, None], FP8_MAX_C)
            tl.store(out_ptrs, q.to(act_ptr.dtype.element_ty), mask=out_mask)
            tl.store(act_scale_ptr + pairs * stride_asp + first_n // BLOCK_N, scale, mask=row_mask)
        else:
            tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _down_fp8_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, weights_ptr, sorted_pair_ids_ptr,
                         block_experts_ptr, num_pairs, num_m_blocks, stride_ap, stride_asp, stride_we, stride_wn,
                         stride_wse, stride_wsn, stride_op,
                         HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUP_N: tl.constexpr,
                         DOT_FP32: tl.constexpr):
        # out[pair, n] = topk_weight[pair] * (aq[pair] . w2[e, n]), scales applied
        expert, pairs, row_mask, first_n, offs_n, n_mask = _pair_tile(
            sorted_pair_ids_ptr, block_experts_ptr, num_pairs, num_m_blocks, HIDDEN, BLOCK_M, BLOCK_N, GROUP_M)
        if expert >= NUM_EXPERTS:
            return
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = a_ptr + pairs[:, None] * stride_ap + offs_k[None, :]                       # [BM, BK] fp8
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN] fp8
        as_ptrs = a_scale_ptr + pairs * stride_asp
        one_row: tl.constexpr = GROUP_N > 0 and GROUP_N % BLOCK_N == 0
        scale_rows = first_n // GROUP_N if one_row else (offs_n if GROUP_N == 0 else offs_n // GROUP_N)
        ws_ptrs = w_scale_ptr + expert * stride_wse + scale_rows * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, (INTER + BLOCK_K - 1) // BLOCK_K):
            acc = _scaled_dot(a_ptrs, w_ptrs, as_ptrs, ws_ptrs, acc, row_mask, offs_k, n_mask, INTER - kb * BLOCK_K,
                              kb, GROUP_N > 0, INTER % BLOCK_K == 0, HIDDEN % BLOCK_N == 0, DOT_FP32, one_row)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if GROUP_N == 0:
            acc *= tl.load(as_ptrs, mask=row_mask, other=0.0)[:, None] * \
                tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
        acc *= tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs[:, None] * stride_op + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# block scales: the K step is the block's columns; tiles past this many outputs hold two fp32 accumulators and
# the step's scaled partials in registers and spill (ptxas, sm_90), so they narrow to BLOCK_N 64
MAX_BLOCKWISE_TILE = 64 * 128
# an FP8 config may add this key: the down launch's output columns (its tile holds one accumulator where the
# gate/up launch's holds two); absent, the down launch takes BLOCK_SIZE_N as fused_moe's does
DOWN_BLOCK_N_KEY = "BLOCK_SIZE_N_DOWN"
# and this one, 1 with block scales and BLOCK_SIZE_N the blocks' columns: the gate/up launch writes its output in
# fp8 with its per-group scales (one group per tile row), so no quantize launch and no 16-bit round trip of
# act run between the two GEMMs; absent or 0, act is written in x's dtype and quantized by quantize_activations
QUANT_IN_GATE_UP_KEY = "QUANT_IN_GATE_UP"

# Tuned configs: (E, H, I, top_k, fp8_scales_name(block_size)) -> {M (tokens in the step): config}; fp8_config
# takes the entry whose M is nearest. Paste the dict `benchmarks/bench_fused_moe.py --fp8 block` prints here.
# BLOCK_SIZE_N is per half in the gate/up launch (as fused_moe's), BLOCK_SIZE_N_DOWN the down launch's;
# with block scales BLOCK_SIZE_K is the block's columns. I is the per-rank intermediate size.
# swept on an NVIDIA H100 80GB HBM3, 2026-12-06 (bash benchmarks/run_gpu_steps.sh fused-moe-fp8;
# benchmarks/results/2026-12-06-h100-fused-moe-fp8-sweep.log)
TUNED_FP8_CONFIGS: dict[tuple[int, int, int, int, str], dict[int, dict[str, int]]] = {
    (128, 2048, 768, 8, 'fp8_block128x128'): {
        1: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        2: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3, 'BLOCK_SIZE_N_DOWN': 128},
        4: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        8: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3},
        16: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4, 'BLOCK_SIZE_N_DOWN': 64},
        32: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3, 'BLOCK_SIZE_N_DOWN': 128},
        64: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3},
        128: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3},
        256: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3, 'BLOCK_SIZE_N_DOWN': 128},
        512: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 8, 'num_warps': 8, 'num_stages': 3, 'BLOCK_SIZE_N_DOWN': 128},
        1024: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 8, 'num_warps': 4, 'num_stages': 3},
        2048: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 8, 'num_warps': 4, 'num_stages': 4, 'BLOCK_SIZE_N_DOWN': 128},
        4096: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 8, 'num_warps': 8, 'num_stages': 4},
        8192: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 8, 'num_warps': 8, 'num_stages': 3},
    },
}


def fp8_scales_name(block_size: tuple[int, int] | None) -> str:
    """The weight-scale layout in a TUNED_FP8_CONFIGS key: 'fp8_block128x128', or 'fp8_channel'."""
    return "fp8_channel" if block_size is None else f"fp8_block{block_size[0]}x{block_size[1]}"


def fp8_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               block_size: tuple[int, int] | None) -> dict[str, int]:
    """The launch config for this shape: a TUNED_FP8_CONFIGS entry (nearest M), else fallback_fp8_config."""
    tuned = TUNED_FP8_CONFIGS.get((num_experts, hidden, inter, top_k, fp8_scales_name(block_size)))
    if tuned:
        return dict(tuned[min(tuned, key=lambda m: (abs(m - num_tokens), m))])
    return fallback_fp8_config(num_tokens, num_experts, hidden, inter, top_k, block_size)


def fallback_fp8_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                        block_size: tuple[int, int] | None) -> dict[str, int]:
    """fused_moe's launch config for this shape (its bf16 tuning), fitted to FP8 weights: block scales set
    BLOCK_SIZE_K to the block's columns (one scale per K step) and keep the tile small enough not to spill."""
    config = fm.get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16)
    if block_size is not None:
        config["BLOCK_SIZE_K"] = block_size[1]
        if config["BLOCK_SIZE_M"] * config["BLOCK_SIZE_N"] > MAX_BLOCKWISE_TILE:
            config["BLOCK_SIZE_N"] = 64
    return config


def check_fp8_config(config: dict[str, int], block_size: tuple[int, int] | None) -> None:
    """fused_moe's config rules, DOWN_BLOCK_N_KEY optional; with block scales a K step is one block's columns."""
    fm.check_config({k: v for k, v in config.items() if k not in (DOWN_BLOCK_N_KEY, QUANT_IN_GATE_UP_KEY)})
    down_n = config.get(DOWN_BLOCK_N_KEY, 16)
    if down_n < 16 or down_n & (down_n - 1):
        raise ValueError(f"config {DOWN_BLOCK_N_KEY}={down_n} must be a power of two >= 16")
    if block_size is not None and config["BLOCK_SIZE_K"] != block_size[1]:
        raise ValueError(f"config BLOCK_SIZE_K={config['BLOCK_SIZE_K']} must equal the weight blocks' "
                         f"{block_size[1]} columns (one scale per K step)")
    if config.get(QUANT_IN_GATE_UP_KEY, 0) not in (0, 1):
        raise ValueError(f"config {QUANT_IN_GATE_UP_KEY}={config[QUANT_IN_GATE_UP_KEY]} must be 0 or 1")
    if config.get(QUANT_IN_GATE_UP_KEY) and (block_size is None or config["BLOCK_SIZE_N"] != block_size[1]):
        raise ValueError(f"config {QUANT_IN_GATE_UP_KEY}=1 needs block scales and BLOCK_SIZE_N equal to their "
                         "columns (one quantization group per tile row)")


def fused_fp8_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, block_size: tuple[int, int] | None, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, config: dict[str, int] | None = None,
                      input_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      pre: PreQuantized | None = None) -> torch.Tensor:
    """FP8 experts (Fp8Experts' stacked tensors) in two grouped-GEMM launches: x [T, H] -> [T, H] in x's dtype.

    w13 [E, 2I, H] / w2 [E, H, I] float8_e4m3fn with unit stride along K; scales per row ([E, rows, 1]) or
    per block ([E, rows / bn, cols / bk]); topk_ids in [0, E) (not checked: that would sync the host).
    input_scales: static activation scales (fp32 [1] each) of the gate/up and the down GEMMs' inputs (per-row
    weights only); None: activations quantized dynamically per token (per group with block weights).
    pre: x's quantization made ahead (by the RMSNorm before the experts), used where it is the one the gate/up
    GEMM takes."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    config = config or fp8_config(num_tokens, num_experts, hidden, inter, top_k, block_size)
    group_n = 0 if block_size is None else block_size[0]
    check_fp8_config(config, block_size)
    block_m, block_n, block_k = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    down_n = config.get(DOWN_BLOCK_N_KEY, block_n)
    num_pairs = num_tokens * top_k
    out = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)   # [T, k, H]
    if num_pairs == 0:
        return out.sum(dim=1)
    if input_scales is not None and block_size is not None:
        raise ValueError("static activation scales go with per-row FP8 weights, not block ones")
    static_in, static_down = input_scales if input_scales is not None else (None, None)
    probe = Fp8Weight(w13, w13_scale, block_size, static_in)    # only its block size and input scale are read
    xq, x_scale = quantize_input(x, probe, pre)                                    # [T, H] fp8, [T, 1 or G]
    sorted_pair_ids, block_experts = moe_align(topk_ids, num_experts, block_m)
    num_m_blocks = block_experts.numel()
    quant_out = bool(config.get(QUANT_IN_GATE_UP_KEY, 0))
    if quant_out:     # act in fp8 straight from the gate/up launch, one scale per (pair, group of block_k)
        act = torch.empty((num_pairs, inter), dtype=FP8_DTYPE, device=x.device)                      # [T*k, I]
        act_scale = torch.empty((num_pairs, triton.cdiv(inter, block_k)), dtype=torch.float32, device=x.device)
    else:
        act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)                        # [T*k, I]
        act_scale = act        # unused
    launch = dict(HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_K=block_k,
                  GROUP_M=config["GROUP_SIZE_M"], GROUP_N=group_n, DOT_FP32=not on_gpu(x),
                  num_warps=config["num_warps"], num_stages=config["num_stages"])
    xq = xq.contiguous()
    _gate_up_fp8_kernel[(num_m_blocks * triton.cdiv(inter, block_n),)](
        xq, x_scale, w13, w13_scale, act, act_scale, sorted_pair_ids, block_experts, num_pairs, num_m_blocks,
        xq.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        act.stride(0), act_scale.stride(0), TOP_K=top_k, BLOCK_N=block_n, QUANT_OUT=quant_out,
        ACT_DTYPE=_TL_DTYPES[x.dtype], FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, **launch)
    aq, a_scale = (act, act_scale) if quant_out else quantize_activations(
        act, Fp8Weight(w2, w2_scale, block_size, static_down))                             # [T*k, I] fp8
    aq = aq.contiguous()
    pairs_out = out.view(num_pairs, hidden)
    _down_fp8_kernel[(num_m_blocks * triton.cdiv(hidden, down_n),)](
        aq, a_scale, w2, w2_scale, pairs_out, topk_weights.reshape(-1), sorted_pair_ids, block_experts, num_pairs,
        num_m_blocks, aq.stride(0), a_scale.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), pairs_out.stride(0), BLOCK_N=down_n, **launch)
    return out.view(num_tokens, hidden) if top_k == 1 else out.sum(dim=1)


def warm_up(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
            block_size: tuple[int, int] | None, top_k: int, max_tokens: int, dtype: torch.dtype,
            input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
    """Compile every launch config fp8_config picks for 1..max_tokens tokens (powers of two, max_tokens and the
    tuned table's sizes), one call on zero activations per distinct config, so no compile lands in a served
    step; how many ran."""
    if not fused_experts_applies(w13_scale) or max_tokens < 1:
        return 0
    num_experts, two_inter, hidden = w13.shape
    tuned = TUNED_FP8_CONFIGS.get((num_experts, hidden, two_inter // 2, top_k, fp8_scales_name(block_size)), {})
    seen = set()
    sizes = {1 << p for p in range(max_tokens.bit_length())} | {max_tokens} | {m for m in tuned if m <= max_tokens}
    for m in sorted(sizes):
        config = fp8_config(m, num_experts, hidden, two_inter // 2, top_k, block_size)
        if tuple(sorted(config.items())) in seen:
            continue
        seen.add(tuple(sorted(config.items())))
        x = torch.zeros((m, hidden), dtype=dtype, device=w13.device)             # the model's activations
        ids = (torch.arange(m * top_k, device=w13.device) % num_experts).view(m, top_k)
        weights = torch.full((m, top_k), 1.0 / top_k, dtype=torch.float32, device=w13.device)
        fused_fp8_experts(x, w13, w13_scale, w2, w2_scale, block_size, weights, ids, config, input_scales)
    return len(seen)
