"""Sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws from a generator seeded by (seed, tokens generated so far), so its output
does not depend on batching, scheduling or preemption.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfit.engine.sampling_params import SamplingParams


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # logits: [V] float32 -> probs [V]
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs > params.top_p      # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample_tensor(logits: torch.Tensor, params: Sequence[SamplingParams], num_generated: Sequence[int]
                  ) -> torch.Tensor:
    """logits: [N, V] -> token ids [N] int64 on logits' device, with no host synchronisation
    (multi-step decoding feeds them straight into the next step)."""
    out = torch.argmax(logits, dim=-1)                                       # [N]
    for row, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered_probs(logits[row].float(), p)
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed((p.seed * 1_000_003 + num_generated[row]) % (2**63))
        out[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], num_generated: Sequence[int]) -> list[int]:
    """logits: [N, V] float32 -> one token id per row."""
    return sample_tensor(logits, params, num_generated).tolist()
