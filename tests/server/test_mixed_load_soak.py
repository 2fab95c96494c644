"""A soak of `kvfit serve` (a real process) under mixed load: every request checked, then the server drained.

Many concurrent clients send a mix of completions and chat, streamed and not: n > 1 (seeded or not), logprobs,
top_logprobs, prompt_logprobs, echo, stop strings that occur and that do not, stop_token_ids,
include_stop_str_in_output, min_tokens, max_tokens up to the context, structured outputs (json schema, regex,
choice, json_object), tool calls (required, named), token-id prompts and batches of prompts, cache_salt,
identical prompts (prefix-cache hits), clients that leave mid-stream and requests that get a 400. The cache
(64 blocks of 16 tokens, 4 requests of --max-model-len 256) is smaller than 8 running requests, so requests are
preempted. Checked for every request: it ends (a [DONE] stream or a full body, within a deadline), usage counts
the tokens returned and the prompt, a greedy request gives what it gives alone (streamed or not, salted or not),
finish_reason is length exactly when max_tokens is reached, constrained outputs parse, n choices come with
distinct indexes. After the load: /metrics shows nothing running or waiting and no block used, /health is 200,
the log has no traceback, and SIGTERM stops the server with exit 0.

`python tests/server/test_mixed_load_soak.py --seconds 180` runs a longer soak (the test runs about 25 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from server_testing import scrape, wait_healthy
from test_tool_calling import TIME, WEATHER

MODEL = "tiny"
MAX_MODEL_LEN = 256
REQUEST_DEADLINE_S = 120
# renders tools by name only (this tokenizer spends a token per JSON character), and a history's tool calls
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}{{ eos_token }}\n"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"enum": ["small", "large"]}, "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]
SHARED = "In the beginning the engine measured the memory, planned the cache, and then served every request. "
PROMPTS = ["Hello, my name is", "The quick brown fox", "Numbers: 0 1 2 3", "Once upon a time there was",
           SHARED + "Question one:", SHARED + "Question two:", SHARED * 2 + "And then", "¿Qué tal? 你好"]
CHATS = [[{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": SHARED}, {"role": "user", "content": "Why?"}],
         [{"role": "user", "content": "What's the weather like?"}, {"role": "assistant", "content": "Sunny."},
          {"role": "user", "content": "And tomorrow?"}]]


@dataclass
class Result:
    """One response, streamed or not, as plain data: choices by index."""
    status: int
    choices: dict[int, dict] = field(default_factory=dict)
    usage: dict | None = None
    error: str | None = None
    usages: list[dict] = field(default_factory=list)     # a stream's usage of every chunk that had one


def _choice_slot(choices: dict, index: int) -> dict:
    return choices.setdefault(index, {"text": "", "tokens": [], "logprobs": [], "top": [], "finish_reason": None,
                                      "calls": {},
                                      "prompt_logprobs": None, "has_logprobs": False})


def _add_completion_choice(slot: dict, c: dict) -> None:
    slot["text"] += c.get("text") or ""
    if c.get("logprobs"):
        slot["has_logprobs"] = True
        slot["tokens"] += c["logprobs"]["tokens"]
        slot["logprobs"] += c["logprobs"]["token_logprobs"]
        slot["top"] += c["logprobs"]["top_logprobs"] or []
    if c.get("prompt_logprobs") is not None:
        slot["prompt_logprobs"] = c["prompt_logprobs"]


def _add_chat_choice(slot: dict, c: dict, stream: bool) -> None:
    message = c.get("delta" if stream else "message") or {}
    slot["text"] += message.get("content") or ""
    for i, call in enumerate(message.get("tool_calls") or []):
        entry = slot["calls"].setdefault(call.get("index", i), {"name": None, "arguments": ""})
        fn = call.get("function") or {}
        entry["name"] = fn.get("name") or entry["name"]
        entry["arguments"] += fn.get("arguments") or ""
    if c.get("logprobs") and c["logprobs"].get("content"):
        slot["has_logprobs"] = True
        slot["tokens"] += [e["token"] for e in c["logprobs"]["content"]]
        slot["logprobs"] += [e["logprob"] for e in c["logprobs"]["content"]]
        slot["top"] += [e["top_logprobs"] for e in c["logprobs"]["content"]]
    if c.get("prompt_logprobs") is not None:
        slot["prompt_logprobs"] = c["prompt_logprobs"]


def _add_choices(result: Result, data: dict, chat: bool, stream: bool) -> None:
    for c in data.get("choices") or []:
        slot = _choice_slot(result.choices, c["index"])
        if chat:
            _add_chat_choice(slot, c, stream)
        else:
            _add_completion_choice(slot, c)
        if c.get("finish_reason"):
            assert slot["finish_reason"] is None, f"a second finish_reason for choice {c['index']}: {data}"
            slot["finish_reason"] = c["finish_reason"]
    if data.get("prompt_logprobs") is not None:
        _choice_slot(result.choices, 0)["prompt_logprobs"] = data["prompt_logprobs"]


async def send(http: httpx.AsyncClient, path: str, body: dict) -> Result:
    """POST body; a stream is read to its [DONE] (an error event or a stream without [DONE] is an error)."""
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        response = await http.post(path, json=body)
        if response.status_code != 200:
            return Result(response.status_code, error=response.text)
        data = response.json()
        result = Result(200, usage=data.get("usage"))
        _add_choices(result, data, chat, stream=False)
        return result
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return Result(response.status_code, error=(await response.aread()).decode())
        result, done = Result(200), False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            assert not done, f"data after [DONE]: {line}"
            data = json.loads(line[6:])
            if "error" in data:
                return Result(200, error=f"error event: {data}")
            result.usage = data.get("usage") or result.usage
            if data.get("usage"):
                result.usages.append(data["usage"])
            _add_choices(result, data, chat, stream=True)
        if not done:
            result.error = "the stream ended without [DONE]"
        return result


class Soak:
    """The clients' scenarios and what they check; failures collects (what, body, detail)."""

    def __init__(self, url: str, model_path: str, seed: int):
        from transformers import AutoTokenizer
        self.url, self.rng = url, random.Random(seed)
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.failures: list[tuple[str, dict, str]] = []
        self.counts: dict[str, int] = {}
        self.greedy: dict[str, tuple[Result, dict]] = {}      # reference results of greedy bodies, sent alone
        self.seeded: dict[str, Result] = {}                    # first result of each seeded body
        self.ids: dict[str, list[int]] = {}                    # greedy token ids (offline) of the references
        self.metrics: dict[str, float] = {}                    # /metrics once drained
        self.exit_code: int | None = None                      # kvfit serve's, after SIGTERM
        self.log = ""                                          # kvfit serve's stderr

    def check(self, ok: bool, what: str, body: dict, detail) -> bool:
        if not ok:
            self.failures.append((what, body, str(detail)[:2000]))
        return ok

    def prompt_tokens(self, body: dict) -> int:
        prompts = body["prompt"] if isinstance(body["prompt"], list) and body["prompt"] and \
            not isinstance(body["prompt"][0], int) else [body["prompt"]]
        return sum(len(p) if isinstance(p, list) else len(self.tok(p)["input_ids"]) for p in prompts)

    def chat_prompt_tokens(self, body: dict) -> int:
        rendered = self.tok.apply_chat_template(body["messages"], tools=body.get("tools"), chat_template=TOOLS_TEMPLATE,
                                                add_generation_prompt=True, tokenize=True, return_dict=True)
        return len(rendered["input_ids"])

    async def request(self, http, body: dict, expect: int = 200) -> Result | None:
        """Send, check that it ends in time with the expected status and consistent usage; the result or None."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if not body.get("stream"):
            body = {k: v for k, v in body.items() if k != "stream_options"}
        try:
            result = await asyncio.wait_for(send(http, path, body), REQUEST_DEADLINE_S)
        except asyncio.TimeoutError:
            self.check(False, "hang", body, f"no answer in {REQUEST_DEADLINE_S} s")
            return None
        if not self.check(result.status == expect and (expect != 200 or result.error is None), "status", body,
                          f"{result.status} {result.error}") or expect != 200:
            return None
        self.check_usage(body, result)
        return result

    def check_usage(self, body: dict, result: Result) -> None:
        chat = "messages" in body
        n = body.get("n") or 1
        num_prompts = 1 if chat or not isinstance(body["prompt"], list) or not body["prompt"] or \
            isinstance(body["prompt"][0], int) else len(body["prompt"])
        self.check(sorted(result.choices) == list(range(n * num_prompts)), "choice indexes", body,
                   sorted(result.choices))
        stream_usage = not body.get("stream") or (body.get("stream_options") or {}).get("include_usage")
        if not stream_usage:
            return
        usage = result.usage or {}
        prompt = self.chat_prompt_tokens(body) if chat else self.prompt_tokens(body)
        if (body.get("stream_options") or {}).get("continuous_usage_stats"):
            so_far = [u["completion_tokens"] for u in result.usages]
            self.check(len(so_far) > 1 and so_far == sorted(so_far) and
                       all(u["prompt_tokens"] == prompt for u in result.usages), "continuous usage", body,
                       result.usages)
        self.check(usage.get("prompt_tokens") == prompt, "prompt_tokens", body, (usage, prompt))
        self.check(usage.get("total_tokens") == usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0),
                   "total_tokens", body, usage)
        if all(c["has_logprobs"] for c in result.choices.values()):
            echoed = prompt if body.get("echo") and not chat else 0
            returned = sum(len(c["tokens"]) for c in result.choices.values())
            self.check(usage.get("completion_tokens") == returned - echoed, "completion_tokens", body,
                       (usage, returned, echoed))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        for index, c in result.choices.items():
            reason = c["finish_reason"]
            self.check(reason in ("stop", "length", "tool_calls"), "finish_reason", body, (index, reason))
            if c["has_logprobs"] and max_tokens is not None:
                num = len(c["tokens"]) - (self.prompt_tokens({"prompt": body["prompt"]}) // num_prompts
                                          if body.get("echo") and not chat else 0)
                # length only at max_tokens; at max_tokens, stop too when the last token was eos or a stop
                self.check(num <= max_tokens and (reason != "length" or num == max_tokens), "length iff max_tokens",
                           body, (index, reason, num, max_tokens))

    def tally(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def pick(self, *options):
        return self.rng.choice(options)


def greedy_bodies() -> list[dict]:
    """The greedy references: sent alone before and after the load, and again under it."""
    bodies = []
    for i, prompt in enumerate(PROMPTS):
        bodies.append({"model": MODEL, "prompt": prompt, "max_tokens": (8, 24, 40)[i % 3], "temperature": 0,
                       "logprobs": 0})
    for i, messages in enumerate(CHATS):
        bodies.append({"model": MODEL, "messages": messages, "max_tokens": (12, 30)[i % 2], "temperature": 0,
                       "logprobs": True})
    return bodies


def key(body: dict) -> str:
    return json.dumps(body, sort_keys=True)


def close(a, b, tol: float = 1e-3) -> bool:
    """Logprobs (lists, dicts, numbers, None) equal within tol: batches of other sizes round differently."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tol or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def same_choice(a: dict, b: dict) -> bool:
    same = [(c["text"], c["finish_reason"], c["tokens"], c["calls"]) for c in (a, b)]
    return same[0] == same[1] and close(a["logprobs"], b["logprobs"])


