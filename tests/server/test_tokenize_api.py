"""/tokenize, /detokenize and chat prompts on a tiny real model, against transformers.

The server runs with --chat-template set to a template that writes `{{ bos_token }}` itself: the
chat prompt's token count (usage.prompt_tokens, /tokenize's count) equals transformers'
apply_chat_template(tokenize=True), one bos; chat_template_kwargs reach the template.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvfit.text.chat_template import load_chat_template
from server_testing import make_engine, openai_error, running_server
from test_chat_rendering import BOS_TEMPLATE

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How"},
            {"role": "user", "content": "What's 2+2?"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(tiny_llama)
    try:
        with running_server(engine, MODEL, chat_template=load_chat_template(BOS_TEMPLATE)) as (url, _):
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def hf_chat_ids(hf, messages, **kwargs) -> list[int]:
    kwargs.setdefault("add_generation_prompt", True)
    return list(hf.apply_chat_template(messages, chat_template=BOS_TEMPLATE, tokenize=True, **kwargs)["input_ids"])


def test_chat_prompt_tokens_equal_transformers_one_bos(client, hf):
    expected = hf_chat_ids(hf, MESSAGES)
    assert expected.count(hf.bos_token_id) == 1
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens == len(expected)
    thinking = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens == len(hf_chat_ids(hf, MESSAGES, enable_thinking=True))


def test_tokenize_a_chat_equals_transformers(server, hf):
    for body, kwargs in [({}, {}), ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
                         ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                         ({"add_generation_prompt": False, "continue_final_message": True},
                          {"add_generation_prompt": False, "continue_final_message": True})]:
        messages = MESSAGES[:2] if body.get("continue_final_message") else MESSAGES
        r = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages, **body})
        assert r.status_code == 200, r.text
        expected = hf_chat_ids(hf, messages, **kwargs)
        assert r.json() == {"count": len(expected), "max_model_len": 128, "tokens": expected, "token_strs": None}


def test_tokenize_and_detokenize_a_prompt(server, hf):
    text = "Hello, my name is"
    r = httpx.post(f"{server}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == hf(text)["input_ids"] and r["tokens"][0] == hf.bos_token_id
    assert r["token_strs"] == hf.convert_ids_to_tokens(r["tokens"])
    plain = httpx.post(f"{server}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == r["tokens"][1:]
    back = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": hf.decode(r["tokens"])} and back["prompt"].startswith("<s>")


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"prompt": "a", "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
])
def test_bad_token_requests(server, path, body, param):
    r = httpx.post(f"{server}{path}", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert openai_error(r)["param"] == param


def test_bad_chat_options_are_400(client):
    cases = [({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
             ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param
