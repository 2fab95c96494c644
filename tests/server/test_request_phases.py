"""vLLM's per-request phase histograms on /metrics (vllm:request_{queue,prefill,decode,inference}_time_seconds),
from the engine's own stage times of each finished request, through a real tiny engine."""

from __future__ import annotations

import openai
from server_testing import make_engine, running_server, scrape

LABELS = '{engine="0",model_name="tiny-phases"}'


def test_each_finished_request_observes_its_phases(tiny_llama):
    engine = make_engine(tiny_llama)
    try:
        with running_server(engine, "tiny-phases") as (url, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
            before = scrape(url)
            for stream in (False, True):
                out = client.completions.create(model="tiny-phases", prompt="Hello", max_tokens=5, stream=stream,
                                                extra_body={"ignore_eos": True})
                if stream:
                    list(out)
            after = scrape(url)
    finally:
        engine.shutdown()

    def grew(name):
        return after[name] - before.get(name, 0.0)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"vllm:request_{phase}_time_seconds_count{LABELS}") == 2, phase
        assert grew(f"vllm:request_{phase}_time_seconds_sum{LABELS}") >= 0, phase
    # inference = prefill + decode, per request, so in the sums too
    parts = grew(f"vllm:request_prefill_time_seconds_sum{LABELS}") + grew(f"vllm:request_decode_time_seconds_sum{LABELS}")
    assert abs(grew(f"vllm:request_inference_time_seconds_sum{LABELS}") - parts) < 1e-6
    assert grew(f"vllm:request_prefill_time_seconds_sum{LABELS}") > 0