def same_output(a: Result, b: Result) -> bool:
    return a.choices.keys() == b.choices.keys() and all(same_choice(a.choices[i], b.choices[i]) for i in a.choices) \
        and (a.usage or {}).get("completion_tokens") == (b.usage or {}).get("completion_tokens")


# scenarios: each sends one request (or a few) and checks what it can know -----------------------------------------
async def greedy_again(soak: Soak, http) -> None:
    """A reference again, streamed or not, salted or not: the same answer as alone."""
    ref_key = soak.pick(*soak.greedy)
    ref, body = soak.greedy[ref_key]
    body = dict(body, stream=soak.pick(False, True), stream_options={"include_usage": True})
    if soak.rng.random() < 0.3:
        body["cache_salt"] = soak.pick("tenant-a", "tenant-b")
    refs = [ref]
    if "prompt" in body and soak.rng.random() < 0.3:      # a batch of references with the same max_tokens
        same = [(r, b) for r, b in soak.greedy.values() if "prompt" in b and b["max_tokens"] == body["max_tokens"]]
        batch = [soak.rng.choice(same) for _ in range(soak.rng.randint(2, 3))]
        as_ids = soak.pick(False, True)       # texts or token ids (vLLM takes no mix)
        body["prompt"] = [soak.tok(b["prompt"])["input_ids"] if as_ids else b["prompt"] for _, b in batch]
        refs = [r for r, _ in batch]
    n = body["n"] = soak.pick(1, 1, 2)
    result = await soak.request(http, body)
    if result is None:
        return
    for i, c in result.choices.items():
        want = refs[i // n].choices[0]
        soak.check(same_choice(c, want), "greedy under load != alone", body, (i, c, want))
    want_tokens = sum(r.usage["completion_tokens"] for r in refs) * n
    soak.check((result.usage or {}).get("completion_tokens") == want_tokens, "greedy usage", body,
               (result.usage, want_tokens))


async def greedy_stop(soak: Soak, http) -> None:
    """A stop string cut from the reference's text (it occurs) or one that never does; stop_token_ids from its ids."""
    candidates = [(k, v) for k, v in soak.greedy.items() if len(v[0].choices[0]["text"]) > 8 and "prompt" in v[1]]
    ref_key, (ref, body) = soak.rng.choice(candidates)
    text = ref.choices[0]["text"]
    include = soak.pick(False, True)
    body = dict(body, stream=soak.pick(False, True), include_stop_str_in_output=include,
                stream_options={"include_usage": True})
    kind = soak.pick("occurs", "absent", "token")
    if kind == "occurs":
        # not one holding U+FFFD: kvfit matches it against a character still missing bytes (vLLM waits for them)
        starts = [i for i in range(1, len(text) - 3) if "\ufffd" not in text[i:i + 3]]
        if not starts:
            return
        start = soak.rng.choice(starts)
        stop = text[start:start + soak.rng.randint(1, 3)]
        body["stop"] = [stop, "\x00never"]
        cut = text.index(stop)
        expected, reason = text[:cut] + (stop if include else ""), "stop"
    elif kind == "absent":
        body["stop"] = "\x00never"
        expected, reason = text, ref.choices[0]["finish_reason"]
    else:
        ids = soak.ids[ref_key]
        stop_id = ids[soak.rng.randrange(len(ids))]
        body["stop_token_ids"] = [stop_id]
        num = ids.index(stop_id) + 1
        expected = None
        reason = "stop"
        body["logprobs"] = 0
    result = await soak.request(http, body)
    if result is None:
        return
    got = result.choices[0]
    if expected is not None:
        soak.check((got["text"], got["finish_reason"]) == (expected, reason), f"stop string ({kind})", body,
                   (got["text"], got["finish_reason"], expected, reason))
    else:
        soak.check(len(got["tokens"]) == num and got["tokens"] == ref.choices[0]["tokens"][:num] and
                   got["finish_reason"] == reason, "stop_token_ids", body, (got, num))


async def sampled_n(soak: Soak, http) -> None:
    """n > 1 sampled, seeded (the same answer every time) or not, completions or chat, maybe a batch of prompts."""
    n = soak.pick(2, 3)
    seeded = soak.rng.random() < 0.5
    if soak.rng.random() < 0.6:
        prompt = soak.pick(soak.pick(*PROMPTS), [soak.pick(*PROMPTS), soak.pick(*PROMPTS)],
                           soak.tok(soak.pick(*PROMPTS))["input_ids"])
        body = {"model": MODEL, "prompt": prompt, "logprobs": soak.pick(0, 2)}
    else:
        body = {"model": MODEL, "messages": soak.pick(*CHATS), "logprobs": True, "top_logprobs": soak.pick(0, 3)}
    body.update(n=n, max_tokens=soak.pick(4, 16, 32), temperature=soak.pick(0.7, 1.0), top_p=soak.pick(1.0, 0.9),
                stream=soak.pick(False, True), stream_options={"include_usage": True})
    if seeded:
        body["seed"] = soak.rng.randrange(5)
    extra = soak.pick({}, {"top_k": 5}, {"min_p": 0.1}, {"presence_penalty": 1.0, "frequency_penalty": 0.5},
                      {"repetition_penalty": 1.3}, {"logit_bias": {"2": -100, "50": 5}}, {"bad_words": ["the"]},
                      {"allowed_token_ids": list(range(40, 120))})
    body.update(extra)
    result = await soak.request(http, body)
    if result is None:
        return
    top = body.get("top_logprobs", body.get("logprobs"))
    for c in result.choices.values():
        counts = {len(t) for t in c["top"] if t is not None}
        # completions: a dict by token text, so tokens of the same text are one entry (OpenAI's format)
        allowed = set(range(1, top + 2)) if "prompt" in body else {top}
        soak.check(counts <= allowed, "top_logprobs count", body, counts)
    if seeded:
        seen = soak.seeded.setdefault(key(dict(body, stream=None, stream_options=None)), result)
        soak.check(same_output(result, seen), "seeded n > 1 not reproducible", body, (result.choices, seen.choices))


async def echo_and_prompt_logprobs(soak: Soak, http) -> None:
    prompt = soak.pick(*PROMPTS)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": soak.pick(1, 5), "temperature": 0, "echo": True,
            "logprobs": soak.pick(0, 1, 3), "prompt_logprobs": soak.pick(0, 2)}
    result = await soak.request(http, body)
    if result is None:
        return
    c = result.choices[0]
    num_prompt = soak.prompt_tokens(body)
    soak.check(c["text"].startswith(prompt), "echo starts with the prompt", body, c["text"])
    soak.check(c["prompt_logprobs"] is not None and len(c["prompt_logprobs"]) == num_prompt and
               c["prompt_logprobs"][0] is None, "prompt_logprobs", body, c["prompt_logprobs"])
    seen = soak.seeded.setdefault(key(body), result)        # greedy: every time the same (cache hit or not)
    soak.check(same_output(result, seen) and close(c["prompt_logprobs"], seen.choices[0]["prompt_logprobs"]) and
               close(c["top"], seen.choices[0]["top"]), "echo / prompt_logprobs differ between runs", body,
               (c, seen.choices[0]))


