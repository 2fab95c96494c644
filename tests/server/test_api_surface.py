"""The API surface a vLLM client expects, on the fake engine (no model): /version, several served
model names and vLLM's 404, unknown fields (served, with a warning naming them), fields kvfit knows
but does not honour (a 400 naming them), metrics under vLLM's names, the access and stats lines.
"""

from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest

import kvfit
from fake_engine import FakeEngine
from kvfit.server.logs import StatsLogger
from kvfit.server.metrics import ServerMetrics
from server_testing import openai_error, running_server, scrape

NAMES = ["first-name", "second-name"]
LABELS = '{engine="0",model_name="first-name"}'


@pytest.fixture(scope="module")
def server():
    with running_server(FakeEngine(), NAMES, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") \
            as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=30)


def test_version(server):
    assert httpx.get(f"{server}/version").json() == {"version": kvfit.__version__}


def test_every_served_name_is_listed_and_accepted_and_the_first_is_reported(server, client):
    assert [m.id for m in client.models.list().data] == NAMES
    assert client.models.retrieve("second-name").id == "second-name"
    for name in NAMES:
        resp = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert resp.model == "first-name" and resp.choices[0].text == "ab"
    # vLLM: model is optional
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "first-name"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models/other"])
def test_an_unknown_model_gets_vllms_404(server, path):
    body = {"model": "other", "prompt": "hi"}
    r = httpx.post(f"{server}{path}", json=body) if path.endswith("completions") else httpx.get(f"{server}{path}")
    assert r.status_code == 404
    error = openai_error(r)
    assert error["message"].startswith("The model `other` does not exist.")
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
    assert "'first-name', 'second-name'" in error["message"]


def test_unknown_fields_are_served_with_a_warning_naming_them(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="kvfit")
    resp = client.completions.create(model="first-name", prompt="hi", max_tokens=2,
                                     extra_body={"frobnicate": 1, "zz_top": {"a": 1}})
    assert resp.choices[0].text == "ab"
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: 'frobnicate', 'zz_top'"]


UNHONOURED = [("use_beam_search", True), ("best_of", 3), ("suffix", "x"),
              ("priority", 1), ("logits_processors", ["x"]),
              ("length_penalty", 0.5), ("guided_json", {"type": "object"}),
              ("guided_choice", ["a", "b"]), ("guided_regex", "a+"), ("vllm_xargs", {"a": 1})]


@pytest.mark.parametrize("field, value", UNHONOURED, ids=[f for f, _ in UNHONOURED])
def test_known_fields_kvfit_cannot_honour_are_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="first-name", prompt="hi", max_tokens=2, extra_body={field: value})
    assert info.value.body["param"] == field
    assert field in info.value.body["message"]
    if field.startswith("guided_"):
        assert "structured_outputs" in info.value.body["message"]


@pytest.mark.parametrize("field, value", [("chat_template", "{{ x }}"),
                                          ("documents", "not a list")])
def test_known_chat_fields_kvfit_cannot_honour_are_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="first-name", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={field: value})
    assert info.value.body["param"] == field


def test_neutral_values_of_unhonoured_fields_are_served(client):
    resp = client.completions.create(model="first-name", prompt="hi", max_tokens=2, best_of=1,
                                     extra_body={"use_beam_search": False, "length_penalty": 1.0, "priority": 0})
    assert resp.choices[0].text == "ab"


# metrics and logs --------------------------------------------------------------------------------
def test_metrics_under_vllms_names(server, client):
    before = scrape(server)
    client.completions.create(model="first-name", prompt="hello", max_tokens=4)
    m = scrape(server)

    def grew(name):
        return m[name] - before.get(name, 0.0)

    assert grew(f"vllm:prompt_tokens_total{LABELS}") == 5
    assert grew(f"vllm:generation_tokens_total{LABELS}") == 4
    assert grew(f"vllm:time_to_first_token_seconds_count{LABELS}") == 1
    assert grew(f"vllm:inter_token_latency_seconds_count{LABELS}") == 3      # one per step after the first
    assert grew(f"vllm:e2e_request_latency_seconds_count{LABELS}") == 1
    assert grew("vllm:request_success_total" + '{engine="0",finished_reason="length",model_name="first-name"}') == 1
    assert m[f"vllm:num_requests_running{LABELS}"] == 0 and m[f"vllm:num_requests_waiting{LABELS}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{LABELS}"] == 0
    # exact prefix-cache counters only behind the key (an open /metrics could confirm another user's prompt)
    assert not any(name.startswith("vllm:prefix_cache") for name in m)


def test_prefix_cache_counters_are_there_behind_the_key():
    with running_server(FakeEngine(), "fake", api_key="k", metrics_require_key=True) as (url, _):
        text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k"}).text
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="fake"} 0.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="fake"} 0.0' in text


