"""Request bodies to SamplingParams, as vLLM's OpenAI server maps them (no server, no model):
each field reaches its SamplingParams counterpart; bad values are a 400 naming the field."""

from __future__ import annotations

import pytest

from kvfit.server.params import chat_input, completion_inputs
from kvfit.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

def completion(**fields):
    return completion_inputs(CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields}))[0]


def chat(**fields):
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})
    return chat_input(body, [1, 2, 3], [{"role": "user", "content": "hi"}])


def expect(make, fields: dict, name: str, value):
    assert getattr(make(**fields).params, name) == value


@pytest.mark.parametrize("field, value", [("n", 3), ("presence_penalty", 0.5), ("frequency_penalty", -0.5),
                                          ("repetition_penalty", 1.3), ("min_p", 0.1), ("min_tokens", 4),
                                          ("include_stop_str_in_output", True), ("skip_special_tokens", False),
                                          ("spaces_between_special_tokens", False), ("prompt_logprobs", 2)])
def test_sampling_fields_reach_sampling_params(field, value):
    expect(completion, {field: value}, field, value)
    expect(chat, {field: value}, field, value)


def test_neutral_values_are_served_whatever_the_build():
    inp = completion(n=1, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, min_p=0, min_tokens=0,
                     skip_special_tokens=True, include_stop_str_in_output=False)
    assert inp.params.max_tokens == 16


def test_logit_bias_keys_become_token_ids():
    # JSON keys are strings; biases past [-100, 100] are clamped to it (vLLM's and OpenAI's rule)
    expect(completion, {"logit_bias": {"42": 5, "7": -100, "9": 250}}, "logit_bias", {42: 5.0, 7: -100.0, 9: 100.0})
    for bad in ({"x": 1}, {"-1": 1}):
        with pytest.raises(APIError) as info:
            completion(logit_bias=bad)
        assert info.value.param == "logit_bias"


def test_allowed_token_ids_and_bad_words():
    expect(completion, {"allowed_token_ids": [3, 5]}, "allowed_token_ids", (3, 5))
    expect(chat, {"bad_words": ["no"]}, "bad_words", ("no",))


def test_logprobs_counts():
    expect(completion, {"logprobs": 5}, "logprobs", 5)
    expect(completion, {"logprobs": 0}, "logprobs", 0)              # 0: the chosen token only, not "off"
    expect(chat, {"logprobs": True, "top_logprobs": 3}, "logprobs", 3)
    expect(chat, {"logprobs": True}, "logprobs", 0)
    assert completion().params == completion(logprobs=None).params
    for make, fields, param in [(completion, {"logprobs": 21}, "logprobs"), (chat, {"top_logprobs": 2}, "top_logprobs"),
                                (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                (completion, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                                (completion, {"prompt_logprobs": 21}, "prompt_logprobs")]:
        with pytest.raises(APIError) as info:
            make(**fields)
        assert info.value.param == param


def test_logprobs_counts_follow_the_engine_max_logprobs():
    from kvfit.server.params import RequestDefaults
    wide = RequestDefaults(max_logprobs=30)
    body = {"model": "m", "prompt": "hi", "logprobs": 25, "prompt_logprobs": 30}
    inp = completion_inputs(CompletionRequest.model_validate(body), wide)[0]
    assert (inp.params.logprobs, inp.params.prompt_logprobs) == (25, 30)
    chat_body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True, "top_logprobs": 31})
    with pytest.raises(APIError, match="--max-logprobs of 30") as info:
        chat_input(chat_body, [1, 2, 3], [{"role": "user", "content": "hi"}], wide)
    assert info.value.param == "top_logprobs"


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    inp = completion(echo=True, logprobs=2)
    assert inp.params.prompt_logprobs == 2 and inp.echo
    assert completion(echo=True).params.prompt_logprobs is None        # echo alone: the text only


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
])
def test_structured_outputs_and_response_format(fields, kind):
    for make in (completion, chat):
        constraint = make(**fields).params.structured_outputs
        assert getattr(constraint, kind) not in (None, False)


def test_bad_structured_outputs_are_400():
    cases = [({"response_format": {"type": "xml"}}, "response_format"),
             ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
             ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
             ({"structured_outputs": {}}, None)]
    for fields, param in cases:
        if param is None:             # an empty object asks for nothing
            assert getattr(completion(**fields).params, "structured_outputs", None) is None
            continue
        with pytest.raises(APIError) as info:
            completion(**fields)
        assert info.value.param == param, fields
    assert completion(response_format={"type": "text"}).params == completion().params
