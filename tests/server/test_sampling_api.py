"""The sampling fields of issue 13 through the official openai client, on a tiny real model.

References: the offline API (kvfit.LLM, same model and settings) for what the engine does with a
SamplingParams (the server must map each field onto it as vLLM's server does), and transformers
(fp32 log_softmax) for logprob values.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvfit import SamplingParams

MODEL = "tiny"
PROMPT = "Hello, my name is"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the log-distribution of the token after ids[:i + 1]."""
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def offline_outputs(offline, prompt, **params):
    return offline.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs


# n ---------------------------------------------------------------------------------------------
def test_n_seeded_choices_equal_offline_and_usage_sums_them(tiny_client, offline):
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=7, max_tokens=8, temperature=1.0)
    ref = offline_outputs(offline, PROMPT, n=3, seed=7, max_tokens=8, temperature=1.0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [o.text for o in ref]
    assert len({c.text for c in resp.choices}) == 3
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in ref)


def test_n_streamed_chunks_name_their_choice(tiny_client):
    full = tiny_client.completions.create(model=MODEL, prompt=PROMPT, n=2, seed=3, max_tokens=6, temperature=1.0)
    chunks = list(tiny_client.completions.create(model=MODEL, prompt=PROMPT, n=2, seed=3, max_tokens=6, temperature=1.0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = list(tiny_client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=3, stream=True))
    assert {c.choices[0].index for c in chat} == {0, 1}


# logprobs ----------------------------------------------------------------------------------------
def test_completion_logprobs_equal_transformers(tiny_client, offline, hf):
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    _, tok = hf
    prompt_ids = tok(PROMPT)["input_ids"]
    # the generated ids (re-encoding the text need not give them back): greedy offline is the same run
    out_ids = offline_outputs(offline, PROMPT, max_tokens=5, temperature=0)[0].token_ids
    ref = hf_logprobs(hf, prompt_ids + out_ids)
    assert len(lp.token_logprobs) == len(out_ids) == 5
    for i, (token_logprob, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(prompt_ids) - 1 + i]
        assert math.isclose(token_logprob, row[out_ids[i]].item(), abs_tol=1e-3)
        assert math.isclose(token_logprob, row.max().item(), abs_tol=1e-3)        # greedy: the chosen is the top
        expected = row.topk(3).values.tolist()
        # tokens whose texts coincide share one key, so compare values, not their count
        assert all(any(math.isclose(v, e, abs_tol=1e-3) for e in expected) for v in top.values()), (top, expected)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_logprobs_gives_the_prompt_and_its_logprobs(tiny_client, hf):
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True)
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT)                 # the prompt as sent (its bos is a token, not text)
    _, tok = hf
    prompt_ids = tok(PROMPT)["input_ids"]
    ref = hf_logprobs(hf, prompt_ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None      # the first token has no context
    for i in range(1, len(prompt_ids)):
        assert math.isclose(lp.token_logprobs[i], ref[i - 1, prompt_ids[i]].item(), abs_tol=1e-3)
    assert len(lp.tokens) == len(prompt_ids) + 2


def test_chat_logprobs_and_top_logprobs(tiny_client, hf):
    resp = tiny_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)   # greedy
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))


# sampling fields map onto SamplingParams as offline -----------------------------------------------
@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.5}, {"presence_penalty": 1.5, "frequency_penalty": 1.0}, {"min_p": 1.0},
    {"min_tokens": 6, "stop_token_ids": [2]}, {"logit_bias": {"42": 100}}, {"bad_words": ["the"]},
], ids=["repetition", "presence-frequency", "min-p", "min-tokens", "logit-bias", "bad-words"])
def test_sampling_fields_equal_offline(tiny_client, offline, fields):
    extra = {k: v for k, v in fields.items() if k not in ("presence_penalty", "frequency_penalty", "logit_bias")}
    std = {k: v for k, v in fields.items() if k not in extra}
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=5,
                                     extra_body=extra, **std)
    params = {**fields, "logit_bias": {int(k): v for k, v in fields["logit_bias"].items()}} \
        if "logit_bias" in fields else fields
    ref = offline_outputs(offline, PROMPT, max_tokens=8, temperature=0.8, seed=5, **params)[0]
    assert resp.choices[0].text == ref.text
    if "logit_bias" in fields:
        assert ref.token_ids == [42] * 8


SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]}},
          "required": ["color"], "additionalProperties": False}


def test_response_format_json_schema_is_obeyed(tiny_client):
    for seed in range(3):
        resp = tiny_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        assert resp.choices[0].finish_reason == "stop"        # the grammar ended it (a random model: much whitespace)
        assert json.loads(resp.choices[0].message.content)["color"] in ("red", "green")
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, temperature=1.0, seed=0,
                                     extra_body={"response_format": {"type": "json_object"}})   # vLLM's extension
    assert isinstance(json.loads(resp.choices[0].text), dict)


def test_structured_outputs_regex_and_choice(tiny_client):
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"regex": "[ab]{3}"}})
    assert len(resp.choices[0].text) == 3 and set(resp.choices[0].text) <= {"a", "b"}
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].text in ("yes", "no")


def test_prompt_logprobs_in_vllms_shape(tiny_client, hf):
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 1})
    _, tok = hf
    prompt_ids = tok(PROMPT)["input_ids"]
    ref = hf_logprobs(hf, prompt_ids)
    positions = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for i in range(1, len(prompt_ids)):
        entry = positions[i][str(prompt_ids[i])]
        assert math.isclose(entry["logprob"], ref[i - 1, prompt_ids[i]].item(), abs_tol=1e-3)
        assert entry["rank"] >= 1


def test_include_stop_str_in_output_equals_offline(tiny_client, offline):
    ref = offline_outputs(offline, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)[0].text
    stop = ref[3:5]
    for include in (False, True):
        resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        expected = offline_outputs(offline, PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,),
                                   include_stop_str_in_output=include)[0]
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == (expected.text, "stop")
        assert resp.choices[0].text.endswith(stop) is include


def test_streamed_chat_logprobs_cover_every_token(tiny_client):
    chunks = list(tiny_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True,
                                                 stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 5
    assert all(len(e.top_logprobs) == 1 for e in entries)


@pytest.mark.parametrize("fields", [{"allowed_token_ids": [40, 41, 42]}, {"skip_special_tokens": False},
                                    {"spaces_between_special_tokens": False}],
                         ids=["allowed-token-ids", "skip-special-tokens", "spaces-between-special-tokens"])
def test_more_vllm_fields_equal_offline(tiny_client, offline, fields):
    resp = tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=2,
                                     extra_body={"ignore_eos": True, **fields})
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    ref = offline_outputs(offline, PROMPT, max_tokens=6, temperature=1.0, seed=2, ignore_eos=True, **params)[0]
    assert resp.choices[0].text == ref.text
    if "allowed_token_ids" in fields:
        assert set(ref.token_ids) <= {40, 41, 42}


def test_chat_continue_final_message_and_echo(tiny_client, offline):
    messages = MESSAGES + [{"role": "assistant", "content": "Hi! I am"}]
    resp = tiny_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                      "echo": True})
    tokenizer = offline.get_tokenizer()
    ids = tokenizer.apply_chat_template(messages, False, continue_final_message=True, tokenize=True)
    assert resp.usage.prompt_tokens == len(ids)
    ref = offline_outputs(offline, ids, max_tokens=4, temperature=0)[0]
    assert resp.choices[0].message.content == "Hi! I am" + ref.text        # echo: the open message first


def test_continuous_usage_stats_in_every_chunk(tiny_client):
    chunks = list(tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[-1] == 3 and counts == sorted(counts) and all(c.usage is not None for c in chunks)


def test_continuous_usage_counts_each_choice_own_tokens(tiny_client):
    # vLLM: a choice's chunk carries that choice's completion tokens, never the sum over n (which passed max_tokens)
    chunks = list(tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.8, seed=1,
                                                 n=2, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    per_choice = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        per_choice.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert sorted(per_choice) == [0, 1]
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[-1] == 3, per_choice
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_streamed_echo_with_logprobs_equals_the_full_response(tiny_client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    full = tiny_client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in tiny_client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == full.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == full.logprobs.token_logprobs and streamed[0] is None
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == full.logprobs.text_offset
