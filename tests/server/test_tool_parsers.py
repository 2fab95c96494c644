"""Tool-call parsers on text (a random model never writes a tool call), and the tool plan of a request."""

import json
import re
import types

import pytest

from kvfit.errors import ConfigError
from kvfit.server.protocol import APIError
from kvfit.server.tool_parsers import get_parser
from kvfit.server.tools import (NO_TOOLS, ToolOptions, ToolPlan, _required_schema, template_messages, tool_plan,
                                tool_request)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _calls(extracted):
    return [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls]


# hermes (Qwen) -------------------------------------------------------------------------------------
def test_hermes_reads_every_call_and_the_content_before_them():
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    out = get_parser("hermes").extract(text)
    assert out.tools_called and out.content == "Let me look."
    assert _calls(out) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert out.tool_calls[0].arguments == '{"city": "Zürich"}'        # not ASCII-escaped, as vLLM
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", out.tool_calls[0].id)       # vLLM 0.26: 16 hex digits


def test_hermes_without_a_call_or_with_bad_json_is_content():
    parser = get_parser("hermes")
    assert parser.extract("just text").content == "just text"
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    out = parser.extract(broken)
    assert not out.tools_called and out.content == broken


def test_hermes_reads_an_unclosed_last_call_at_the_end():
    out = get_parser("hermes").extract('<tool_call>{"name": "get_time", "arguments": {}}')
    assert _calls(out) == [("get_time", {})] and out.content is None


# llama3_json ---------------------------------------------------------------------------------------
def test_llama3_json_reads_parameters_or_arguments_separated_by_semicolons():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "arguments": {}}'
    out = get_parser("llama3_json").extract(text)
    assert _calls(out) == [("get_weather", {"city": "Oslo"}), ("get_time", {})] and out.content is None
    assert _calls(get_parser("llama3_json").extract('{"name": "get_time", "parameters": {}}')) == [("get_time", {})]


def test_llama3_json_text_or_json_that_is_no_call_is_content():
    parser = get_parser("llama3_json")
    for text in ("The answer is {not json}", '{"answer": 42}', '{"name": "f"}', 'No braces at all.',
                 '{"name": "f", "parameters": {}} then {broken'):
        out = parser.extract(text)
        assert not out.tools_called and out.content == text


@pytest.mark.parametrize("text", [
    '{"name": "f", "parameters": {"a": 1}} trailing', 'Sure! {"name": "f", "parameters": {"a": 1}}',
    '{"name": "f", "parameters": {"a": 1}}\n{"name": "g", "arguments": []}',
    '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "arguments": []}]'])
def test_llama3_json_full_reply_reads_every_top_level_object_as_vllm(text):
    """vLLM 0.26's llama3_json: each top-level JSON object is a call (text around them dropped, content null;
    arguments of any JSON type dumped), however they are separated or wrapped."""
    out = get_parser("llama3_json").extract(text)
    assert out.tools_called and out.content is None
    assert [(c.name, c.arguments) for c in out.tool_calls][:1] == [("f", '{"a": 1}')]
    assert len(out.tool_calls) == text.count('"name"')
    assert all(c.arguments == "[]" for c in out.tool_calls[1:])


# mistral -------------------------------------------------------------------------------------------
def test_mistral_reads_the_json_list_and_the_v11_name_args_form():
    parser = get_parser("mistral")
    out = parser.extract('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                         '{"name": "get_time", "arguments": {}}]')
    assert _calls(out) == [("get_weather", {"city": "Rome"}), ("get_time", {})] and out.content == "Sure. "
    assert all(len(c.id) == 9 and c.id.isalnum() for c in out.tool_calls)       # Mistral's id rule
    out = parser.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}')
    assert _calls(out) == [("get_weather", {"city": "Rome"}), ("get_time", {})] and out.content is None


def test_mistral_cut_off_list_is_content():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro'
    assert not get_parser("mistral").extract(text).tools_called


# streaming: a call is sent once complete, text that may open a marker is held back -----------------
@pytest.mark.parametrize("parser, text, content", [
    ("hermes", 'Hi.<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": '
               '"get_weather", "arguments": {"city": "A"}}</tool_call>', "Hi."),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                    '"parameters": {"city": "A"}}', None),
    ("mistral", 'Hi.[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                '"arguments": {"city": "A"}}]', "Hi."),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "A"}', None)])
