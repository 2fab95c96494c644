"""A request whose logits are not finite fails alone (finish reason "error"); the batch goes on."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams
from kvfit.models.llama import CausalLM

KW = dict(device="cpu", dtype="float32", kv_cache_memory="4MiB", block_size=4, max_model_len=64)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# issue 27 (7): top_p < 1 took the whole step down (filter_thresholds indexed -1 on the NaN row)
TOP_P = [SamplingParams(temperature=1.0, top_p=0.5, seed=7, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("num_scheduler_steps,params", [(1, GREEDY), (4, GREEDY), (1, TOP_P)])
def test_nan_logits_end_one_request_and_the_others_finish(tiny_llama, monkeypatch, num_scheduler_steps, params):
    llm = LLM(tiny_llama, num_scheduler_steps=num_scheduler_steps, **KW)
    prompts = [[5, 6, 7], [8, 9, 10]]
    expected = llm.generate(prompts, params, use_tqdm=False)
    real = CausalLM.compute_logits
    calls = []

    def poisoned(self, hidden):
        logits = real(self, hidden)               # [N, vocab]: row 0 is the first request's
        calls.append(1)
        if len(calls) == 3:
            logits[0] = float("nan")
        return logits
    monkeypatch.setattr(CausalLM, "compute_logits", poisoned)
    first, second = llm.generate(prompts, params, use_tqdm=False)
    assert first.finished and first.outputs[0].finish_reason == "error"
    assert first.outputs[0].token_ids == expected[0].outputs[0].token_ids[:len(first.outputs[0].token_ids)] and len(first.outputs[0].token_ids) < 12
    assert (second.outputs[0].token_ids, second.outputs[0].finish_reason) == (expected[1].outputs[0].token_ids, "length")
    assert llm.engine.stats()["kv_blocks_used"] == 0
    monkeypatch.setattr(CausalLM, "compute_logits", real)
    again = llm.generate(prompts, params, use_tqdm=False)          # the engine keeps serving
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_a_prompt_whose_logits_are_not_finite_leaves_no_cached_prefix(tiny_llama, monkeypatch):
    # its blocks were cached when its step was scheduled; ending it in error takes them back, so the next
    # request with that prompt computes it again rather than reuse the K/V of a step that went wrong
    llm = LLM(tiny_llama, **KW)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(5, 14))                   # two full blocks of 4 + 1 token
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    real = CausalLM.compute_logits

    def poisoned(self, hidden):
        logits = real(self, hidden)
        logits[:] = float("nan")
        return logits
    monkeypatch.setattr(CausalLM, "compute_logits", poisoned)
    failed = llm.generate(prompt, params, use_tqdm=False)[0]
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    monkeypatch.setattr(CausalLM, "compute_logits", real)
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == expected
    assert llm.engine.stats()["kv_blocks_used"] == 0
