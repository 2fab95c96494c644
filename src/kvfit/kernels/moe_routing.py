"""MoE routing in one Triton launch: softmax over the experts in fp32, the top k, renormalised when asked,
the weights stored in the dtype the experts read (fused_moe.select_experts' numbers, on CUDA).

torch takes five to six launches for the same (softmax, topk's gather and sort, the sum, the division, the cast
to the model dtype), once per MoE layer and step: 48 layers of Qwen3-30B-A3B make about 250 tiny kernels a
decode step, which at batch 1 cost about as much as the experts' weight reads. One program per token holds its
E logits (padded to a power of two), takes the max, exp and sum in fp32, and picks the top k by k passes of
argmax (the first index of the largest value, as torch.topk on distinct values; k is small). Ties between
equal probabilities may pick another of the tied ids than torch.topk (both are a top k). No host sync.
"""

from __future__ import annotations

import torch

from kvfit.platforms.gate import triton_applies

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROUTED_EXPERTS = 1024      # one program holds a token's logits in registers


def routing_kernel_applies(router_logits: torch.Tensor, top_k: int) -> bool:
    """Triton on this tensor's device, a 2-D [T, E] row-major tensor with E up to MAX_ROUTED_EXPERTS."""
    return (triton_applies(router_logits) and router_logits.dim() == 2 and router_logits.stride(1) == 1
            and router_logits.shape[1] <= MAX_ROUTED_EXPERTS and 1 <= top_k <= router_logits.shape[1])


if triton is not None:
    @triton.jit
    def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, E: tl.constexpr, E_PAD: tl.constexpr,
                             K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, E_PAD)
        valid = experts < E
        x = tl.load(logits_ptr + token * stride_l + experts, mask=valid, other=float("-inf")).to(tl.float32)
        x = x - tl.max(x, axis=0)
        e = tl.where(valid, tl.exp(x), 0.0)
        probs = e / tl.sum(e, axis=0)                                              # [E_PAD] fp32
        # non-finite logits (NaN, +inf) give NaN probabilities, and argmax over NaN may pick any slot, padding
        # included: an expert id >= E would send the grouped GEMMs past the experts' weights. As 0 they pick
        # valid, distinct experts; the weights are NaN (renormalised) or 0, and the row's logits come out
        # non-finite, which the sampler reports for that request alone.
        probs = tl.where(probs == probs, probs, 0.0)
        slots = tl.arange(0, K_PAD)
        top_w = tl.zeros([K_PAD], dtype=tl.float32)
        top_i = tl.zeros([K_PAD], dtype=tl.int64)
        left = tl.where(valid, probs, -1.0)                                        # padding never picked
        for j in tl.static_range(K):
            best = tl.argmax(left, axis=0)
            w = tl.max(left, axis=0)
            top_w = tl.where(slots == j, w, top_w)
            top_i = tl.where(slots == j, best.to(tl.int64), top_i)
            left = tl.where(experts == best, -2.0, left)
        if RENORMALIZE:
            top_w = top_w / tl.sum(tl.where(slots < K, top_w, 0.0), axis=0)
        out = token * K + slots
        tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=slots < K)
        tl.store(ids_ptr + out, top_i, mask=slots < K)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] in weights_dtype, topk_ids [T, k] int64), descending."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(num_experts)
    _softmax_topk_kernel[(num_tokens,)](router_logits, weights, ids, router_logits.stride(0), E=num_experts,
                                        E_PAD=e_pad, K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                        RENORMALIZE=renormalize, num_warps=1 if e_pad <= 256 else 4)
    return weights, ids
