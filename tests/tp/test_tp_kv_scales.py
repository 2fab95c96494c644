"""fp8 KV cache scales under tensor parallelism (models/kv_scales.py): each rank holds its KV heads' scales,
calculated from its own keys and values (--calculate-kv-scales) or sliced from the checkpoint's per-head scales."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import ENGINE_KWARGS

from kvfit import LLM, SamplingParams
from tiny_models import make_loud_model

LOUD = 2000.0      # keys and values past fp8's 448; queries and o_proj scaled down: the same model


@pytest.fixture(scope="module")
def loud_model(tmp_path_factory):
    return make_loud_model(tmp_path_factory.mktemp("tp-kv-scales"), LOUD, num_layers=2)


def _prompt_logprobs(folder: str, **kwargs) -> list[float]:
    llm = LLM(folder, **{**ENGINE_KWARGS, "kv_cache_memory": "16MiB"}, enable_prefix_caching=False, **kwargs)
    try:
        outs = llm.generate(["The quick brown fox jumps over", "Hello world! How are you today"],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    return [step[t].logprob for out in outs for t, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def test_two_ranks_calculate_their_scales_and_stay_close_to_the_exact_cache(loud_model):
    exact = _prompt_logprobs(loud_model)
    scaled = _prompt_logprobs(loud_model, tensor_parallel_size=2, kv_cache_dtype="fp8", calculate_kv_scales=True)
    unscaled = _prompt_logprobs(loud_model, tensor_parallel_size=2, kv_cache_dtype="fp8")
    diff = max(abs(a - b) for a, b in zip(scaled, exact))
    assert diff < 0.25 < max(abs(a - b) for a, b in zip(unscaled, exact)), diff
    assert len(scaled) == len(exact) and torch.isfinite(torch.tensor(scaled)).all()
