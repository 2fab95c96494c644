"""--max-logprobs (vLLM's, default 20): the most top logprobs a request may ask for, checked at admission; the
profile samples with that many, so a larger setting is planned memory, not a surprise."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError, RequestError


def _llm(folder, **kw):
    return LLM(folder, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="4MiB", **kw)


def test_a_larger_max_logprobs_serves_more_and_the_profile_asks_for_as_many(tiny_llama):
    llm = _llm(tiny_llama, max_logprobs=30)
    assert llm.engine.max_logprobs == 30
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, logprobs=25, prompt_logprobs=30),
                       use_tqdm=False)[0]
    # greedy: the chosen token is the top one, so each position holds exactly the top 25
    assert [len(entry) for entry in out.outputs[0].logprobs] == [25, 25]
    assert all(len(entry) >= 30 for entry in out.prompt_logprobs[1:])
    profile = llm.engine.workers.runner._profile_delta(8, 2)
    assert {(r.params.logprobs, r.params.prompt_logprobs) for r in profile.new_requests} == {(30, 30)}
    llm.shutdown()


def test_the_default_refuses_more_than_20_naming_the_flag(tiny_llama):
    llm = _llm(tiny_llama)
    with pytest.raises(RequestError, match="--max-logprobs of 20") as info:
        llm.generate([[5, 6, 7]], SamplingParams(logprobs=21), use_tqdm=False)
    assert info.value.param == "logprobs"
    assert llm.engine.stats()["kv_blocks_used"] == 0
    llm.shutdown()


def test_minus_one_is_the_vocabulary_and_bad_values_are_config_errors(tiny_llama):
    llm = _llm(tiny_llama, max_logprobs=-1)
    assert llm.engine.max_logprobs == llm.engine.facts.vocab_size
    llm.shutdown()
    for bad in (-2, 1.5, True, "20"):
        with pytest.raises(ConfigError, match="--max-logprobs must be an integer >= 0, or -1"):
            _llm(tiny_llama, max_logprobs=bad)


def test_logprobs_minus_one_asks_for_the_whole_vocabulary(tiny_llama):
    """SamplingParams(logprobs=-1 / prompt_logprobs=-1): every token's logprob, as vLLM reads -1; past
    --max-logprobs it is refused naming the flag; below -1 is refused. The server takes -1 for prompt_logprobs and
    chat top_logprobs (not the completions logprobs field), as vLLM's request models do."""
    llm = _llm(tiny_llama, max_logprobs=-1)
    vocab = llm.engine.facts.vocab_size
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    assert [len(entry) for entry in out.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
    llm.shutdown()
    llm = _llm(tiny_llama)
    with pytest.raises(RequestError, match=r"logprobs is -1 \(the whole vocabulary.*--max-logprobs -1") as info:
        llm.generate([[5, 6, 7]], SamplingParams(logprobs=-1), use_tqdm=False)
    assert info.value.param == "logprobs" and llm.engine.stats()["kv_blocks_used"] == 0
    llm.shutdown()
    with pytest.raises(RequestError, match="or -1 \\(the whole vocabulary\\)"):
        SamplingParams(prompt_logprobs=-2)
    from kvfit.server.params import _check_top_k_count
    from kvfit.server.protocol import APIError
    _check_top_k_count(-1, "prompt_logprobs", 20)
    with pytest.raises(APIError, match="logprobs must be >= 0, got -1"):
        _check_top_k_count(-1, "logprobs", 20, whole_vocabulary=False)