async def min_tokens(soak: Soak, http) -> None:
    """min_tokens with stop_token_ids of every token seen early: at least min_tokens, and stop right after."""
    floor = soak.pick(3, 6)
    body = {"model": MODEL, "prompt": soak.pick(*PROMPTS), "max_tokens": 12, "temperature": 0, "min_tokens": floor,
            "stop_token_ids": list(range(3, 320)), "logprobs": 0, "stream": soak.pick(False, True),
            "stream_options": {"include_usage": True}}
    result = await soak.request(http, body)
    if result is not None:
        c = result.choices[0]
        soak.check(len(c["tokens"]) == floor + 1 and c["finish_reason"] == "stop", "min_tokens", body, c)


async def full_context(soak: Soak, http, over: bool | None = None) -> None:
    """max_tokens that fill the context exactly (length), or one past it (a 400)."""
    prompt = soak.pick(*PROMPTS)
    room = MAX_MODEL_LEN - soak.prompt_tokens({"prompt": prompt})
    over = soak.rng.random() < 0.3 if over is None else over
    body = {"model": MODEL, "prompt": prompt, "max_tokens": room + over, "ignore_eos": True, "logprobs": 0,
            "temperature": soak.pick(0, 0.8), "stream": soak.pick(False, True),
            "stream_options": {"include_usage": True}}
    result = await soak.request(http, body, expect=400 if over else 200)
    if result is not None:
        c = result.choices[0]
        soak.check(len(c["tokens"]) == room and c["finish_reason"] == "length", "full context", body,
                   c["finish_reason"])


