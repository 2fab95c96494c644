"""Mixture-of-experts feed-forward: routing (select_experts), a torch reference, and a fused Triton path.

Weights, stacked per layer (the layout transformers 5 keeps for Qwen3-MoE and Mixtral):
  w13 [E, 2*I, H]: gate rows first, then up rows (gate = w13[e, :I], up = w13[e, I:])
  w2  [E, H, I]
out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), with e = topk_ids[t, j].

The fused path (as vLLM's fused_moe), four launches (five past moe_align.ALIGN_ONE_PROGRAM_MAX_PAIRS), no host sync
(CUDA graphs capture it whole):
1. moe_align groups the T*k (token, slot) pairs by expert, each group padded to BLOCK_SIZE_M rows, and names
   each block's expert: one Triton program for small batches; else per-program expert counts, then a
   scatter whose programs each sum those counts themselves (no scan launch, no zeroed scratch);
2. one grouped-GEMM launch computes gate and up for every pair, SiLU(gate) * up in its epilogue -> [T*k, I];
3. one computes down with the routing weight multiplied in -> [T, k, H];
4. the sum over k, a plain reduction in fp32 (deterministic: no atomics on the output).
Every element offset is int64 (indices cast before they meet a stride). HIDDEN and INTER are
compile-time constants (one compile per layer shape; static loop bounds, unmasked whole tiles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

from kvfit.kernels.moe_align import moe_align  # noqa: E402
from kvfit.kernels.moe_routing import routing_kernel_applies, softmax_topk  # noqa: E402
from kvfit.platforms.gate import triton_applies  # noqa: E402

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCORING_FUNCS = ("softmax",)
SMEM_BYTES = 227 * 1024      # Hopper's shared memory per block
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

# Tuned configs: (E, H, I, top_k, dtype name) -> {M (tokens in the step): config}; get_config takes the
# entry whose M is nearest. Paste the dict benchmarks/bench_fused_moe.py prints on the H200 here.
# BLOCK_SIZE_N is per half in the gate/up launch (a program computes BLOCK_SIZE_N gate and BLOCK_SIZE_N
# up columns), per output column in the down launch. I is the per-rank intermediate size.
# Swept on one H200 (2026-12-03, benchmarks/results/2026-12-03-fused-moe-sweep-h200.log).
TUNED_CONFIGS: dict[tuple[int, int, int, int, str], dict[int, dict[str, int]]] = {
    (128, 2048, 768, 8, 'bfloat16'): {
        1: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        8: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        32: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 32, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        128: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        512: {'BLOCK_SIZE_M': 32, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 4, 'num_stages': 4},
        2048: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 4, 'num_stages': 3},
        8192: {'BLOCK_SIZE_M': 128, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 8, 'num_stages': 3},
    },
    (8, 4096, 14336, 2, 'bfloat16'): {
        1: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 256, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3},
        8: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 256, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 3},
        32: {'BLOCK_SIZE_M': 16, 'BLOCK_SIZE_N': 64, 'BLOCK_SIZE_K': 128, 'GROUP_SIZE_M': 1, 'num_warps': 4, 'num_stages': 4},
        128: {'BLOCK_SIZE_M': 32, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 4, 'num_stages': 4},
        512: {'BLOCK_SIZE_M': 64, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 4, 'num_stages': 3},
        2048: {'BLOCK_SIZE_M': 128, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 8, 'num_stages': 3},
        8192: {'BLOCK_SIZE_M': 128, 'BLOCK_SIZE_N': 128, 'BLOCK_SIZE_K': 64, 'GROUP_SIZE_M': 8, 'num_warps': 8, 'num_stages': 3},
    },
}

def make_config(block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int,
                num_stages: int) -> dict[str, int]:
    return dict(zip(CONFIG_KEYS, (block_m, block_n, block_k, group_m, num_warps, num_stages)))


def stage_bytes(block_m: int, block_n: int, block_k: int, elem_bytes: int) -> int:
    """Shared memory one pipeline stage of the gate/up launch holds: an activation and two weight tiles."""
    return (block_m * block_k + 2 * block_k * block_n) * elem_bytes


def default_config(M: int, E: int, top_k: int, dtype: torch.dtype) -> dict[str, int]:
    """Hopper defaults by tokens per expert (M * top_k / E): small tiles when each expert sees a few rows
    (decode: bound by reading the weights), wide ones when the grouped GEMMs are compute bound; as many
    pipeline stages as fit in shared memory, up to 4 (3 for the wide tiles). Past 16 rows per expert fp32
    (IEEE dots, no tensor cores) takes 32 x 64 x 32, then 64 x 64 x 32 tiles: the 16-bit wide tiles spill
    kilobytes per thread there, and the driver's local-memory reservation for them stays with the process
    (GiBs on the H200)."""
    rows_per_expert = M * top_k / E
    elem_bytes = torch.finfo(dtype).bits // 8
    small_k = 64 if elem_bytes == 4 else 128            # an fp32 K tile is twice the bytes
    if elem_bytes == 4 and rows_per_expert > 16:
        tiles, group, warps, stages = ((32, 64, 32), 8, 4, 4) if rows_per_expert <= 64 else ((64, 64, 32), 8, 8, 3)
    elif rows_per_expert <= 16:
        tiles, group, warps, stages = (16, 64, small_k), 1, 4, 4
    elif rows_per_expert <= 64:
        tiles, group, warps, stages = (32, 64, small_k), 8, 4, 4
    elif rows_per_expert <= 256:
        tiles, group, warps, stages = (64, 128, 64), 8, 8, 3
    else:
        tiles, group, warps, stages = (128, 128, 64), 8, 8, 3
    stages = max(1, min(stages, SMEM_BYTES // stage_bytes(*tiles, elem_bytes)))
    return make_config(*tiles, group, warps, stages)


def get_config(M: int, E: int, H: int, I: int, top_k: int, dtype: torch.dtype) -> dict[str, int]:
    """The launch config for M tokens: a tuned entry for this shape (nearest M) or the Hopper default."""
    tuned = TUNED_CONFIGS.get((E, H, I, top_k, str(dtype).removeprefix("torch.")))
    if tuned:
        return dict(tuned[min(tuned, key=lambda m: (abs(m - M), m))])
    return default_config(M, E, top_k, dtype)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring_func: str = "softmax", weights_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] in weights_dtype, topk_ids [T, k] int64).

    As transformers' Qwen3MoeTopKRouter (renormalize = norm_topk_prob) and MixtralTopKRouter
    (renormalize=True): softmax over all experts in fp32, top-k, optionally divided by their sum.
    The weights are fp32 by default (as vLLM's); Qwen3-MoE in transformers rounds them to the model dtype
    before use (weights_dtype), Mixtral does not: identical in fp32, within one rounding in bf16/fp16.
    On CUDA one Triton launch does it all (kernels/moe_routing.py); elsewhere torch.
    """
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func!r} is not supported; use one of {SCORING_FUNCS}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [num_tokens, num_experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if routing_kernel_applies(router_logits, top_k):
        return softmax_topk(router_logits, top_k, renormalize, weights_dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)        # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)                 # [T, k], [T, k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weights_dtype), topk_ids


def check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Shapes and dtypes of one MoE call -> (T, H, E, I, k); ValueError naming what is wrong."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2*I, H], w2 [E, H, I]; got x {tuple(x.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    num_tokens, hidden = x.shape
    num_experts, two_i, w13_hidden = w13.shape
    inter = two_i // 2
    if two_i % 2 or w13_hidden != hidden or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"weights do not fit x [T, H={hidden}]: need w13 [E, 2*I, {hidden}] and w2 [E, {hidden}, I]; "
                         f"got w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights and topk_ids must both be [T={num_tokens}, k]; got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights float; got {topk_ids.dtype}, "
                         f"{topk_weights.dtype}")
    if len({t.device for t in (x, w13, w2, topk_weights, topk_ids)}) > 1:
        raise ValueError(f"x, w13, w2, topk_weights and topk_ids must be on one device; got x on {x.device}, "
                         f"w13 on {w13.device}, w2 on {w2.device}, topk_ids on {topk_ids.device}")
    if x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share one dtype of {FLOAT_DTYPES}; got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")
    return num_tokens, hidden, num_experts, inter, topk_ids.shape[1]


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch MoE (the CPU path and the fused kernel's oracle): x [T, H] -> [T, H] in x's dtype.

    Pairs sorted by expert, one gate/up and one down product per expert hit (one host sync for the
    counts), routing weights applied in fp32 and the k slots summed in fp32, in slot order
    (deterministic, no atomics).
    """
    num_experts = check_moe_inputs(x, w13, w2, topk_weights, topk_ids)[2]

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)                # [n, I] each
        return F.linear(F.silu(gate) * up, w2[expert])
    return experts_by_group(x, topk_weights, topk_ids, num_experts, expert_mlp)


def experts_by_group(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                     expert_mlp) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_mlp(e, rows of e) with e = topk_ids[t, j]: x [T, H] -> [T, H].

    Pairs sorted by expert, expert_mlp(e, [n, H]) -> [n, H] once per expert hit (one host sync for the
    counts), routing weights applied in fp32 and the k slots summed in fp32, in slot order
    (deterministic, no atomics). moe_reference's and the FP8 experts' loop."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()                                    # [T*k] pair -> expert
    order = torch.argsort(flat_ids, stable=True)                              # [T*k] pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts)
    if counts.numel() > num_experts:
        raise ValueError(f"topk_ids holds expert {int(flat_ids.max())} but the weights have {num_experts} experts")
    xs = x.index_select(0, order // top_k)                                    # [T*k, H] grouped rows
    ys = torch.empty_like(xs)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = slice(start, start + count)
            ys[rows] = expert_mlp(expert, xs[rows])
            start += count
    pairs = torch.empty_like(ys).index_copy_(0, order, ys)                    # [T*k, H] back in pair order
    weighted = pairs.float() * topk_weights.reshape(-1, 1).float()
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_applies(x: torch.Tensor) -> bool:
    """Triton is installed and x is a CUDA tensor of a float dtype the kernels take."""
    return triton_applies(x) and x.dtype in FLOAT_DTYPES


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' output [T, H]: fused_moe on CUDA with Triton, moe_reference elsewhere."""
    if fused_moe_applies(x):
        return fused_moe(x, w13, w2, topk_weights, topk_ids)
    return moe_reference(x, w13, w2, topk_weights, topk_ids)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int) -> int:
    """Compile every launch config get_config can pick for 1..max_tokens tokens of this expert shape (one
    fused_moe call per distinct config, on zero activations), so no Triton compile lands in a served
    step. Returns how many configs ran (0 where the fused path does not apply)."""
    if not fused_moe_applies(w13) or max_tokens < 1:
        return 0
    num_experts, two_inter, hidden = w13.shape
    tuned = TUNED_CONFIGS.get((num_experts, hidden, two_inter // 2, top_k, str(w13.dtype).removeprefix("torch.")), {})
    sizes = {1 << p for p in range(max_tokens.bit_length())} | {max_tokens} | {m for m in tuned if m <= max_tokens}
    seen = set()
    for m in sorted(sizes):
        config = get_config(m, num_experts, hidden, two_inter // 2, top_k, w13.dtype)
        key = tuple(sorted(config.items()))
        if key in seen:
            continue
        seen.add(key)
        x = torch.zeros((m, hidden), dtype=w13.dtype, device=w13.device)
        ids = (torch.arange(m * top_k, device=w13.device) % num_experts).view(m, top_k)
        weights = torch.full((m, top_k), 1.0 / top_k, dtype=torch.float32, device=w13.device)
        fused_moe(x, w13, w2, weights, ids, config)
    ids = (torch.arange(max_tokens * top_k, device=w13.device) % num_experts).view(max_tokens, top_k)
    moe_align(ids, num_experts, 16)     # the align path of the largest batch (one compile per E, any block_m)
    return len(seen)


if triton is not None:
    @triton.jit
    def _block_ids(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
        """Program id -> (m block, n block), GROUP_M row blocks walked together so weight tiles stay in L2."""
        per_group = GROUP_M * num_n_blocks
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows

    @triton.jit
    def _k_step(stride, BLOCK_K: tl.constexpr):
        """BLOCK_K * stride in int64 (a stride may arrive as int32, or as the constant 1)."""
        return tl.full((), BLOCK_K, tl.int64) * stride

    @triton.jit
    def _load_rows(ptrs, row_mask, offs_k, k_left, WHOLE_K: tl.constexpr):
        """[BM, BK] activation tile of the rows in row_mask; K masked only when it has a partial tile."""
        if WHOLE_K:
            tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_mask[:, None] & (offs_k < k_left)[None, :], other=0.0)
        return tile

    @triton.jit
    def _load_weights(ptrs, offs_k, k_left, n_mask, WHOLE_K: tl.constexpr, WHOLE_N: tl.constexpr):
        """[BK, BN] weight tile, masked only along dimensions with a partial tile (whole tiles: wide loads)."""
        if WHOLE_K and WHOLE_N:
            tile = tl.load(ptrs)
        elif WHOLE_K:
            tile = tl.load(ptrs, mask=n_mask[None, :], other=0.0)
        elif WHOLE_N:
            tile = tl.load(ptrs, mask=(offs_k < k_left)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_k < k_left)[:, None] & n_mask[None, :], other=0.0)
        return tile

    # num_pairs and num_m_blocks change with the batch: not specialised, so a new batch size never recompiles
    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_pair_ids_ptr, block_experts_ptr,
                        num_pairs, num_m_blocks,
                        stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ap, stride_ai,
                        HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        PRECISION: tl.constexpr):
        # act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for one block of pairs
        pid_m, pid_n = _block_ids(tl.program_id(0), num_m_blocks, tl.cdiv(INTER, BLOCK_N), GROUP_M)
        pid_m = pid_m.to(tl.int64)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        if expert >= NUM_EXPERTS:       # past the last group: nothing to compute
            return
        pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = pairs < num_pairs                                          # padding rows hold num_pairs
        tokens = pairs // TOP_K
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh            # [BM, BK]
        w_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wh
        g_ptrs = w_ptrs + offs_n[None, :] * stride_wn                         # [BK, BN] gate rows n
        u_ptrs = w_ptrs + (offs_n + INTER)[None, :] * stride_wn               # [BK, BN] up rows I + n
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, HIDDEN, BLOCK_K):
            a = _load_rows(x_ptrs, row_mask, offs_k, HIDDEN - k, HIDDEN % BLOCK_K == 0)
            g = _load_weights(g_ptrs, offs_k, HIDDEN - k, n_mask, HIDDEN % BLOCK_K == 0, INTER % BLOCK_N == 0)
            u = _load_weights(u_ptrs, offs_k, HIDDEN - k, n_mask, HIDDEN % BLOCK_K == 0, INTER % BLOCK_N == 0)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            x_ptrs += _k_step(stride_xh, BLOCK_K)
            g_ptrs += _k_step(stride_wh, BLOCK_K)
            u_ptrs += _k_step(stride_wh, BLOCK_K)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                           # SiLU(gate) * up in fp32
        out_ptrs = act_ptr + pairs[:, None] * stride_ap + offs_n[None, :] * stride_ai
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])

    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_pair_ids_ptr, block_experts_ptr,
                     num_pairs, num_m_blocks,
                     stride_ap, stride_ai, stride_we, stride_wn, stride_wi, stride_op, stride_oh,
                     HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
        # out[pair, n] = topk_weight[pair] * (act[pair] . w2[e, n]) for one block of pairs
        pid_m, pid_n = _block_ids(tl.program_id(0), num_m_blocks, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
        pid_m = pid_m.to(tl.int64)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        if expert >= NUM_EXPERTS:
            return
        pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = pairs < num_pairs
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < HIDDEN
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = act_ptr + pairs[:, None] * stride_ap + offs_k[None, :] * stride_ai           # [BM, BK]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wi  # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, INTER, BLOCK_K):
            a = _load_rows(a_ptrs, row_mask, offs_k, INTER - k, INTER % BLOCK_K == 0)
            w = _load_weights(w_ptrs, offs_k, INTER - k, n_mask, INTER % BLOCK_K == 0, HIDDEN % BLOCK_N == 0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += _k_step(stride_ai, BLOCK_K)
            w_ptrs += _k_step(stride_wi, BLOCK_K)
        acc *= tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + pairs[:, None] * stride_op + offs_n[None, :] * stride_oh
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def check_config(config: dict[str, int]) -> None:
    """A launch config names every key once; tile sizes are powers of two >= 16 (tl.dot's smallest)."""
    if set(config) != set(CONFIG_KEYS):
        raise ValueError(f"a fused_moe config needs exactly the keys {CONFIG_KEYS}; got {sorted(config)}")
    for key in CONFIG_KEYS[:3]:
        size = config[key]
        if size < 16 or size & (size - 1):
            raise ValueError(f"config {key}={size} must be a power of two >= 16")
    if config["GROUP_SIZE_M"] < 1 or config["num_warps"] < 1 or config["num_stages"] < 1:
        raise ValueError(f"config GROUP_SIZE_M, num_warps and num_stages must be >= 1; got {config}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """moe_reference in two grouped-GEMM Triton launches: x [T, H] -> [T, H] in x's dtype, fp32 accumulation.

    Any strides (the kernels take them all; unit stride along H/I reads fastest). topk_ids must lie in
    [0, E) (not checked: that would sync the host). config: get_config's keys; None picks get_config's.
    """
    if triton is None:
        raise RuntimeError("fused_moe needs Triton; install triton or use moe_reference")
    num_tokens, hidden, num_experts, inter, top_k = check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    if config is None:
        config = get_config(num_tokens, num_experts, hidden, inter, top_k, x.dtype)
    check_config(config)
    block_m, block_n, block_k = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    num_pairs = num_tokens * top_k
    out = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)   # [T, k, H]
    if num_pairs == 0:
        return out.sum(dim=1)
    sorted_pair_ids, block_experts = moe_align(topk_ids, num_experts, block_m)
    num_m_blocks = block_experts.numel()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)     # [T*k, I] SiLU(gate) * up
    pairs_out = out.view(num_pairs, hidden)
    weights = topk_weights.reshape(-1)                                        # [T*k], any float dtype
    launch = dict(HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, GROUP_M=config["GROUP_SIZE_M"],
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32",     # fp32: no tf32 rounding
                  num_warps=config["num_warps"], num_stages=config["num_stages"])
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, block_n),)](
        x, w13, act, sorted_pair_ids, block_experts, num_pairs, num_m_blocks,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), act.stride(1),
        TOP_K=top_k, **launch)
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, block_n),)](
        act, w2, pairs_out, weights, sorted_pair_ids, block_experts, num_pairs, num_m_blocks,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        pairs_out.stride(0), pairs_out.stride(1), **launch)
    if top_k == 1:
        return out.view(num_tokens, hidden)
    return out.sum(dim=1)           # accumulated in fp32 for 16-bit dtypes, one rounding
