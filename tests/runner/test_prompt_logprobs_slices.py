"""Prompt logprobs computed a few positions at a time (planning.prompt_logprobs_slice for a large
vocabulary) equal those computed in one slice: the slice bounds memory, never the values."""

from __future__ import annotations

import pytest
import torch

from kvfit.planning import MAX_SAMPLER_LOGITS, prompt_logprobs_slice
from kvfit.runner.prompt_logprobs import compute_prompt_logprobs


def test_slices_of_any_size_give_the_same_prompt_logprobs():
    torch.manual_seed(0)
    hidden = torch.randn(40, 8)                                   # [tokens, hidden]
    head = torch.randn(50, 8)                                     # [vocab, hidden]
    token_ids = torch.randint(0, 50, (64,)).tolist()
    jobs = [("a", 0, 0, 17, token_ids, 3), ("b", 17, 5, 23, token_ids, 0)]

    def run(slice_positions):
        read = compute_prompt_logprobs(hidden, lambda h: h @ head.T, jobs, keep=True, to_host=lambda t: t,
                                       slice_positions=slice_positions)
        return read()
    whole = run(256)
    assert [len(whole[r][1]) for r in "ab"] == [17, 23]
    for size in (1, 3, 16):
        sliced = run(size)
        for request_id, (first, entries) in whole.items():
            assert sliced[request_id][0] == first
            for got, want in zip(sliced[request_id][1], entries, strict=True):
                # a matmul of fewer rows may round differently in the last bits; ids and ranks are exact
                assert (got.token_id, got.rank, got.top_ids) == (want.token_id, want.rank, want.top_ids)
                assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
                assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-5)


def test_the_slice_keeps_a_large_vocabularys_logits_within_the_sampler_bound():
    assert prompt_logprobs_slice(151_936) * 151_936 <= MAX_SAMPLER_LOGITS
    assert prompt_logprobs_slice(320) == 256                     # a small vocabulary keeps the old slice
    assert prompt_logprobs_slice(1 << 30) == 1