def test_an_access_line_per_request(server, client, caplog):
    caplog.set_level(logging.INFO, logger="kvfit.access")
    client.completions.create(model="first-name", prompt="hello", max_tokens=3)
    list(client.completions.create(model="first-name", prompt="hey", max_tokens=2, stream=True))
    httpx.get(f"{server}/nowhere")
    deadline = time.monotonic() + 10      # a stream's line comes once the server has closed it
    while len(lines := [r.getMessage() for r in caplog.records if r.name == "kvfit.access"]) < 3:
        assert time.monotonic() < deadline, lines
        time.sleep(0.02)
    assert len(lines) == 3, lines
    full, streamed, missing = (next(x for x in lines if key in x) for key in ("prompt_tokens=5", "prompt_tokens=3",
                                                                            "/nowhere"))
    assert '"POST /v1/completions" 200 ' in full and full.endswith("prompt_tokens=5 output_tokens=3")
    assert streamed.endswith("prompt_tokens=3 output_tokens=2")
    assert '"GET /nowhere" 404 ' in missing and "prompt_tokens" not in missing
    assert full.startswith("127.0.0.1:")


def test_the_stats_line_reports_activity_and_is_quiet_when_idle():
    stats = {"kv_blocks_total": 64, "kv_blocks_free": 48, "kv_blocks_used": 16, "kv_blocks_cached": 0,
             "token_capacity": 1024, "running": 2, "waiting": 1, "preemptions": 0, "prefix_cache_queries": 100,
             "prefix_cache_hits": 25}
    metrics = ServerMetrics(lambda: stats)
    logger = StatsLogger(metrics, lambda: stats, interval_s=10)
    start = logger._last_time
    metrics.progress(200, 50, 0.1, None)
    assert logger.line(start + 10) == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 "
                                       "tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                                       "Prefix cache hit rate: 25.0%")
    stats.update(running=0, waiting=0, kv_blocks_used=0)
    assert logger.line(start + 20).startswith("Avg prompt throughput: 0.0 tokens/s")   # the interval after
    assert logger.line(start + 30) is None                                            # idle: quiet


def test_request_success_has_every_finish_reason_from_the_start():
    """vLLM creates vllm:request_success_total for each of its finish reasons at start-up (at 0)."""
    stats = {"kv_blocks_total": 64, "kv_blocks_free": 64, "kv_blocks_used": 0, "kv_blocks_cached": 0,
             "token_capacity": 1024, "running": 0, "waiting": 0, "preemptions": 0, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0}
    text = ServerMetrics(lambda: stats, model_name="m").render().decode()
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="m"}} 0.0' in text \
            or f'vllm:request_success_total{{model_name="m",engine="0",finished_reason="{reason}"}} 0.0' in text, reason


# chat messages ------------------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %};{% endfor %}{{ extra }}"


def test_message_history_fields_reach_the_template_and_unknown_ones_are_named(caplog):
    caplog.set_level(logging.WARNING, logger="kvfit")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r",
                                                   "mystery": 1}]
    with running_server(FakeEngine(), "fake", chat_template=TEMPLATE) as (url, _):
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"extra": "X", "zz": 1}})
    # the fake tokenizer has one token per character
    assert "".join(map(chr, r.json()["tokens"])) == "user:q;assistant:a(r);X"
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    assert "'messages[1].mystery'" in logged
    assert "chat_template_kwargs names variables the chat template does not read, so they do nothing: 'zz'" in logged


# n and logprobs end to end on the fake engine (its samples: 'ab', 'bc', ...; see FakeEngine._sample) ----
def test_n_choices_full_and_streamed_with_usage_summed(client):
    resp = client.completions.create(model="first-name", prompt="hi", max_tokens=2, n=3)
    assert [(c.index, c.text) for c in resp.choices] == [(0, "ab"), (1, "bc"), (2, "cd")]
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens == 2
    chunks = list(client.completions.create(model="first-name", prompt="hi", max_tokens=2, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: "ab", 1: "bc"} and chunks[-1].usage.completion_tokens == 4
    chat = list(client.chat.completions.create(model="first-name", messages=[{"role": "user", "content": "x"}],
                                               n=2, max_tokens=1, stream=True))
    assert [c.choices[0].delta.role for c in chat[:2]] == ["assistant", "assistant"]
    assert {c.choices[0].index for c in chat} == {0, 1}


def test_logprobs_shapes_through_the_client(client):
    lp = client.completions.create(model="first-name", prompt="hi", max_tokens=2, logprobs=1).choices[0].logprobs
    assert lp.tokens == ["a", "b"] and lp.token_logprobs == [-0.1, -0.1] and lp.text_offset == [0, 1]
    assert lp.top_logprobs == [{"a": -0.1}, {"b": -0.1}]        # the top 1 is the chosen token
    resp = client.chat.completions.create(model="first-name", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=1, logprobs=True, top_logprobs=2, n=2)
    second = resp.choices[1].logprobs.content[0]
    assert (second.token, second.logprob, second.bytes) == ("b", -0.2, [98])
    assert [(t.token, t.logprob) for t in second.top_logprobs] == [("b", -0.2), ("c", -1.2)]
