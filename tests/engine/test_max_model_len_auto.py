"""--max-model-len auto in the engine: the planner's choice is the length the scheduler and admission use."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams
from kvfit.errors import RequestError


def test_auto_length_is_what_the_blocks_hold(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len="auto", num_gpu_blocks_override=4,
              block_size=16)
    assert llm.engine.max_model_len == llm.capacity.max_model_len == 64
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4          # capped by the chosen length
    with pytest.raises(RequestError, match="--max-model-len is 64"):
        llm.generate([[5] * 70], SamplingParams(max_tokens=1), use_tqdm=False)
