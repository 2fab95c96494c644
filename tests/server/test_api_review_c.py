"""API review C: a vLLM 0.26 user's view of the HTTP server (CPU, tiny random models).

- streamed == full for completions and chat (n > 1, stop strings across tokens, include_stop_str_in_output, echo,
  logprobs, batches, usage), continuous_usage_stats per choice;
- tool calling through a scripted engine (hermes): the streamed deltas' shape and the full reply as vLLM's
  serving_chat and hermes_tool_parser build them; an unknown --tool-call-parser is a start-up error;
- robustness: malformed and deeply nested JSON, clients that leave mid-stream or mid-request (blocks come back),
  a burst of concurrent requests; /health, /v1/models, /version, /tokenize, /detokenize, /metrics shapes.

The last tests pin what vLLM 0.26 (vllm/entrypoints/openai/...) does where this review found kvfit differing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fake_engine import FakeEngine
from kvfit.engine.output import CompletionOutput, RequestOutput
from kvfit.server.tools import ToolOptions
from server_testing import running_server, scrape, wait_for_drain

P, C = "/v1/completions", "/v1/chat/completions"
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}{{ eos_token }}\n"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
# what the scripted engine writes for a chat whose user message names the script: one piece a step
SCRIPTS = {
    "two_calls": ["Checking. ", "<tool_", "call>\n{\"na", "me\": \"get_weather\", \"argu", "ments\": {\"unit\": ",
                  "\"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"],
    "plain": ["no ", "tools ", "< here"],
    "named": ['{"unit": ', '"f"}'],
}


# servers ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(tiny_server):
    """A server of the tiny llama (the server tests' settings: max_model_len 128, 64 blocks of 16)."""
    return tiny_server


class ScriptedEngine(FakeEngine):
    """Writes SCRIPTS[name] (name: the first script name found in the prompt), one piece a step, for every sample."""

    def __init__(self):
        super().__init__(max_model_len=4096)

    def step(self):
        time.sleep(0.002)
        outputs = []
        for request_id, r in self._running():
            prompt = self.tokenizer.decode(r["prompt"])
            pieces = next(SCRIPTS[name] for name in SCRIPTS if name in prompt)
            r["out"].append(ord("a"))
            finished = len(r["out"]) >= len(pieces)
            if finished:
                del self.requests[request_id]
            text = "".join(pieces[:len(r["out"])])
            samples = [CompletionOutput(i, text, list(r["out"]), None, None, "stop" if finished else None)
                       for i in range(r["params"].n)]
            outputs.append(RequestOutput(request_id, None, r["prompt"], outputs=samples, finished=finished))
        return outputs


@pytest.fixture(scope="module")
def tool_url():
    """A scripted server with --enable-auto-tool-choice --tool-call-parser hermes."""
    with running_server(ScriptedEngine(), "fake", chat_template=TOOLS_TEMPLATE,
                        tool_options=ToolOptions(True, "hermes")) as (base, _):
        yield base


# helpers ----------------------------------------------------------------------------------------------------
def _events(base: str, path: str, body: dict) -> list:
    """The SSE events of a streamed request (JSON objects, then the string "[DONE]")."""
    events = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", events[-3:]
    return events


def _full(base: str, path: str, body: dict) -> dict:
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _lp(values):
    return [None if v is None else round(v, 3) for v in values]


def _choices_full(body: dict, chat: bool) -> dict:
    out = {}
    for c in body["choices"]:
        lp = c["logprobs"]
        if chat:
            text = c["message"]["content"]
            lp = None if lp is None else [(e["token"], round(e["logprob"], 3)) for e in lp["content"]]
        else:
            text = c["text"]
            lp = None if lp is None else (lp["tokens"], _lp(lp["token_logprobs"]), lp["text_offset"])
        out[c["index"]] = (text, c["finish_reason"], c["stop_reason"], lp)
    return out


def _choices_streamed(events: list, chat: bool) -> tuple[dict, dict | None]:
    texts, reasons, stops, lps, usage = {}, {}, {}, {}, None
    for e in events[:-1]:
        assert "error" not in e, e
        if not e["choices"] and e.get("usage"):
            usage = e["usage"]
        for c in e["choices"]:
            i = c["index"]
            texts[i] = texts.get(i, "") + ((c["delta"].get("content") or "") if chat else c["text"])
            if c["finish_reason"] is not None:
                reasons[i], stops[i] = c["finish_reason"], c.get("stop_reason")
            if c["logprobs"] is not None:
                lp = lps.setdefault(i, [] if chat else ([], [], []))
                if chat:
                    lp += [(x["token"], round(x["logprob"], 3)) for x in c["logprobs"]["content"]]
                else:
                    lp[0].extend(c["logprobs"]["tokens"])
                    lp[1].extend(_lp(c["logprobs"]["token_logprobs"]))
                    lp[2].extend(c["logprobs"]["text_offset"])
    return {i: (texts[i], reasons.get(i), stops.get(i), lps.get(i)) for i in texts}, usage


def _greedy_text(base: str) -> str:
    return _full(base, P, {"prompt": "Hello there", "max_tokens": 16, "temperature": 0,
                           "ignore_eos": True})["choices"][0]["text"]


# streamed == full -------------------------------------------------------------------------------------------
COMPLETION_CASES = {
    "n3-seeded-logprobs": {"n": 3, "temperature": 1.0, "seed": 5, "logprobs": 2},
    "echo-logprobs": {"echo": True, "logprobs": 1},
    "echo-max0": {"echo": True, "max_tokens": 0, "logprobs": 1},
    "batch-n2": {"prompt": ["Hello there", "Once upon"], "n": 2, "temperature": 1.0, "seed": 3, "logprobs": 0},
    "token-ids-echo": {"prompt": [[1, 40, 50], [1, 60, 70, 80]], "echo": True, "logprobs": 1},
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES) + ["stop-across-tokens", "stop-kept", "stop-n3"])
def test_completions_streamed_equal_full(url, case):
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    if case.startswith("stop"):
        text = _greedy_text(url)
        body["stop"] = [text[3:7]]           # a piece of the greedy text, likely across a token boundary
        body.update({"stop-kept": {"include_stop_str_in_output": True, "logprobs": 1},
                     "stop-n3": {"n": 3, "temperature": 1.0, "seed": 1}}.get(case, {}))
    else:
        body.update(COMPLETION_CASES[case])
    full = _full(url, P, body)
    streamed, usage = _choices_streamed(_events(url, P, {**body, "stream_options": {"include_usage": True}}), False)
    assert streamed == _choices_full(full, False)
    assert usage == full["usage"]
    if case == "stop-across-tokens":
        c = full["choices"][0]
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", body["stop"][0])
        assert c["text"] == _greedy_text(url).split(body["stop"][0])[0]
    if case == "stop-kept":
        assert full["choices"][0]["text"].endswith(body["stop"][0])


