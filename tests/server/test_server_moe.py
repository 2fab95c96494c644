"""A mixture-of-experts model behind the OpenAI API: the official client's greedy completion of a tiny
Qwen3-MoE equals the offline API's tokens and text."""

from __future__ import annotations

import openai

from kvfit import LLM, SamplingParams
from server_testing import ENGINE_KWARGS, make_engine, running_server
from tiny_models import make_tiny_model


def test_a_moe_model_serves_what_the_offline_api_generates(tmp_path):
    folder = make_tiny_model(tmp_path, arch="qwen3_moe", num_layers=2, seed=5, moe={"num_experts": 4, "top_k": 2})
    prompt = "The quick brown fox"
    ref = LLM(folder, **ENGINE_KWARGS).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                use_tqdm=False)[0].outputs[0]
    engine = make_engine(folder)
    try:
        with running_server(engine, "tiny-moe") as (url, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            resp = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    finally:
        engine.shutdown()
    assert resp.choices[0].text == ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids) == 8