def test_streamed_deltas_add_up_to_the_full_response(parser, text, content):
    plan = ToolPlan("auto", True, parser=parser)
    stream, deltas = plan.stream(), []
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], end == len(text))
        if delta:
            deltas.append(delta)
    streamed = "".join(d.get("content", "") for d in deltas) or None
    assert streamed == content
    calls = {}          # index -> [id, name, arguments]: the first entry of a call has its id, type and name
    for entry in (c for d in deltas for c in d.get("tool_calls", [])):
        if entry["index"] not in calls:
            assert entry["type"] == "function" and entry["id"] and entry["function"]["name"]
            calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
        else:
            assert "id" not in entry and "name" not in entry["function"]
        calls[entry["index"]][2] += entry["function"].get("arguments", "")
    assert [(i, name, json.loads(arguments)) for i, (_, name, arguments) in sorted(calls.items())] == \
        [(0, "get_time", {}), (1, "get_weather", {"city": "A"})]
    assert stream.finish_reason("stop") == "tool_calls"
    message, reason = plan.message(text, "stop")
    assert message["content"] == content and len(message["tool_calls"]) == 2 and reason == "tool_calls"


def test_arguments_stream_piece_by_piece_as_vllm_streams_them():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}</tool_call>'
    stream, entries = ToolPlan("auto", True, parser="hermes").stream(), []
    for end in range(1, len(text) + 1):
        entries += stream.delta(text[:end], end == len(text)).get("tool_calls", [])
    assert entries[0]["function"]["name"] == "get_weather" and entries[0]["id"]
    pieces = [e["function"].get("arguments", "") for e in entries]
    assert len([p for p in pieces if p]) > 5                      # not one piece at the end
    assert json.loads("".join(pieces)) == {"city": "Zürich", "days": [1, 2]}


def test_hermes_stream_never_sends_a_marker_as_content():
    plan, text = ToolPlan("auto", True, parser="hermes"), 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    stream = plan.stream()
    content = "".join(stream.delta(text[:end], end == len(text)).get("content", "")
                      for end in range(1, len(text) + 1))
    assert content == "ok "


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    message, reason = ToolPlan("auto", False, parser="hermes").message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"] and reason == "tool_calls"


def test_named_and_required_outputs():
    message, reason = ToolPlan("named", True, function="get_weather").message('{"city": "A"}', "stop")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "A"}'}
    assert reason == "stop"              # OpenAI: a forced function finishes with stop
    text = '[{"name": "get_weather", "parameters": {"city": "A"}}, {"name": "get_time", "parameters": {}}]'
    message, reason = ToolPlan("required", True).message(text, "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "A"}), ("get_time", {})]
    assert reason == "tool_calls" and message["content"] == ""         # vLLM: content or "" for a forced call
    stream = ToolPlan("named", True, function="f").stream()
    first, second = stream.delta('{"a"', False), stream.delta('{"a": 1}', True)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'} and first["tool_calls"][0]["id"]
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}


# the request's fields, as vLLM checks them ----------------------------------------------------------
def _body(**fields):
    base = dict(tools=None, tool_choice=None, parallel_tool_calls=None, structured_outputs=None, response_format=None)
    return types.SimpleNamespace(**{**base, **fields})


def test_tool_choice_defaults_and_errors():
    assert tool_request(_body(tools=[WEATHER])).choice == "auto"
    for choice in (None, "required", "auto"):                   # vLLM 0.26 and OpenAI refuse an empty list
        with pytest.raises(APIError, match="tools must not be an empty list"):
            tool_request(_body(tools=[], tool_choice=choice))
    named = tool_request(_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.named and named.choice == "get_weather"
    for body, param in [(_body(tool_choice="required"), "tool_choice"),
                        (_body(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
                        (_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                         "tool_choice"),
                        (_body(tools=[{"type": "function", "function": {}}]), "tools"),
                        (_body(tools="x"), "tools"), (_body(tools=[WEATHER], parallel_tool_calls="sometimes"),
                                                      "parallel_tool_calls")]:
        with pytest.raises(APIError) as info:
            tool_request(body)
        assert info.value.status == 400 and info.value.param == param


def test_auto_needs_the_server_flags_and_required_refuses_a_second_constraint():
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        tool_plan(tool_request(_body(tools=[WEATHER])), NO_TOOLS, _body())
    assert tool_plan(tool_request(_body(tools=[WEATHER], tool_choice="none")), NO_TOOLS, _body()) is None
    body = _body(tools=[WEATHER], tool_choice="required", structured_outputs={"regex": "a"})
    with pytest.raises(APIError) as info:
        tool_plan(tool_request(body), NO_TOOLS, body)
    assert info.value.param == "structured_outputs"


def test_server_flags_are_checked():
    ToolOptions(True, "hermes")
    ToolOptions(False, "hermes")          # accepted alone, as vLLM: auto stays a 400 without --enable-auto-tool-choice
    for enable, parser, needle in [(True, None, "needs --tool-call-parser"), (True, "pythonic", "not one of")]:
        with pytest.raises(ConfigError, match=needle):
            ToolOptions(enable, parser)


def test_required_schema_is_vllms_and_one_call_without_parallel_calls():
    schema = _required_schema([WEATHER, TIME], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}, "additionalProperties": False}
    assert "maxItems" not in _required_schema([WEATHER], parallel=True)


def test_assistant_tool_call_arguments_reach_the_template_as_objects():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}}]}]
    calls = template_messages(messages)[0]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": 1} and calls[1]["function"]["arguments"] == {}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'       # the caller's untouched


