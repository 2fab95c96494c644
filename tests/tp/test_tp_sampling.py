"""tensor_parallel_size=2 (gloo) samples as 1 does with penalties, logprobs and prompt logprobs: rank 0 samples,
every rank computes the same logits (prompt-logprob slices included, since the LM head all-gathers)."""

from __future__ import annotations

from tp_helpers import ENGINE_KWARGS

from kvfit import LLM, SamplingParams

PROMPTS = [[5, 9, 23, 40, 7, 7, 12], list(range(30, 60))]
PARAMS = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.4,
                         frequency_penalty=0.5, logprobs=3, prompt_logprobs=2),
          SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, presence_penalty=1.0, logprobs=1)]


def _run(folder: str, **kwargs):
    llm = LLM(folder, **ENGINE_KWARGS, max_num_batched_tokens=16, **kwargs)
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


def _close(a, b) -> bool:
    return a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank
                                        for t in a)


def test_two_ranks_sample_as_one_with_penalties_and_logprobs(tiny_llama):
    one, two = _run(tiny_llama), _run(tiny_llama, tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(_close(x, y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    assert one[0].prompt_logprobs[0] is None and two[0].prompt_logprobs[0] is None
    assert all(_close(x, y) for x, y in zip(one[0].prompt_logprobs[1:], two[0].prompt_logprobs[1:]))
