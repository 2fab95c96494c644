"""Request fields read as vLLM 0.26 reads them: lax JSON types, echo with max_tokens 0 (a scorer's request),
top_logprobs 0 without logprobs, prompt_logprobs 0 on a stream."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "tiny"
PROMPT = "Hello, my name is"


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


@pytest.mark.parametrize("field, value", [("max_tokens", 4.0), ("n", 1.0), ("seed", 1.0), ("temperature", "0"),
                                          ("stream", "false"), ("logprobs", 2.0)])
def test_json_types_are_read_laxly_as_vllm_reads_them(tiny_server, field, value):
    strict = {"max_tokens": 4, "n": 1, "seed": 1, "temperature": 0, "stream": False, "logprobs": 2}
    base = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    got = _post(tiny_server, "/v1/completions", {**base, field: value})
    want = _post(tiny_server, "/v1/completions", {**base, field: strict[field]})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]


@pytest.mark.parametrize("field, value", [("max_tokens", 4.5), ("n", "two"), ("stream", "maybe")])
def test_values_that_no_lax_reading_fits_stay_400s(tiny_server, field, value):
    r = _post(tiny_server, "/v1/completions", {"prompt": PROMPT, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(tiny_server, stream):
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    scored = _post(tiny_server, "/v1/completions", {**body, "max_tokens": 3, "stream": False}).json()
    if stream:
        r = httpx.post(f"{tiny_server}/v1/completions", json={"model": MODEL, **body, "stream": True}, timeout=60)
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        token_logprobs = [lp for c in chunks if c["choices"][0]["logprobs"]
                          for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        r = _post(tiny_server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, token_logprobs, reason = choice["text"], choice["logprobs"]["token_logprobs"], choice["finish_reason"]
    assert text == PROMPT
    num_prompt = scored["usage"]["prompt_tokens"]
    assert token_logprobs == scored["choices"][0]["logprobs"]["token_logprobs"][:num_prompt]
    assert token_logprobs[0] is None and all(isinstance(lp, float) for lp in token_logprobs[1:])
    assert reason == "length"


def test_max_tokens_0_without_echo_stays_a_400(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_chat_top_logprobs_0_needs_no_logprobs_but_1_does(tiny_server):
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({"top_logprobs": 0}, {"top_logprobs": 0, "logprobs": False}):
        r = _post(tiny_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = _post(tiny_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "top_logprobs": 1})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_prompt_logprobs_0_passes_on_a_stream_1_does_not(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
    r = _post(tiny_server, "/v1/completions", {**body, "prompt_logprobs": 0})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    r = _post(tiny_server, "/v1/completions", {**body, "prompt_logprobs": 1})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                     "{% if enable_thinking is defined and enable_thinking %}<think:{{ reasoning_effort }}>{% endif %}")


@pytest.mark.parametrize("effort, kwargs, prompt", [
    (None, None, "hi"), ("high", None, "hi<think:high>"), ("none", None, "hi"),
    ("low", {"enable_thinking": False}, "hi"),          # the client's own enable_thinking stays
    ("medium", {"reasoning_effort": "x"}, "hi<think:medium>")])
def test_reasoning_effort_reaches_the_chat_template_as_vllm_gives_it(effort, kwargs, prompt):
    from fake_engine import FakeEngine
    from server_testing import running_server
    engine = FakeEngine(max_model_len=256)
    with running_server(engine, "tiny", chat_template=THINKING_TEMPLATE) as (url, _):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "reasoning_effort": effort,
                "chat_template_kwargs": kwargs}
        r = _post(url, "/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_an_unknown_reasoning_effort_is_a_400(tiny_server):
    r = _post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "reasoning_effort": "extreme"})
    assert r.status_code == 400 and "reasoning_effort" in r.text, r.text


def test_an_empty_tools_list_is_a_chat_400_but_tokenize_renders_it(tiny_server):
    messages = [{"role": "user", "content": "hi"}]
    r = _post(tiny_server, "/v1/chat/completions", {"messages": messages, "tools": [], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = _post(tiny_server, "/tokenize", {"messages": messages, "tools": []})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text


@pytest.mark.parametrize("field, value", [("use_beam_search", "false"), ("priority", "0"), ("length_penalty", "1"),
                                          ("best_of", 1.0)])
def test_neutral_values_of_unhonoured_fields_are_read_laxly(tiny_server, field, value):
    r = _post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, field: value})
    assert r.status_code == 200, r.text
    r = _post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "use_beam_search": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_parallel_tool_calls_is_read_laxly():
    from kvfit.server.protocol import APIError
    from kvfit.server.tools import tool_request
    import types
    body = types.SimpleNamespace(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice=None,
                                 parallel_tool_calls="false")
    assert tool_request(body).parallel is False
    with pytest.raises(APIError, match="parallel_tool_calls must be true or false"):
        tool_request(types.SimpleNamespace(**{**vars(body), "parallel_tool_calls": "sometimes"}))


def _ids(url: str, text: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()["tokens"]


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncate_prompt_tokens_keeps_the_last_tokens_or_the_first(tiny_server, side):
    text = "one two three four five six seven eight nine ten"
    ids = _ids(tiny_server, text)
    kept = ids[:4] if side == "right" else ids[-4:]               # vLLM's default for generative models: left
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": 4, "echo": True,
            **({"truncation_side": side} if side else {})}
    got = _post(tiny_server, "/v1/completions", body).json()
    want = _post(tiny_server, "/v1/completions", {"prompt": kept, "max_tokens": 4, "temperature": 0,
                                                  "echo": True}).json()
    assert got["usage"]["prompt_tokens"] == 4
    assert got["choices"][0]["text"] == want["choices"][0]["text"]          # echo shows the prompt it kept


def test_truncate_prompt_tokens_minus_1_and_its_limits(tiny_server):
    ids = list(range(5, 125))                                      # 120 tokens; the tiny server's max_model_len
    max_model_len = httpx.post(f"{tiny_server}/tokenize", json={"model": MODEL, "prompt": "x"},
                               timeout=30).json()["max_model_len"]
    long = (ids * (max_model_len // len(ids) + 1))[:max_model_len]
    r = _post(tiny_server, "/v1/completions", {"prompt": long, "max_tokens": 8, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == max_model_len - 8, r.text
    r = _post(tiny_server, "/v1/completions", {"prompt": long, "max_tokens": 8,
                                               "truncate_prompt_tokens": max_model_len - 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    for bad in (-2, 0):
        r = _post(tiny_server, "/v1/completions", {"prompt": long[:10], "max_tokens": 2, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text
    r = _post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c d e f g h"}],
                                                    "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_return_token_ids_on_completions_full_and_streamed(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "n": 2, "seed": 3, "return_token_ids": True,
            "ignore_eos": True}
    full = _post(tiny_server, "/v1/completions", body).json()
    prompt_ids = _ids(tiny_server, PROMPT)
    streamed: dict[int, list[int]] = {}
    firsts: dict[int, list[int]] = {}
    for chunk in _chunks(tiny_server, "/v1/completions", body):
        for c in chunk["choices"]:
            streamed.setdefault(c["index"], []).extend(c["token_ids"])
            if "prompt_token_ids" in c:
                assert c["index"] not in firsts
                firsts[c["index"]] = c["prompt_token_ids"]
    for choice in full["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids == firsts[choice["index"]]
        assert len(choice["token_ids"]) == 6 and streamed[choice["index"]] == choice["token_ids"]
    plain = _post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None     # vLLM: null when not asked for


def test_return_token_ids_on_chat_full_and_streamed(tiny_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    full = _post(tiny_server, "/v1/chat/completions", body).json()
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"]
    chunks = _chunks(tiny_server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    streamed = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids") or []]
    assert streamed == full["choices"][0]["token_ids"] and len(streamed) == 5


def test_truncation_serves_a_text_longer_than_the_character_bound(tiny_server):
    # the character bound (what max_model_len tokens can hold) refuses a long text unless truncation is asked:
    # then the text is cut from truncation's side first, as vLLM cuts it, and the kept tokens are the same
    long = "one two three four five six seven eight nine ten " * 2000
    r = _post(tiny_server, "/v1/completions", {"prompt": long, "max_tokens": 2})
    assert r.status_code == 400 and "characters" in r.text
    for side in ("left", "right"):
        r = _post(tiny_server, "/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10,
                                                   "truncation_side": side, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text
    r = _post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 2,
                                                    "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text


def test_echo_shows_the_clients_text_when_truncation_cut_nothing(tiny_server):
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 2, "temperature": 0}
    plain = _post(tiny_server, "/v1/completions", body).json()["choices"][0]["text"]
    assert _post(tiny_server, "/v1/completions", {**body, "truncate_prompt_tokens": 100}).json()["choices"][0][
        "text"] == plain
    r = _post(tiny_server, "/v1/completions", {**body, "max_tokens": 10 ** 6, "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_model_cards_have_vllms_fields(tiny_server):
    cards = httpx.get(f"{tiny_server}/v1/models", timeout=30).json()["data"]
    card = cards[0]
    assert card["id"] == MODEL and card["object"] == "model" and card["parent"] is None and card["root"]
    assert isinstance(card["max_model_len"], int) and card["permission"][0]["object"] == "model_permission"
    assert httpx.get(f"{tiny_server}/v1/models/{MODEL}", timeout=30).json() == card