async def structured(soak: Soak, http) -> None:
    kind = soak.pick("json", "regex", "choice", "json_object", "response_format")
    chat = soak.rng.random() < 0.5
    body = ({"messages": soak.pick(*CHATS)} if chat else {"prompt": soak.pick(*PROMPTS)})
    body.update(model=MODEL, max_tokens=soak.pick(24, 60), temperature=soak.pick(0, 0.8),
                stream=soak.pick(False, True), stream_options={"include_usage": True})
    if kind == "json":
        body["structured_outputs"] = {"json": SCHEMA}
    elif kind == "regex":
        body["structured_outputs"] = {"regex": REGEX}
    elif kind == "choice":
        body["structured_outputs"] = {"choice": CHOICES}
    elif kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    result = await soak.request(http, body)
    if result is None:
        return
    c = result.choices[0]
    if c["finish_reason"] != "stop":
        return
    text = c["text"]
    try:
        if kind == "regex":
            ok = re.fullmatch(REGEX, text) is not None
        elif kind == "choice":
            ok = text in CHOICES
        elif kind == "json_object":
            ok = isinstance(json.loads(text), dict)
        else:
            value = json.loads(text)
            ok = set(value) == {"name", "size", "ok"} and value["size"] in ("small", "large") and \
                isinstance(value["ok"], bool) and isinstance(value["name"], str) and len(value["name"]) <= 8
    except ValueError:
        ok = False
    soak.check(ok, f"structured output ({kind})", body, text)