def test_with_the_mistral_parser_every_call_id_is_mistrals():
    options = ToolOptions(True, "mistral")
    body = _body(tools=[WEATHER], tool_choice="required")
    plan = tool_plan(tool_request(body), options, body)
    message, _ = plan.message('[{"name": "get_weather", "parameters": {"city": "A"}}]', "stop")
    named = ToolPlan("named", True, function="f", mistral_ids=True).message("{}", "stop")[0]
    for call in message["tool_calls"] + named["tool_calls"]:
        assert len(call["id"]) == 9 and call["id"].isalnum()       # Mistral's templates refuse other ids


def test_required_calls_cut_by_max_tokens_are_the_same_streamed_or_not():
    # the stream sends each call once its object closes; the full reply cut by max_tokens shows the same calls
    # (it showed the raw text as content, with no calls, while the stream had sent the first call)
    plan = ToolPlan(mode="required", parallel=True)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "'
    message, reason = plan.message(text, "length")
    assert reason == "length" and message["content"] == ""
    full = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    for ends in (range(1, len(text) + 1), (20, len(text))):     # a token an output; or the object closing in the last
        stream, streamed, content = plan.stream(), [], ""
        for end in ends:
            delta = stream.delta(text[:end], end == len(text), "length" if end == len(text) else None)
            content += delta.get("content", "")
            streamed += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in delta.get("tool_calls", [])]
        assert full == streamed == [("get_weather", {"city": "Paris"})] and content == ""
        assert stream.finish_reason("length") == "length"
    whole = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'     # the list closed by the last token
    stream = plan.stream()
    calls = stream.delta(whole, True, "length")["tool_calls"]
    assert [c["function"]["name"] for c in calls] == [n for n, _ in full]
    assert [c["function"]["name"] for c in plan.message(whole, "length")[0]["tool_calls"]] == [n for n, _ in full]
    message, _ = plan.message('[{"name": "get_weather", "param', "length")     # no object closed: the text
    assert "tool_calls" not in message and message["content"] == '[{"name": "get_weather", "param'


def test_tools_reach_the_template_in_vllms_shape():
    """vLLM hands templates tool.model_dump(): name, description and parameters always (null where absent), strict
    only when given, other keys kept after them; so `tool | tojson` renders the prompt vLLM renders."""
    from kvfit.server.tools import _check_tool
    shaped = _check_tool({"function": {"parameters": {"type": "object"}, "name": "f", "x-extra": 1}}, 0)
    assert shaped == {"type": "function", "function": {"name": "f", "description": None,
                                                       "parameters": {"type": "object"}, "x-extra": 1}}
    assert list(shaped["function"]) == ["name", "description", "parameters", "x-extra"]
    assert _check_tool({"type": "function", "function": {"name": "g", "strict": True}}, 0)["function"]["strict"]


def test_mistral_text_after_the_list_of_calls_is_ignored_as_vllm():
    """vLLM raw-decodes the list after [TOOL_CALLS] and ignores what follows it (the full reply was content while
    the stream sent the call)."""
    out = get_parser("mistral").extract('[TOOL_CALLS][{"name": "get_time", "arguments": {}}] Done.')
    assert out.tools_called and [c.name for c in out.tool_calls] == ["get_time"] and out.content is None
    assert not get_parser("mistral").extract('[TOOL_CALLS][{"name": "get_time", "arguments": {}} Done.').tools_called
