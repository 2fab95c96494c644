"""The torch reference backend against plain masked-softmax attention: one padded call for small steps,
per-sequence query chunks past MAX_SCORE_ELEMENTS (issue 32 (6): a long prefill no longer builds
[heads, L, L] fp32 scores), grouped-query heads, a cached prefix."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention import torch_ref
from kvfit.attention.base import AttentionMetadata
from kvfit.attention.torch_ref import TorchReferenceBackend

BLOCK, HKV, D = 4, 2, 8


def naive(q, k, v, scale):
    # q: [L, Hq, D], k, v: [S, Hkv, D]: the last L of S positions, causal
    q_len, ctx_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    hidden = torch.arange(ctx_len)[None] > torch.arange(ctx_len - q_len, ctx_len)[:, None]
    return torch.einsum("hls,shd->lhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def run(q_lens, ctx_lens, num_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in ctx_lens) + 1
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen)
    k_cache[0], v_cache[0] = float("nan"), float("nan")      # block 0 is no sequence's: padding may read, not use it
    width = max(-(-n // BLOCK) for n in ctx_lens)
    # columns past a sequence's own blocks hold stale ids, even ids past this cache (the profile's scratch
    # cache was larger): they must never be read
    table = torch.full((len(ctx_lens), width), num_blocks + 5, dtype=torch.int32)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1            # scattered, never in order
    used = 0
    for i, n in enumerate(ctx_lens):
        table[i, :-(-n // BLOCK)] = ids[used:used + -(-n // BLOCK)].int()
        if n % BLOCK:
            k_cache[ids[used + n // BLOCK], n % BLOCK:] = float("nan")
            v_cache[ids[used + n // BLOCK], n % BLOCK:] = float("nan")
        used += -(-n // BLOCK)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], num_heads, D, generator=gen)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), query_start_loc=torch.tensor(starts),
                             seq_lens=torch.tensor(ctx_lens), block_tables=table, max_query_len=max(q_lens),
                             max_seq_len=max(ctx_lens), query_start_loc_host=starts, seq_lens_host=list(ctx_lens))
    out = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, 0.3)
    for i, n in enumerate(ctx_lens):
        blocks = table[i, :-(-n // BLOCK)].long()
        k = k_cache[blocks].reshape(-1, HKV, D)[:n]
        v = v_cache[blocks].reshape(-1, HKV, D)[:n]
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], naive(query[starts[i]:starts[i + 1]], k, v, 0.3),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads", [2, 6])
@pytest.mark.parametrize("budget", [1 << 26, 64])                   # one padded call / chunks of a few rows
def test_reference_equals_masked_softmax(num_heads, budget, monkeypatch):
    monkeypatch.setattr(torch_ref, "MAX_SCORE_ELEMENTS", budget)
    run([1, 1, 1], [5, 9, 1], num_heads)                                # decode
    run([7, 3, 1, 12], [7, 10, 13, 12], num_heads)                      # prefills, a cached prefix, a decode
    run([0, 5, 0], [3, 5, 2], num_heads)                                # sequences with no query this step


def test_long_prefill_scores_stay_bounded(monkeypatch):
    # every attention call sees at most MAX_SCORE_ELEMENTS scores (heads x queries x keys)
    monkeypatch.setattr(torch_ref, "MAX_SCORE_ELEMENTS", 4 * 40 * 8)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, **kwargs):
        seen.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return real(q, k, v, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    run([40, 2], [40, 41], num_heads=4)
    assert len(seen) > 2 and max(seen) <= 4 * 40 * 8
