"""Completions with a list of prompts (vLLM's batch), through the official openai client.

vLLM's rule: each prompt is its own engine request with the same params (n samples each); the
choices come prompt-major, index = prompt_index * n + sample_index; usage sums every prompt and
sample. The reference for each choice is the offline API (kvfit.LLM) on that prompt alone.
"""

from __future__ import annotations

import json

import httpx

from kvfit import SamplingParams
from server_testing import assert_blocks_balanced, openai_error, scrape, wait_for_drain

MODEL = "tiny"
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3"]


def offline_one(offline, prompt, **params):
    """The offline RequestOutput of one prompt alone (text, or token ids)."""
    item = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return offline.generate([item], SamplingParams(**params), use_tqdm=False)[0]


def test_text_prompts_give_prompt_major_choices_equal_to_each_prompt_alone(tiny_client, offline):
    params = dict(n=2, seed=11, max_tokens=6, temperature=1.0)
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPTS, **params)
    refs = [offline_one(offline, p, **params) for p in PROMPTS]
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [o.text for ref in refs for o in ref.outputs]
    assert [c.finish_reason for c in resp.choices] == [o.finish_reason for ref in refs for o in ref.outputs]
    assert resp.usage.prompt_tokens == sum(len(ref.prompt_token_ids) for ref in refs)
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for ref in refs for o in ref.outputs)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_token_id_prompts_with_echo_and_logprobs_per_choice(tiny_client, offline):
    prompts = [[1, 15, 27, 99], [1, 200, 3]]
    resp = tiny_client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, echo=True, logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, ids in zip(resp.choices, prompts):
        ref = offline_one(offline, ids, max_tokens=4, temperature=0)
        tokenizer = offline.get_tokenizer()
        prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
        assert choice.text == prompt_text + ref.outputs[0].text
        # echo: the prompt's tokens come first (the first has no logprob), then the generated ones
        assert len(choice.logprobs.tokens) == len(ids) + len(ref.outputs[0].token_ids)
        assert choice.logprobs.token_logprobs[0] is None
        assert all(v is not None for v in choice.logprobs.token_logprobs[1:])


def test_streamed_batch_chunks_carry_the_choice_index_and_usage_sums(tiny_client):
    params = dict(n=2, seed=5, max_tokens=5, temperature=1.0)
    full = tiny_client.completions.create(model=MODEL, prompt=PROMPTS[:2], **params)
    chunks = list(tiny_client.completions.create(model=MODEL, prompt=PROMPTS[:2], stream=True,
                                            stream_options={"include_usage": True}, **params))
    texts, reasons = {i: "" for i in range(4)}, {}
    assert len({c.id for c in chunks}) == 1                    # one response id over every prompt
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(4)] == [c.text for c in full.choices]
    assert [reasons[i] for i in range(4)] == [c.finish_reason for c in full.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_empty_batch_and_empty_member_are_400(tiny_server):
    for prompt, expected in (([], "the prompt is empty"), (["Hi", ""], "prompt 1 of 2 is empty"),
                             ([[1, 2], []], "prompt 1 of 2 is empty")):
        r = httpx.post(f"{tiny_server}/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=30)
        assert r.status_code == 400, r.text
        error = openai_error(r)
        assert error["message"].startswith(expected) and error["param"] == "prompt", error


def test_one_unservable_prompt_fails_the_whole_batch_and_frees_the_rest(tiny_server):
    too_long = [1] + [5] * 200                               # over max_model_len 128
    r = httpx.post(f"{tiny_server}/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3], too_long],
                                                     "max_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    assert openai_error(r)["message"].startswith("prompt 1 of 2: "), r.text
    assert_blocks_balanced(wait_for_drain(tiny_server))


def test_client_disconnect_aborts_every_prompt(tiny_server):
    before = scrape(tiny_server).get('kvfit_requests_finished_total{finish_reason="abort"}', 0.0)
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                break                                       # the first token arrived: go away
    m = wait_for_drain(tiny_server)
    assert_blocks_balanced(m)
    assert m['kvfit_requests_finished_total{finish_reason="abort"}'] - before == len(PROMPTS)
