"""Tool calling through the official openai client, streamed and not (vLLM's behaviour).

auto: a scripted engine writes each parser family's tool calls (a random model never would);
required and a named function: a tiny random model whose output structured outputs constrain, so
the arguments always parse. Tools, assistant tool_calls and tool messages reach the chat template
(shown by /tokenize, which renders the same prompt).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from kvfit.engine.output import CompletionOutput, RequestOutput
from kvfit.server.tools import ToolOptions
from server_testing import make_engine, running_server

# a Qwen-style template (hermes tool calls) that renders tools, assistant tool calls and tool results
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ eos_token }}\n"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{% for tc in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}<|tool|>[{{ m.tool_call_id }}] {{ m.content }}{{ eos_token }}\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"unit": {"enum": ["c", "f"]}},
                                                           "required": ["unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "weather?"}]

SCRIPTS = {
    "hermes": 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"unit": "c"}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": "c"}}, '
               '{"name": "get_time", "arguments": {}}]'}
CONTENT = {"hermes": "Checking.", "llama3_json": None, "mistral": "Checking."}


class ScriptedEngine(FakeEngine):
    """Writes `script`, one character (token) a step, for every request."""

    def __init__(self, script: str):
        super().__init__(max_model_len=4096)
        self.script = script

    def step(self):
        outputs = []
        for request_id, r in self._running():
            r["out"].append(ord(self.script[len(r["out"])]))
            finished = len(r["out"]) >= len(self.script)
            if finished:
                del self.requests[request_id]
            text = "".join(map(chr, r["out"]))
            sample = CompletionOutput(0, text, list(r["out"]), None, None, "stop" if finished else None)
            outputs.append(RequestOutput(request_id, None, r["prompt"], outputs=[sample], finished=finished))
        return outputs


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _calls(tool_calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _streamed(client, **kwargs):
    """(content, tool calls as {index: [name, arguments]}, finish_reason) added up from a stream (arguments that
    are no JSON Python reads stay text)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, [None, "", None])
            if tc.id:
                assert entry[2] is None and tc.type == "function"     # the id and name come once, first
                entry[0], entry[2] = tc.function.name, tc.id
            entry[1] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, [(name, _json_or_text(args)) for name, args, _ in calls.values()], reason


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@pytest.mark.parametrize("parser", list(SCRIPTS))
def test_auto_tool_calls_of_each_parser_family(parser):
    options = ToolOptions(True, parser)
    with running_server(ScriptedEngine(SCRIPTS[parser]), "fake", chat_template=TOOLS_TEMPLATE,
                        tool_options=options) as (url, _):
        client = _client(url)
        resp = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER, TIME])
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == CONTENT[parser]
        assert _calls(choice.message.tool_calls) == [("get_weather", {"unit": "c"}), ("get_time", {})]
        assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
        content, calls, reason = _streamed(client, model="fake", messages=USER, tools=[WEATHER, TIME])
        assert (content or None, calls, reason) == (CONTENT[parser], _calls(choice.message.tool_calls), "tool_calls")
        one = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER, TIME],
                                             parallel_tool_calls=False)
        assert _calls(one.choices[0].message.tool_calls) == [("get_weather", {"unit": "c"})]


def test_auto_with_text_only_is_content_and_none_is_never_parsed():
    with running_server(ScriptedEngine(SCRIPTS["hermes"]), "fake", chat_template=TOOLS_TEMPLATE,
                        tool_options=ToolOptions(True, "hermes")) as (url, _):
        client = _client(url)
        resp = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER], tool_choice="none")
        assert resp.choices[0].message.content == SCRIPTS["hermes"] and not resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "stop"
    with running_server(ScriptedEngine("no tools today"), "fake", chat_template=TOOLS_TEMPLATE,
                        tool_options=ToolOptions(True, "hermes")) as (url, _):
        client = _client(url)
        resp = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER])
        assert resp.choices[0].message.content == "no tools today" and resp.choices[0].finish_reason == "stop"
        assert _streamed(client, model="fake", messages=USER, tools=[WEATHER]) == ("no tools today", [], "stop")