async def tool_call(soak: Soak, http) -> None:
    named = soak.rng.random() < 0.5
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME],
            "tool_choice": choice, "parallel_tool_calls": soak.pick(True, False), "max_tokens": 120,
            "temperature": soak.pick(0, 0.8), "stream": soak.pick(False, True),
            "stream_options": {"include_usage": True}}
    result = await soak.request(http, body)
    if result is None:
        return
    c = result.choices[0]
    if c["finish_reason"] == "length":
        return
    calls = [(e["name"], e["arguments"]) for _, e in sorted(c["calls"].items())]
    try:
        parsed = [(name, json.loads(args)) for name, args in calls]
    except ValueError:
        parsed = None
    ok = bool(parsed) and all(a == {} if n == "get_time" else n == "get_weather" and a in ({"unit": "c"}, {"unit": "f"})
                              for n, a in parsed)
    if named:
        ok = ok and [n for n, _ in parsed] == ["get_weather"] and c["finish_reason"] == "stop"
    else:
        ok = ok and c["finish_reason"] == "tool_calls" and (body["parallel_tool_calls"] or len(parsed) == 1)
    soak.check(ok, "tool calls", body, (calls, c["finish_reason"], c["text"]))


async def leave_mid_stream(soak: Soak, http) -> None:
    """A client that reads a few events and goes (or gives up on a full response): plain, n = 2, stop strings,
    a grammar, tool calls, prompt logprobs."""
    body = soak.pick({"prompt": soak.pick(*PROMPTS), "ignore_eos": True, "n": 2},
                     {"prompt": soak.pick(*PROMPTS), "stop": ["e", "\x00never"], "min_tokens": 50},
                     {"prompt": soak.pick(*PROMPTS), "structured_outputs": {"json": SCHEMA}},
                     {"prompt": soak.pick(*PROMPTS), "logprobs": 3, "prompt_logprobs": 2, "echo": True},
                     {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME],
                      "tool_choice": "required"},
                     {"messages": soak.pick(*CHATS), "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    body.update(model=MODEL, max_tokens=100, stream=soak.pick(True, True, False))
    if body["stream"]:
        body.pop("prompt_logprobs", None)       # not with stream: true (a 400, as in vLLM)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        if body["stream"]:
            async with http.stream("POST", path, json=body) as response:
                soak.check(response.status_code == 200, "status", body, response.status_code)
                lines = 0
                async for _ in response.aiter_lines():
                    lines += 1
                    if lines > soak.rng.randint(1, 6):
                        break
        else:
            await http.post(path, json=body, timeout=soak.rng.uniform(0.05, 0.5))
    except httpx.TimeoutException:
        pass


async def bad_request(soak: Soak, http) -> None:
    body = soak.pick({"model": MODEL, "prompt": "x", "n": 0}, {"model": MODEL, "prompt": "x", "temperature": -1},
                     {"model": MODEL, "prompt": "x", "logprobs": 21}, {"model": MODEL, "prompt": [], "max_tokens": 2},
                     {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "("}},
                     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                      "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                     {"model": MODEL, "prompt": "x", "stop_token_ids": [10**9]},
                     {"model": MODEL, "prompt": [[5, 6], [10**9]], "max_tokens": 2},
                     {"model": MODEL, "prompt": "x", "cache_salt": ""},
                     {"model": MODEL, "messages": [], "max_tokens": 2})
    body = dict(body, stream=soak.pick(False, True))
    await soak.request(http, body, expect=400)


