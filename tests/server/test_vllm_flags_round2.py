"""vLLM's front-end flags on a running server (FrontendOptions, as `kvfit serve` builds them from its flags):
CORS as vLLM installs it (a preflight needs no key), no FastAPI docs, X-Request-Id headers, usage forced into
streams and with prompt_tokens_details (the prefix cache's tokens, on the tiny llama), logprobs tokens as
token ids, the openai chat content format, and --override-generation-config over the generation config."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from fake_engine import FakeEngine
from server_testing import make_engine, running_server
from kvfit.errors import ConfigError
from kvfit.server.frontend import FrontendOptions
from kvfit.server.launch import GuardOptions, startup_warnings

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFLIGHT = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def events(response: httpx.Response) -> list:
    """The SSE data events of a stream, [DONE] included."""
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in response.text.splitlines() if line.startswith("data: ")]


# CORS, docs, request ids ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed():
    """The default front-end (vLLM's defaults), an API key and a key on /metrics."""
    with running_server(FakeEngine(), "fake", api_key=KEY, metrics_require_key=True,
                        max_body_bytes=4096) as (url, _):
        yield url


def test_cors_is_on_by_default_and_a_preflight_needs_no_key(keyed):
    for path in ("/v1/chat/completions", "/v1/completions", "/metrics"):
        r = httpx.options(f"{keyed}{path}", headers=PREFLIGHT)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.get(f"{keyed}/v1/models", headers={**AUTH, "Origin": "http://page.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_cors_keeps_the_key_health_streams_and_body_limits(keyed):
    origin = {"Origin": "http://page.example"}
    assert httpx.get(f"{keyed}/v1/models", headers=origin).status_code == 401
    assert httpx.get(f"{keyed}/health", headers=origin).status_code == 200
    r = httpx.post(f"{keyed}/v1/completions", headers={**AUTH, **origin},
                   json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "".join(e["choices"][0]["text"] for e in events(r)[:-1]) == "abc"
    r = httpx.post(f"{keyed}/v1/completions", headers={**AUTH, **origin}, json={"prompt": "x" * 5000})
    assert r.status_code == 413


def test_without_a_key_the_start_up_warning_names_web_pages_when_any_origin_may_call():
    [line] = startup_warnings("127.0.0.1", None, key_on_command_line=False, any_origin=True)
    assert "any web page open in a browser" in line and "--allowed-origins" in line
    [line] = startup_warnings("127.0.0.1", None, key_on_command_line=False, any_origin=False)
    assert "web page" not in line
    assert startup_warnings("127.0.0.1", "k", key_on_command_line=False, any_origin=True) == []


def test_allowed_origins_and_credentials_are_honoured():
    options = FrontendOptions(allowed_origins=["http://app.example"], allow_credentials=True)
    with running_server(FakeEngine(), "fake", frontend=options) as (url, _):
        ok = httpx.options(f"{url}/v1/completions", headers={**PREFLIGHT, "Origin": "http://app.example"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert httpx.options(f"{url}/v1/completions", headers=PREFLIGHT).status_code == 400
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://page.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_fastapi_docs_are_served(keyed):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{keyed}{path}").status_code == 404


def test_request_id_headers():
    with running_server(FakeEngine(), "fake", api_key=KEY,
                        frontend=FrontendOptions(enable_request_id_headers=True)) as (url, _):
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 1})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        r = httpx.post(f"{url}/v1/completions", headers={**AUTH, "X-Request-Id": "mine-1"},
                       json={"prompt": "hi", "max_tokens": 1, "stream": True})
        assert r.headers["x-request-id"] == "mine-1"
        assert httpx.get(f"{url}/v1/models").headers["x-request-id"]          # a 401 too
        assert httpx.get(f"{url}/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"


def test_no_request_id_header_by_default(keyed):
    assert "x-request-id" not in httpx.get(f"{keyed}/health", headers={"X-Request-Id": "h"}).headers


# usage --------------------------------------------------------------------------------------------
def test_force_include_usage_puts_usage_in_every_stream():
    with running_server(FakeEngine(), "fake", frontend=FrontendOptions(enable_force_include_usage=True),
                        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") as (url, _):
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for options in ({}, {"stream_options": {"include_usage": False}}):
                r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2, "stream": True, **options})
                chunks = events(r)[:-1]
                assert chunks[-1]["choices"] == []
                assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
                assert all(c["usage"] is not None for c in chunks)      # continuous usage, as vLLM forces it
            full = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2}).json()
            assert full["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def llama_details(tiny_llama):
    """The tiny llama (prefix caching on) with --enable-prompt-tokens-details."""
    engine = make_engine(tiny_llama)
    try:
        with running_server(engine, "tiny", frontend=FrontendOptions(enable_prompt_tokens_details=True)) as (url, _):
            yield url
    finally:
        engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_prompt_tokens_details_count_the_prefix_cache(llama_details, chat, stream):
    # a prompt of a few blocks of 16 tokens, unique to this case: the second request reads the first's blocks
    text = f"case {chat} {stream}: " + "the quick brown fox jumps over the lazy dog " * 2
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}) if chat
                  else ("/v1/completions", {"prompt": text}))
    body = {**body, "max_tokens": 2, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    usages = []
    for _ in range(2):
        r = httpx.post(f"{llama_details}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(events(r)[-2]["usage"] if stream else r.json()["usage"])
    first = usages[0]["prompt_tokens_details"]
    if not chat:                 # nothing cached yet: null, as vLLM (a chat shares the template's first block)
        assert first is None
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and (first or {"cached_tokens": 0})["cached_tokens"] < cached < usages[1]["prompt_tokens"]


def test_no_prompt_tokens_details_by_default(keyed):
    r = httpx.post(f"{keyed}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 1})
    assert "prompt_tokens_details" not in r.json()["usage"]


# logprobs as token ids ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_ids_server():
    with running_server(FakeEngine(), "fake", frontend=FrontendOptions(return_tokens_as_token_ids=True),
                        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") as (url, _):
        yield url


A, B = ord("a"), ord("b")


def test_completions_logprobs_tokens_are_token_ids(token_ids_server):
    r = httpx.post(f"{token_ids_server}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{A}", f"token_id:{B}"]
    assert lp["top_logprobs"][0] == {f"token_id:{A}": -0.1}
    assert lp["text_offset"] == [0, len(f"token_id:{A}")]        # vLLM's offsets: the shown tokens' lengths
    r = httpx.post(f"{token_ids_server}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 2, "logprobs": 1, "stream": True})
    # a stream may fold outputs that waited into one event (RequestStream.next): the tokens in order, however split
    assert [t for e in events(r)[:-1] for t in e["choices"][0]["logprobs"]["tokens"]] == [f"token_id:{A}",
                                                                                           f"token_id:{B}"]


def test_chat_logprobs_tokens_are_token_ids(token_ids_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
    entry = httpx.post(f"{token_ids_server}/v1/chat/completions", json=body).json()["choices"][0]["logprobs"][
        "content"][0]
    assert entry["token"] == f"token_id:{A}" and entry["bytes"] == [A]      # the chosen token's bytes: its text's
    assert [t["token"] for t in entry["top_logprobs"]] == [f"token_id:{A}", f"token_id:{B}"]
    assert entry["top_logprobs"][1]["bytes"] == list(f"token_id:{B}".encode())
    chunks = events(httpx.post(f"{token_ids_server}/v1/chat/completions", json={**body, "stream": True}))
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks[:-1] if c["choices"][0]["logprobs"]] \
        == [f"token_id:{A}"]


def test_the_request_field_wins_over_the_flag(token_ids_server, keyed):
    body = {"prompt": "hi", "max_tokens": 1, "logprobs": 0}
    off = httpx.post(f"{token_ids_server}/v1/completions", json={**body, "return_tokens_as_token_ids": False})
    assert off.json()["choices"][0]["logprobs"]["tokens"] == ["a"]
    on = httpx.post(f"{keyed}/v1/completions", headers=AUTH, json={**body, "return_tokens_as_token_ids": True})
    assert on.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{A}"]


# chat content format ------------------------------------------------------------------------------
PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.content is string %}S:{{ m.content }}"
                  "{% else %}{% for p in m.content %}<{{ p.type }}:{{ p.text }}>{% endfor %}{% endif %}{% endfor %}")
MESSAGES = [{"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
             "tool_call_id": "c1"},
            {"role": "assistant", "content": None}]


def rendered(url: str, messages: list[dict]) -> str:
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    return "".join(chr(t) for t in r.json()["tokens"])      # the fake tokenizer: a token per character


@pytest.mark.parametrize("content_format, expected", [
    ("openai", "[system]<text:sys>[user]<text:Hi><text:there>[tool]S:r1\nr2[assistant]"),
    ("string", "[system]S:sys[user]S:Hi\nthere[tool]S:r1\nr2[assistant]S:"),
    # auto: vLLM's detection: this template loops over a message's content, so openai
    ("auto", "[system]<text:sys>[user]<text:Hi><text:there>[tool]S:r1\nr2[assistant]"),
])
def test_chat_template_content_format(content_format, expected):
    options = FrontendOptions(chat_template_content_format=content_format)
    with running_server(FakeEngine(), "fake", chat_template=PARTS_TEMPLATE, frontend=options) as (url, _):
        assert rendered(url, MESSAGES) == expected


def test_openai_format_continues_and_echoes_the_last_text_part():
    options = FrontendOptions(chat_template_content_format="openai")
    with running_server(FakeEngine(), "fake", chat_template=PARTS_TEMPLATE, frontend=options) as (url, _):
        parts = [{"type": "text", "text": "Sure"}, {"type": "text", "text": "thing"}]
        messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": parts}]
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                "continue_final_message": True})
        assert "".join(map(chr, r.json()["tokens"])) == "[user]<text:x>[assistant]<text:Sure><text:thing"
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": messages, "max_tokens": 1, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True})
        assert r.json()["choices"][0]["message"]["content"] == "Sure\nthinga"


def test_a_bad_content_format_is_refused():
    with pytest.raises(ConfigError, match="--chat-template-content-format must be one of auto, string, openai"):
        FrontendOptions(chat_template_content_format="jinja")


# --override-generation-config ---------------------------------------------------------------------
class RecordingEngine(FakeEngine):
    """A FakeEngine whose model has generation-config defaults; it records each request's params."""

    def __init__(self, defaults: dict, generation_config: str):
        super().__init__()
        self.default_sampling_params = defaults
        self.config.model.generation_config = generation_config
        self.seen = []

    def add_request(self, prompt, params, request_id, strict_context=False, cache_salt=None):
        self.seen.append(params)
        return super().add_request(prompt, params, request_id, strict_context, cache_salt)


def test_overrides_merge_over_the_models_generation_config():
    engine = RecordingEngine({"temperature": 0.6, "top_p": 0.9, "top_k": 20}, "auto")
    overrides = {"temperature": 0.2, "top_p": None, "max_new_tokens": 3}
    with running_server(engine, "fake", frontend=FrontendOptions(override_generation_config=overrides)) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.json()["choices"][0]["text"] == "abc"    # max_new_tokens caps a request's own (vLLM's override_max_tokens)
        seen = engine.seen[-1]
        assert (seen.temperature, seen.top_p, seen.top_k) == (0.2, 1.0, 20)    # top_p: null removed the model's
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "temperature": 1.0})
        assert engine.seen[-1].temperature == 1.0