@pytest.mark.parametrize("case", ["n3-logprobs", "stop", "echo-continue"])
def test_chat_streamed_equal_full(url, case):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    if case == "n3-logprobs":
        body.update(n=3, temperature=1.0, seed=9, logprobs=True, top_logprobs=2)
    elif case == "stop":
        text = _full(url, C, body)["choices"][0]["message"]["content"]
        body["stop"] = [text[2:6]]
    else:
        body.update(echo=True, add_generation_prompt=False, continue_final_message=True,
                    messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}])
    full = _full(url, C, body)
    events = _events(url, C, {**body, "stream_options": {"include_usage": True}})
    streamed, usage = _choices_streamed(events, True)
    assert streamed == _choices_full(full, True)
    assert usage == full["usage"]
    roles = [e["choices"][0] for e in events[:-1] if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert sorted(c["index"] for c in roles) == list(range(body.get("n", 1)))    # one role chunk per choice
    if case == "echo-continue":
        assert all(c["message"]["content"].startswith("Sure") for c in full["choices"])


def test_continuous_usage_counts_each_choice_and_the_last_chunk_sums(url):
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 2,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(url, P, body)[:-1]
    seen = {0: 0, 1: 0}
    for e in events[:-1]:
        (c,) = e["choices"]
        u = e["usage"]
        assert u["completion_tokens"] >= seen[c["index"]] and u["total_tokens"] == u["prompt_tokens"] + u[
            "completion_tokens"]
        seen[c["index"]] = u["completion_tokens"]
    assert seen == {0: 6, 1: 6}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


# tool calling -----------------------------------------------------------------------------------------------
def _tool_body(script: str, **extra) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": script}], "tools": [WEATHER, TIME], **extra}


def test_hermes_full_reply_has_vllms_shape(tool_url):
    body = _full(tool_url, C, _tool_body("two_calls"))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking. "              # the text before the first <tool_call>
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"unit": "c"}), ("function", "get_time", {})]
    # vLLM's make_tool_call_id: chatcmpl-tool-<16 hex digits>, distinct
    assert all(c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == len("chatcmpl-tool-") + 16 for c in calls)
    assert len({c["id"] for c in calls}) == 2
    plain = _full(tool_url, C, _tool_body("plain"))["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "no tools < here", "refusal": None, "annotations": None,
                                "audio": None, "function_call": None, "reasoning": None}     # vLLM's ChatMessage
    assert plain["finish_reason"] == "stop"