async def chat_default_max_tokens(soak: Soak, http) -> None:
    """Chat without max_tokens: up to the context."""
    body = {"model": MODEL, "messages": soak.pick(*CHATS), "temperature": 0.8, "ignore_eos": soak.pick(False, True),
            "stream": soak.pick(False, True), "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "logprobs": True}
    result = await soak.request(http, body)
    if result is not None:
        c = result.choices[0]
        room = MAX_MODEL_LEN - soak.chat_prompt_tokens(body)
        # "length" only at the context; there EOS drawn as the last token still ends it as "stop" (vLLM 0.26's
        # check_stop looks at stop tokens before the length)
        full = len(c["tokens"]) == room
        soak.check(len(c["tokens"]) <= room and (c["finish_reason"] == "stop" or
                                                 c["finish_reason"] == "length" and full),
                   "chat up to the context", body, (len(c["tokens"]), room, c["finish_reason"]))


SCENARIOS = [(greedy_again, 6), (greedy_stop, 4), (sampled_n, 4), (echo_and_prompt_logprobs, 2), (min_tokens, 1),
             (full_context, 1), (structured, 3), (tool_call, 2), (leave_mid_stream, 2), (bad_request, 2),
             (chat_default_max_tokens, 1)]


async def client_loop(soak: Soak, seconds: float, seed: int, first: int) -> None:
    """Scenarios drawn by weight until the deadline, the first one SCENARIOS[first] (so that clients as many as the
    scenarios run each at least once, however slow the machine)."""
    rng = random.Random(seed)
    functions, weights = zip(*SCENARIOS)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=soak.url, timeout=httpx.Timeout(REQUEST_DEADLINE_S)) as http:
        scenario = functions[first % len(functions)]
        while True:
            if scenario is None:
                if time.monotonic() >= deadline:
                    break
                scenario = rng.choices(functions, weights)[0]
            soak.tally(scenario.__name__)
            await scenario(soak, http)
            scenario = None


