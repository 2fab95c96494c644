"""The sampler's logit edits and logprobs on CPU: penalties equal transformers' processors / OpenAI's rule,
min_tokens bounds advance with num_generated on the device, logprobs are the raw fp32 log-softmax with
vLLM's rank, and sample_step with every feature on makes no host sync."""

from __future__ import annotations

import pytest
import torch

from kvfit.runner.logits_processing import PROMPT_BIT, RowExtras, apply_penalties, pack_logprobs, top_logprobs
from kvfit.runner.sampling_state import SamplingState
from kvfit.sampling_params import SamplingParams

V = 48


def _state(params, extras=None, outputs=None):
    state = SamplingState(len(params), V, torch.device("cpu"))
    state.set_rows(list(range(len(params))), params, outputs or [[] for _ in params], extras)
    return state


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 4
    prompts, outputs = [[1, 2, 3, 3], [7]], [[3, 9, 9], [40, 7]]
    state = _state([SamplingParams(repetition_penalty=1.7)] * 2, [RowExtras(prompt_token_ids=p) for p in prompts],
                   outputs)
    got = apply_penalties(logits.clone(), state.output_token_counts.clone(), state.presence_penalty,
                          state.frequency_penalty, state.repetition_penalty)
    for i in range(2):
        ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompts[i] + outputs[i]]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i], ref[0])


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, V)
    counts = torch.zeros(1, V, dtype=torch.int32)
    counts[0, 5], counts[0, 6] = 3, PROMPT_BIT            # 6 only in the prompt: untouched
    got = apply_penalties(logits, counts, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([1.0]))
    assert got[0, 5].item() == pytest.approx(-(0.5 + 3 * 0.25)) and got[0, 6].item() == 0.0
    assert (got[0, :5] == 0).all()


def test_min_tokens_masks_stop_ids_until_reached_on_the_device():
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0                                    # eos is the argmax
    state = _state([SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])],
                   [RowExtras(eos_token_ids=(2,))])
    logits[0, 4] = 9.0
    rows = torch.tensor([0])
    picks = [state.sample_step(logits, rows, [0], torch.tensor([k]), num_generated_host=[0])
             .tokens.item() for k in range(3)]
    assert picks[0] not in (2, 4) and picks[1] not in (2, 4) and picks[2] == 2


def test_logprobs_are_the_raw_log_softmax_with_vllms_rank():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)).bfloat16()
    lse, values, ids = top_logprobs(logits, 4)
    tokens = torch.tensor([0, 5, 9])
    packed = pack_logprobs(lse, values, ids, logits, tokens)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, t in enumerate(tokens.tolist()):
        assert packed[i, 0].item() == t
        assert packed[i, 1].item() == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert packed[i, 2].item() == int((ref[i] > ref[i, t]).sum()) + 1
        top = torch.topk(ref[i], 4)
        assert packed[i, 3:7].long().tolist() == top.indices.tolist()
        torch.testing.assert_close(packed[i, 7:11].float(), top.values)


def test_logprobs_ignore_penalties_and_temperature():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    state = _state([SamplingParams(temperature=0.3, seed=1, logprobs=2, presence_penalty=2.0,
                                   logit_bias={3: 50.0})], outputs=[[1, 2]])
    result = state.sample_step(logits, torch.tensor([0]), [0], torch.tensor([2]), num_generated_host=[2])
    assert result.tokens.item() == 3                      # the bias decides the draw...
    ref = torch.log_softmax(logits[0], dim=-1)
    assert result.logprobs[0, 1].item() == pytest.approx(ref[3].item(), abs=1e-5)   # ...not the logprob


def test_sample_step_with_every_feature_makes_no_host_sync(monkeypatch):
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=3),
              SamplingParams(seed=1, top_p=0.9, min_p=0.1, frequency_penalty=0.5, logit_bias={1: 3.0}),
              SamplingParams(top_k=3, min_tokens=4, allowed_token_ids=[2, 3, 4, 5]),
              SamplingParams(seed=2, presence_penalty=-1.0, logprobs=0)]
    extras = [RowExtras(prompt_token_ids=(1, 2)), RowExtras(), RowExtras(eos_token_ids=(3,)),
              RowExtras(bad_words_token_ids=((7,),))]
    state = _state(params, extras)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    rows, gen = torch.arange(4), torch.zeros(4, dtype=torch.int64)

    def host_read(*args, **kwargs):
        raise AssertionError("sample_step() read a tensor on the host")
    for name in ("item", "tolist", "nonzero", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "nonzero", host_read)
    results = [state.sample_step(logits, rows, [0, 1, 2, 3], gen + k, num_generated_host=[0] * 4)
               for k in range(3)]
    monkeypatch.undo()
    for r in results:
        tokens = r.tokens.tolist()
        assert tokens[2] in (2, 4, 5) and tokens[3] != 7                  # allowed ids; min_tokens holds 3 back
        assert r.logprob_positions == [0, 3] and r.num_logprobs == [3, 0] and r.logprobs.shape == (2, 3 + 6)
