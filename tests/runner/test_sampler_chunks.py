"""The sampler in row chunks (issue 32 (1)): a step of more rows than sampler_chunk_rows runs in chunks whose
fp32 temporaries are [chunk, vocab]; its tokens, logprobs and counts equal one pass over all rows exactly."""

from __future__ import annotations

import torch

from kvfit import planning
from kvfit.runner.logits_processing import RowExtras
from kvfit.planning import sampler_chunk_rows
from kvfit.runner.sampling_state import SamplingState
from kvfit.sampling_params import SamplingParams
from kvfit.structured.bitmask import bitmask_words

V = 64
PARAMS = [SamplingParams(temperature=0), SamplingParams(seed=1, top_p=0.8, logprobs=2),
          SamplingParams(seed=2, top_k=5, repetition_penalty=1.3), SamplingParams(temperature=0, logprobs=5),
          SamplingParams(seed=3, min_p=0.1, logit_bias={4: 5.0}, frequency_penalty=0.5),
          SamplingParams(seed=4, allowed_token_ids=[1, 2, 3, 9], logprobs=0),
          SamplingParams(seed=5, min_tokens=3, top_p=0.5), SamplingParams(temperature=0, presence_penalty=1.0),
          SamplingParams(seed=6, top_k=3, top_p=0.9, logprobs=1), SamplingParams(seed=7)]
EXTRAS = [RowExtras(prompt_token_ids=(1, 2, 3), eos_token_ids=(2,), bad_words_token_ids=((7,),))] * len(PARAMS)
MASKED = [1, 4, 5, 9]                              # positions with a grammar bitmask row


def run(monkeypatch, max_logits: int):
    monkeypatch.setattr(planning, "MAX_SAMPLER_LOGITS", max_logits)
    n = len(PARAMS)
    state = SamplingState(n + 2, V, torch.device("cpu"))
    rows = [n + 1, 0, 3, 2, 5, 4, 7, 6, 9, 8]      # persistent rows out of order
    state.set_rows(rows, PARAMS, [[1, 1, 4]] * n, EXTRAS)
    gen = torch.Generator().manual_seed(0)
    words = bitmask_words(V)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(MASKED), words), generator=gen, dtype=torch.int64).to(torch.int32)
    out = []
    for step in range(3):
        logits = torch.randn(n, V, generator=gen) * 3
        if step == 1:
            logits[6, 3] = float("nan")                # a row that ends alone, in the middle of a chunk
        r = state.sample_step(logits, torch.tensor(rows), rows, torch.tensor([step + 3] * n),
                              num_generated_host=[step + 3] * n, bitmask=bitmask, masked=MASKED)
        out.append((r.tokens, r.logprobs, r.logprob_positions, r.num_logprobs))
    return out, state.output_token_counts.clone()


def test_chunked_sampler_equals_one_pass(monkeypatch):
    whole, counts = run(monkeypatch, 1 << 22)
    assert sampler_chunk_rows(V) > len(PARAMS)           # one pass
    chunked, chunked_counts = run(monkeypatch, 3 * V)
    assert sampler_chunk_rows(V) == 3                     # four chunks, the last of one row
    for (t1, lp1, pos1, k1), (t2, lp2, pos2, k2) in zip(whole, chunked):
        assert torch.equal(t1, t2)
        assert pos1 == pos2 == [1, 3, 5, 8] and k1 == k2 == [2, 5, 0, 1]
        assert lp1.shape == lp2.shape and torch.equal(lp1, lp2)
    assert torch.equal(counts, chunked_counts)


def test_chunk_rows_bound_the_temporaries():
    assert sampler_chunk_rows(151_936) * 151_936 <= planning.MAX_SAMPLER_LOGITS
    assert sampler_chunk_rows(10 ** 8) == 1