async def references(soak: Soak) -> None:
    """Each greedy reference alone; the streamed one must equal it too."""
    async with httpx.AsyncClient(base_url=soak.url, timeout=httpx.Timeout(REQUEST_DEADLINE_S)) as http:
        for body in greedy_bodies():
            result = await soak.request(http, body)
            streamed = await soak.request(http, dict(body, stream=True, stream_options={"include_usage": True}))
            assert result is not None and streamed is not None, soak.failures
            soak.check(same_output(result, streamed), "greedy streamed != full", body,
                       (result.choices, streamed.choices))
            soak.greedy[key(body)] = (result, body)


def offline_ids(model_path: str, soak: Soak) -> None:
    """The references' token ids from kvfit.LLM (the server's answers must be their text)."""
    from kvfit import LLM, SamplingParams
    llm = LLM(model_path, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)
    try:
        for k, (result, body) in soak.greedy.items():
            if "prompt" not in body:
                continue
            [out] = llm.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=body["max_tokens"]),
                                 use_tqdm=False)
            soak.ids[k] = list(out.outputs[0].token_ids)
            soak.check(out.outputs[0].text == result.choices[0]["text"], "server != offline", body,
                       (out.outputs[0].text, result.choices[0]["text"]))
    finally:
        llm.shutdown()