def test_hermes_streamed_deltas_have_vllms_shape(tool_url):
    events = _events(tool_url, C, _tool_body("two_calls", n=2, stream_options={"include_usage": True}))
    content, calls, reasons = {}, {}, {}
    for e in events[:-1]:
        for c in e["choices"]:
            i, delta = c["index"], c["delta"]
            content[i] = content.get(i, "") + (delta.get("content") or "")
            for tc in delta.get("tool_calls", []):
                entry = calls.setdefault((i, tc["index"]), {"id": None, "name": None, "arguments": ""})
                if "id" in tc:                     # id, type and name come once, in the call's first delta
                    assert entry["id"] is None and tc["type"] == "function" and tc["function"]["name"]
                    entry["id"], entry["name"] = tc["id"], tc["function"]["name"]
                else:
                    assert entry["id"] is not None and "name" not in tc["function"]
                entry["arguments"] += tc["function"].get("arguments") or ""
            if c["finish_reason"] is not None:
                reasons[i] = c["finish_reason"]
    assert content == {0: "Checking. ", 1: "Checking. "} and reasons == {0: "tool_calls", 1: "tool_calls"}
    for i in (0, 1):
        assert [(calls[i, k]["name"], json.loads(calls[i, k]["arguments"])) for k in (0, 1)] == [
            ("get_weather", {"unit": "c"}), ("get_time", {})]
        assert all(calls[i, k]["id"].startswith("chatcmpl-tool-") for k in (0, 1))
    assert events[-2]["usage"]["completion_tokens"] == 2 * len(SCRIPTS["two_calls"])


def test_parallel_tool_calls_false_keeps_the_first_streamed_and_full(tool_url):
    full = _full(tool_url, C, _tool_body("two_calls", parallel_tool_calls=False))["choices"][0]
    assert [c["function"]["name"] for c in full["message"]["tool_calls"]] == ["get_weather"]
    indices = {tc["index"] for e in _events(tool_url, C, _tool_body("two_calls", parallel_tool_calls=False))[:-1]
               for c in e["choices"] for tc in c["delta"].get("tool_calls", [])}
    assert indices == {0}