def test_with_generation_config_vllm_the_overrides_are_the_only_defaults():
    engine = RecordingEngine({}, "vllm")
    options = FrontendOptions(override_generation_config={"max_new_tokens": 3, "min_p": 0.05})
    with running_server(engine, "fake", frontend=options,
                        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["choices"][0]["message"]["content"] == "abc"    # chat's max_tokens default: max_new_tokens
        assert engine.seen[-1].min_p == 0.05 and engine.seen[-1].temperature == 1.0


@pytest.mark.parametrize("overrides, needle", [
    ({"do_sample": True}, "has no field 'do_sample'"),
    ({"max_tokens": 5}, "max_new_tokens"),
    ({"temperature": -1}, "'temperature' must be a finite number >= 0, got -1"),
    ([1], "must be a JSON object"),
])
def test_bad_overrides_are_one_line_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        FrontendOptions(override_generation_config=overrides)
    assert "\n" not in str(info.value)


def test_guards_still_come_first():
    # a loopback bind refuses a foreign Host before CORS or a handler sees the request
    with running_server(FakeEngine(), "fake", guards=GuardOptions("127.0.0.1")) as (url, _):
        r = httpx.options(f"{url}/v1/completions", headers={**PREFLIGHT, "Host": "evil.example"})
        assert r.status_code == 403


def test_empty_stream_options_pass_without_stream_as_in_vllm(keyed):
    """vLLM refuses stream_options without stream only when the object is not empty (its check reads the dict's
    truth); {} is ignored."""
    url, headers = keyed, {"Authorization": f"Bearer {KEY}"}
    body = {"model": "fake", "prompt": "Hi", "max_tokens": 2, "stream_options": {}}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30).status_code == 200
    for options in ({"include_usage": True}, {"include_usage": None}, {"other": 1}):
        body["stream_options"] = options
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", options