def serve(model_path: str, tmp_path, log) -> tuple[subprocess.Popen, str]:
    template = os.path.join(str(tmp_path), "tools.jinja")
    with open(template, "w", encoding="utf-8") as fh:
        fh.write(TOOLS_TEMPLATE)
    cmd = [sys.executable, "-m", "kvfit.cli", "serve", model_path, "--port", "0", "--device", "cpu", "--dtype",
           "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "64", "--max-num-seqs", "8",
           "--enable-prefix-caching", "--served-model-name", MODEL, "--chat-template", template,
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if match:
            return proc, match.group(1)
    raise AssertionError(f"kvfit serve exited {proc.wait()} before listening")


def drained(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        vllm = {name.partition("{")[0]: value for name, value in m.items() if name.startswith("vllm:")}
        if (m['kvfit_kv_blocks{state="used"}'] == 0 and m["kvfit_requests_running"] == 0
                and m["kvfit_requests_waiting"] == 0 and vllm["vllm:num_requests_running"] == 0
                and vllm["vllm:num_requests_waiting"] == 0 and vllm["vllm:kv_cache_usage_perc"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained {timeout_s} s after the load: {m}")
        time.sleep(0.1)


def run_soak(model_path: str, tmp_path, seconds: float, num_clients: int, seed: int = 0) -> Soak:
    log_path = os.path.join(str(tmp_path), "serve.log")
    with open(log_path, "w") as log:
        proc, url = serve(model_path, tmp_path, log)
        try:
            wait_healthy(url, timeout_s=60)
            soak = Soak(url, model_path, seed)
            asyncio.run(references(soak))
            offline_ids(model_path, soak)

            async def load():
                async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(REQUEST_DEADLINE_S)) as http:
                    # six whole contexts at once need 96 blocks of the 64: preemption, whatever the machine's speed
                    await asyncio.gather(*(full_context(soak, http, over=False) for _ in range(6)),
                                         *(client_loop(soak, seconds, seed * 1000 + i, i) for i in range(num_clients)))
            asyncio.run(load())
            m = drained(url)
            assert m['kvfit_kv_blocks{state="free"}'] + m['kvfit_kv_blocks{state="cached"}'] == \
                m["kvfit_kv_blocks_total"], m
            alone = Soak(url, model_path, seed)
            asyncio.run(references(alone))
            for k, (result, body) in alone.greedy.items():
                soak.check(same_output(result, soak.greedy[k][0]), "greedy after the load != before", body,
                           (result.choices, soak.greedy[k][0].choices))
            soak.failures += alone.failures
            soak.metrics = m
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            proc.send_signal(signal.SIGTERM)
            soak.exit_code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with open(log_path) as fh:
        soak.log = fh.read()
    return soak


def test_mixed_load_soak(tiny_llama, tmp_path):
    soak = run_soak(tiny_llama, tmp_path, seconds=float(os.environ.get("KVFIT_SOAK_S", 10)), num_clients=12)
    assert not soak.failures, "\n".join(f"{w}: {json.dumps(b)}\n    {d}" for w, b, d in soak.failures[:20])
    assert soak.exit_code == 0 and "Traceback" not in soak.log, soak.log[-5000:]
    assert soak.metrics["kvfit_preemptions_total"] > 0, soak.metrics     # the small cache did preempt
    assert all(soak.counts.get(f.__name__) for f, _ in SCENARIOS), soak.counts


if __name__ == "__main__":
    import argparse
    import tempfile
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tiny_models import make_tiny_model
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        soak = run_soak(make_tiny_model(tmp, arch="llama"), tmp, args.seconds, args.clients, args.seed)
        print(json.dumps(soak.counts), soak.exit_code, "Traceback" in soak.log)
        print({k: v for k, v in soak.metrics.items() if "preempt" in k or "prefix_cache" in k})
        for what, body, detail in soak.failures:
            print(f"{what}: {json.dumps(body)}\n    {detail}")
        print("server log warnings/errors:")
        print("\n".join(line for line in soak.log.splitlines() if "ERROR" in line or "Traceback" in line)[-5000:])
