"""The server over a multi-step engine (--num-scheduler-steps 4): streams arrive in rounds of tokens
but their text, stops and usage equal single-step offline generation."""

from __future__ import annotations

import openai
import pytest
from server_testing import ENGINE_KWARGS, completion_text, make_engine, running_server

from kvfit import LLM, SamplingParams

MODEL = "tiny-multi"
PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def client(tiny_llama):
    engine = make_engine(tiny_llama, num_scheduler_steps=4)
    try:
        with running_server(engine, MODEL) as (url, _):
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(tiny_llama, **ENGINE_KWARGS)         # one step per round
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=23, ignore_eos=True), use_tqdm=False)[0]
    llm.shutdown()
    return out


def test_streamed_text_equals_single_step(client, reference):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=23, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 23


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_at_the_same_text(client, reference, stream):
    text = reference.outputs[0].text
    at = next((i for i in range(5, len(text) - 2) if text[i:i + 2].strip()), None)
    if at is None:
        pytest.skip(f"greedy text too short to pick a stop string: {text!r}")
    stop = text[at:at + 2]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=23, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert completion_text(client, stream, **kwargs) == (text[:text.find(stop)], "stop")