def test_auto_without_the_server_flag_is_vllms_400_and_tools_are_rendered():
    with running_server(ScriptedEngine("x"), "fake", chat_template=TOOLS_TEMPLATE) as (url, _):
        client = _client(url)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as info:
            client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER])
        assert info.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError, match="tools must not be an empty list"):   # vLLM 0.26's 400
            client.chat.completions.create(model="fake", messages=USER, tools=[])
        history = USER + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
        body = {"model": "fake", "messages": history, "tools": [WEATHER]}
        ids = httpx.post(f"{url}/tokenize", json=body, timeout=10).json()["tokens"]
        prompt = "".join(map(chr, ids))
        assert json.dumps(WEATHER, ensure_ascii=False) in prompt
        assert '<tool_call>{"name": "get_weather", "arguments": {"unit": "c"}}</tool_call>' in prompt
        assert "<|tool|>[call_1] 21 degrees" in prompt
        resp = client.chat.completions.create(model="fake", messages=history, tools=[WEATHER], tool_choice="none")
        assert resp.choices[0].message.content == "x"


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen2):
    engine = make_engine(tiny_qwen2, max_model_len=512)
    try:
        with running_server(engine, "tiny", chat_template=TOOLS_TEMPLATE) as (url, _):
            yield url
    finally:
        engine.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_required_and_named_choices_are_constrained_so_arguments_parse(qwen_server, stream):
    client = _client(qwen_server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", True), ("required", False), (named, True)):
        kwargs = dict(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=choice,
                      parallel_tool_calls=parallel, max_tokens=150, temperature=0)
        if stream:
            _, calls, reason = _streamed(client, **kwargs)
        else:
            resp = client.chat.completions.create(**kwargs)
            calls, reason = _calls(resp.choices[0].message.tool_calls), resp.choices[0].finish_reason
        assert calls, (choice, reason)
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            assert arguments == {} if name == "get_time" else arguments in ({"unit": "c"}, {"unit": "f"})
        if choice == named:
            assert [name for name, _ in calls] == ["get_weather"] and reason == "stop"
        else:
            assert reason == "tool_calls" and (parallel or len(calls) == 1)


@pytest.mark.parametrize("parameters", [{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                                        {"type": "string", "pattern": "("}], ids=["dangling-ref", "bad-pattern"])
def test_a_tool_schema_the_grammar_refuses_is_a_400_naming_tools(qwen_server, parameters):
    client = _client(qwen_server)
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, tools=tools, tool_choice=choice, max_tokens=5)
        assert info.value.body["param"] == "tools" and info.value.body["message"].startswith("tools: ")


@pytest.mark.parametrize("script, name, arguments", [
    # an integer past Python's 4,300 digits: json raises ValueError, not JSONDecodeError (a 500 before)
    ('<tool_call>{"name": "get_time", "arguments": {"x": ' + "9" * 5000 + '}}</tool_call>', None, None),
    # a lone surrogate escape: valid JSON, not UTF-8 (a 500, or a stream cut before [DONE])
    ('<tool_call>{"name": "get_weather", "arguments": {"unit": "\\ud800"}}</tool_call>', "get_weather",
     {"unit": "\ud800"}),
    ('<tool_call>{"name": "get\\udc00", "arguments": {}}</tool_call>', None, None),
    # a <tool_call> inside the arguments' string: the stream's arguments stay the block's (they were cut there)
    ('<tool_call>{"name": "get_weather", "arguments": {"unit": "x <tool_call> y"}}</tool_call>', "get_weather",
     {"unit": "x <tool_call> y"})], ids=["huge-int", "surrogate-arguments", "surrogate-name", "tag-in-string"])
def test_hostile_tool_call_outputs_are_answered_whole(script, name, arguments):
    """Model outputs that crashed the response (a 500, a stream without [DONE]) or broke the streamed arguments;
    what is not a call comes back as content, full and streamed alike."""
    with running_server(ScriptedEngine(script), "fake", chat_template=TOOLS_TEMPLATE,
                        tool_options=ToolOptions(True, "hermes")) as (url, _):
        client = _client(url)
        full = client.chat.completions.create(model="fake", messages=USER, tools=[WEATHER, TIME])
        content, calls, reason = _streamed(client, model="fake", messages=USER, tools=[WEATHER, TIME])
        if name is None:      # the full reply's content; the stream ends whole (it may have begun a call)
            assert full.choices[0].message.content == script and not full.choices[0].message.tool_calls
            assert reason is not None
        else:
            assert _calls(full.choices[0].message.tool_calls) == [(name, arguments)] == calls
            assert reason == "tool_calls"


def test_a_streamed_call_that_never_closes_ends_as_tool_calls():
    """The client has the call's id and name: finish_reason tool_calls (vLLM's), the arguments without the text
    of the end tag."""
    script = 'Hi<tool_call>{"name": "get_weather", "arguments": {"unit": "c</tool_call>'
    class OneStepAtATime(ScriptedEngine):     # a fast engine's outputs fold into the final one
        def step(self):
            time.sleep(0.01)
            return super().step()

    with running_server(OneStepAtATime(script), "fake", chat_template=TOOLS_TEMPLATE,
                        tool_options=ToolOptions(True, "hermes")) as (url, _):
        pieces, reason = "", None
        for chunk in _client(url).chat.completions.create(model="fake", messages=USER, tools=[WEATHER],
                                                          stream=True):
            for tc in chunk.choices[0].delta.tool_calls or []:
                pieces += tc.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls" and pieces == '{"unit": "c'


def test_history_with_an_empty_tool_calls_list_renders_as_plain_assistant_turns():
    """vLLM drops an empty tool_calls list (templates test `'tool_calls' in message`), reads null arguments as {} and
    refuses a call whose type is not function."""
    from kvfit.errors import RequestError
    from kvfit.text.chat_template import tool_arguments_as_objects
    messages = [{"role": "assistant", "content": "hi", "tool_calls": []},
                {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                      "function": {"name": "f", "arguments": "null"}}]}]
    out = tool_arguments_as_objects(messages)
    assert "tool_calls" not in out[0] and out[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert "tool_calls" in messages[0]                     # the caller's messages unchanged
    with pytest.raises(RequestError, match="tool_calls\\[0\\] must be"):
        tool_arguments_as_objects([{"role": "assistant", "tool_calls": [{"type": "retrieval", "function": {}}]}])
    with pytest.raises(RequestError, match="is not JSON"):
        tool_arguments_as_objects([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"x": ' + "9" * 5000 + "}"}}]}])


def test_no_calls_leave_tool_calls_out_and_whitespace_beside_calls_is_no_content():
    """vLLM's ChatMessage drops an empty tool_calls list; text beside calls that is only whitespace is null."""
    for script, want in (("Just text.", {"role": "assistant", "content": "Just text.", "refusal": None,
                                         "annotations": None, "audio": None, "function_call": None,
                                         "reasoning": None}),
                         ('\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None)):
        with running_server(ScriptedEngine(script), "fake", chat_template=TOOLS_TEMPLATE,
                            tool_options=ToolOptions(True, "hermes")) as (url, _):
            body = httpx.post(f"{url}/v1/chat/completions", json={"model": "fake", "messages": USER,
                                                                  "tools": [WEATHER, TIME]}, timeout=30).json()
            message = body["choices"][0]["message"]
            if want is not None:
                assert message == want
            else:
                assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_time"


def test_exclude_tools_when_tool_choice_none_renders_no_tools():
    """vLLM's --exclude-tools-when-tool-choice-none: tool_choice none leaves the tools out of the prompt (and only
    then); without the flag they are rendered."""
    from kvfit.server.frontend import FrontendOptions
    body = {"model": "fake", "messages": USER, "tools": [WEATHER], "max_tokens": 1}
    prompt_tokens = {}
    for exclude in (False, True):
        with running_server(ScriptedEngine("x"), "fake", chat_template=TOOLS_TEMPLATE,
                            frontend=FrontendOptions(exclude_tools_when_tool_choice_none=exclude)) as (url, _):
            for choice in ("none", "required"):
                reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "tool_choice": choice}, timeout=30)
                prompt_tokens[exclude, choice] = reply.json()["usage"]["prompt_tokens"]
    assert prompt_tokens[True, "none"] < prompt_tokens[False, "none"] == prompt_tokens[True, "required"]