def test_an_unknown_tool_call_parser_is_a_clear_start_up_error(tiny_llama):
    for name in ("qwen3_xml", "pythonic"):     # vLLM parsers kvfit does not have
        proc = subprocess.run([sys.executable, "-m", "kvfit", "serve", tiny_llama, "--port", "0",
                               "--enable-auto-tool-choice", "--tool-call-parser", name],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert name in proc.stderr and "hermes" in proc.stderr and "Traceback" not in proc.stderr


def test_tool_call_parser_alone_is_accepted_as_vllm_does():
    ToolOptions(False, "hermes")


def test_a_named_tool_choice_has_empty_string_content_as_vllm(tool_url):
    named = {"type": "function", "function": {"name": "get_weather"}}
    message = _full(tool_url, C, _tool_body("named", tool_choice=named))["choices"][0]["message"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"unit": "f"}
    assert message["content"] == ""


# robustness -------------------------------------------------------------------------------------------------
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "hi"', b"", b"[1, 2]", b'{"prompt": "\xff"}',
                                 b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                                 b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 500_000],
                         ids=["truncated", "empty", "array", "bad-utf8", "deep", "deep-unclosed"])
def test_malformed_bodies_are_400s_with_an_error_object(url, raw):
    for path in (P, C, "/tokenize"):
        _error(httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=30), 400)
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_clients_that_leave_free_their_blocks(url):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "n": 3, "temperature": 1.0}
    for path, extra in ((P, {}), (C, {"messages": [{"role": "user", "content": "hi"}]})):
        with httpx.stream("POST", url + path, json={**body, **extra, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert scrape(url)['kvfit_kv_blocks{state="used"}'] > 0
        wait_for_drain(url)
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:        # a non-streamed request whose client leaves
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        deadline = time.monotonic() + 10
        while scrape(url)['kvfit_kv_blocks{state="used"}'] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    m = wait_for_drain(url)
    assert m['kvfit_kv_blocks{state="used"}'] == 0


def test_a_burst_of_concurrent_requests_all_answer_and_drain(url):
    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(i):
                if i % 3 == 0:
                    r = await client.post(P, json={"model": "tiny", "prompt": f"Hi {i}", "max_tokens": 8,
                                                   "ignore_eos": True})
                    return r.status_code, r.json()["usage"]["completion_tokens"]
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                last = None
                async with client.stream("POST", C, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = json.loads(line[6:])
                if i % 3 == 1:
                    return r.status_code, last["usage"]["completion_tokens"]
                return r.status_code, 8
            return await asyncio.gather(*(one(i) for i in range(60)))
    assert set(asyncio.run(burst())) == {(200, 8)}
    wait_for_drain(url)


def test_service_endpoints_have_vllms_shapes(url):
    assert httpx.get(url + "/health").status_code == 200
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    card = models["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"} <= set(card)
    assert card["object"] == "model" and card["max_model_len"] == 128
    assert isinstance(httpx.get(url + "/version").json()["version"], str)
    tok = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "Hello world",
                                              "return_token_strs": True}).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 128
    assert tok["tokens"][0] == 1            # bos, as vLLM's add_special_tokens default for a prompt
    detok = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": tok["tokens"][1:]}).json()
    assert detok == {"prompt": "Hello world"}
    chat_tok = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["tokens"][0] != 1       # messages: add_special_tokens false (the template writes its own)
    metrics = httpx.get(url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert f'\n{name}{{' in metrics, name
    assert 'model_name="tiny"' in metrics


# differences from vLLM 0.26 ---------------------------------------------------------------------------------
def test_vllm_extra_fields_are_null_when_not_asked(url):
    choice = _full(url, P, {"model": "tiny", "prompt": "hi", "max_tokens": 2})["choices"][0]
    assert {"prompt_logprobs", "token_ids", "prompt_token_ids"} <= set(choice)
    chat = _full(url, C, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert {"prompt_logprobs", "prompt_token_ids"} <= set(chat)
    assert "reasoning" in chat["choices"][0]["message"]
