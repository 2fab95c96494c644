"""The OpenAI API end to end: the official client against a server in this process, a tiny model.

Greedy output must equal the offline API's (kvfit.LLM, same model and settings) text for text and
token count for token count; every bad request gets OpenAI's error JSON with the right status.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from kvfit import SamplingParams
from server_testing import (ENGINE_KWARGS, assert_blocks_balanced, completion_text, make_engine, openai_error,
                            running_server, scrape, wait_for_drain)

MODEL = "tiny-llama"
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["Hello, my name is", "The capital of France is", [5, 17, 42, 99, 7, 64]]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(tiny_llama)
    try:
        with running_server(engine, MODEL, api_key=KEY) as (url, _):
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=30)


def reference(offline, prompt, **params):
    return offline.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def chat_prompt(offline, messages):
    # token ids as transformers' apply_chat_template(tokenize=True): no special tokens added to the rendered text
    return offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


# happy paths ------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server}/health").status_code == 200          # open without a key


@pytest.mark.parametrize("prompt", PROMPTS, ids=["text", "text2", "token-ids"])
def test_greedy_completion_equals_offline(client, offline, prompt):
    ref = reference(offline, prompt, temperature=0, max_tokens=12)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)
    assert resp.object == "text_completion" and resp.model == MODEL


def test_streamed_completion_equals_offline_with_usage(client, offline):
    prompt = PROMPTS[0]
    ref = reference(offline, prompt, temperature=0, max_tokens=16, ignore_eos=True)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_greedy_chat_equals_offline_through_the_chat_template(client, offline):
    ref = reference(offline, chat_prompt(offline, MESSAGES), temperature=0, max_tokens=12)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12,
                                                   temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == ref.outputs[0].text
    assert streamed[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_max_tokens_gives_length_and_max_completion_tokens_wins_for_chat(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50, max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_and_finish_with_stop(client, offline, stream):
    ref = reference(offline, PROMPTS[0], temperature=0, max_tokens=24, ignore_eos=True)
    # a stop string taken from the middle of the greedy text: the output must end just before it
    at = next((i for i in range(4, len(ref.outputs[0].text) - 2) if ref.outputs[0].text[i:i + 2].strip()), None)
    if at is None:
        pytest.skip(f"greedy text too short to pick a stop string: {ref.outputs[0].text!r}")
    stop = ref.outputs[0].text[at:at + 2]
    expected = ref.outputs[0].text[:ref.outputs[0].text.find(stop)]
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                  extra_body={"ignore_eos": True})
    assert completion_text(client, stream, **kwargs) == (expected, "stop")


def test_seeded_sampling_repeats_and_equals_offline(client, offline):
    ref = reference(offline, PROMPTS[1], temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    texts = {client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=1.0, top_p=0.9, seed=1234,
                                       max_tokens=10).choices[0].text for _ in range(2)}
    assert texts == {ref.outputs[0].text}


def test_a_client_that_closes_its_stream_frees_its_blocks(server, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=100, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert scrape(server)['kvfit_kv_blocks{state="used"}'] > 0
    stream.close()
    m = wait_for_drain(server, timeout_s=10)
    assert_blocks_balanced(m)
    assert m['kvfit_requests_finished_total{finish_reason="abort"}'] >= 1


def test_metrics_exposes_the_cache_and_latency_series(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, extra_body={"ignore_eos": True})
    m = scrape(server)
    assert m["kvfit_kv_blocks_total"] == ENGINE_KWARGS["num_gpu_blocks_override"]
    assert m["kvfit_token_capacity"] == ENGINE_KWARGS["num_gpu_blocks_override"] * ENGINE_KWARGS["block_size"]
    for name in ("kvfit_requests_running", "kvfit_requests_waiting", "kvfit_preemptions_total",
                 "kvfit_prefix_cache_hit_rate"):
        assert name in m
    assert 0 <= m["kvfit_prefix_cache_hit_rate"] <= 1
    assert m["kvfit_time_to_first_token_seconds_count"] >= 1
    assert m["kvfit_time_per_output_token_seconds_count"] >= 1


# bad requests -----------------------------------------------------------------------------------
LONG_PROMPT = list(range(10, 10 + ENGINE_KWARGS["max_model_len"]))
BAD_COMPLETIONS = {
    "prompt-too-long": ({"prompt": LONG_PROMPT}, "prompt"),
    "prompt-plus-max-tokens-too-long": ({"prompt": [5] * 100, "max_tokens": 40}, "max_tokens"),
    "max-tokens-zero": ({"max_tokens": 0}, "max_tokens"),
    "max-tokens-float": ({"max_tokens": 1.5}, "max_tokens"),
    "temperature-negative": ({"temperature": -0.1}, "temperature"),
    "temperature-tiny": ({"temperature": 1e-300}, "temperature"),
    "temperature-above-two": ({"temperature": 2.5}, "temperature"),          # vLLM's [0, 2]
    "too-many-prompts": ({"prompt": ["a"] * 1025}, "prompt"),                # vLLM's VLLM_MAX_COMPLETION_PROMPTS
    "json-schema-without-name": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                                 "response_format"),
    # vLLM 0.26 fields it acts on, kvfit does not implement: refused, never silently dropped
    "logprob-token-ids": ({"logprobs": 2, "logprob_token_ids": [3, 4]}, "logprob_token_ids"),
    "repetition-detection": ({"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
    "thinking-token-budget": ({"thinking_token_budget": 10}, "thinking_token_budget"),
    "prompt-embeds": ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    "top-p-zero": ({"top_p": 0}, "top_p"),
    "top-p-above-one": ({"top_p": 1.01}, "top_p"),
    "n-zero": ({"n": 0}, "n"),
    "prompt-wrong-type": ({"prompt": 12}, "prompt"),
    "token-id-out-of-vocab": ({"prompt": [1, 10**9]}, None),
    "empty-stop": ({"stop": [""]}, "stop"),
    "missing-prompt": ({"prompt": None}, "prompt"),
    "model-wrong-type": ({"model": 5}, "model"),
}


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=list(BAD_COMPLETIONS))
def test_bad_completion_requests_get_400(server, case):
    fields, param = BAD_COMPLETIONS[case]
    body = {k: v for k, v in {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}.items() if v is not None}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = openai_error(r)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("body", [{"model": MODEL}, {"model": MODEL, "messages": []},
                                  {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                                  {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}],
                         ids=["no-messages", "empty-messages", "bad-role", "zero-max-completion-tokens"])
def test_bad_chat_requests_get_400(server, body):
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    openai_error(r)


def test_add_special_tokens_false_tokenizes_a_completions_prompt_as_it_is(server):
    """add_special_tokens false: no bos before a text prompt (a client that rendered its own template sends its
    own); it was read and then ignored (the bos came twice)."""
    def prompt_ids(**extra):
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 1, "return_token_ids": True, **extra}
        r = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_token_ids"]
    with_bos, plain = prompt_ids(), prompt_ids(add_special_tokens=False)
    assert len(with_bos) == len(plain) + 1 and with_bos[1:] == plain
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": "hello world", "add_special_tokens": False},
                   headers=AUTH)
    assert r.json()["tokens"] == plain


@pytest.mark.parametrize("field,value", [("return_prompt_text", True), ("return_assistant_tokens_mask", True),
                                         ("media_io_kwargs", {"image": {"x": 1}})])
def test_chat_fields_vllm_acts_on_are_refused(server, field, value):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and openai_error(r)["param"] == field, r.text
    r = httpx.post(f"{server}/v1/chat/completions", json=dict(body, **{field: None}), headers=AUTH)
    assert r.status_code == 200, r.text


def test_a_role_the_chat_template_rejects_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:      # the tiny template knows system/user/assistant
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    assert info.value.body["param"] == "messages" and "unknown role" in info.value.body["message"]


def test_chat_on_a_model_without_a_chat_template_is_400(tiny_llama, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = make_engine(str(folder))
    try:
        with running_server(engine, MODEL) as (url, _):
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            assert info.value.body["code"] == "no_chat_template"
            assert "chat_template" in info.value.body["message"] and "/v1/completions" in info.value.body["message"]
            assert c.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.prompt_tokens > 0
    finally:
        engine.shutdown()


def test_the_official_client_sees_the_400_message(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    assert "--max-model-len" in info.value.body["message"]


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["type"] == "NotFoundError" and info.value.body["param"] == "model"   # vLLM's body
    assert info.value.body["code"] == 404
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}, headers=AUTH)
    assert r.status_code == 404 and openai_error(r)["message"].startswith("The model `nope` does not exist.")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", "{\"model\": \"\xff\"}".encode("latin-1"),
                                 b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}'],
                         ids=["malformed", "not-an-object", "empty", "not-utf8", "nan"])
def test_malformed_json_is_400(server, raw):
    r = httpx.post(f"{server}/v1/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert openai_error(r)["code"] == "invalid_json"


def test_a_body_over_the_limit_is_413(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * (1 << 20)}).encode()
    r = httpx.post(f"{server}/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert openai_error(r)["code"] == "request_too_large"

    def chunked():                   # no Content-Length: the limit is counted while reading
        for _ in range(20):
            yield b"x" * 65536
    r = httpx.post(f"{server}/v1/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413


def test_a_missing_or_wrong_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            method = httpx.get if path == "/v1/models" else httpx.post
            r = method(f"{server}{path}", headers=headers, **({} if method is httpx.get else {"json": {}}))
            assert r.status_code == 401, (path, headers, r.text)
            assert openai_error(r)["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(f"{server}/metrics").status_code == 200


def test_unknown_routes_are_openai_style_404(server):
    r = httpx.get(f"{server}/v1/nothing", headers=AUTH)
    assert r.status_code == 404
    openai_error(r)


def test_the_prompts_limit_reads_vllms_variable(monkeypatch):
    from kvfit.server.params import DEFAULT_MAX_COMPLETION_PROMPTS, max_completion_prompts
    for value, want in (("5", 5), ("", DEFAULT_MAX_COMPLETION_PROMPTS), ("\u00b2", DEFAULT_MAX_COMPLETION_PROMPTS),
                        ("0", DEFAULT_MAX_COMPLETION_PROMPTS), ("x", DEFAULT_MAX_COMPLETION_PROMPTS)):
        monkeypatch.setenv("VLLM_MAX_COMPLETION_PROMPTS", value)
        assert max_completion_prompts() == want
