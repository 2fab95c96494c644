"""Tool calling in the chat API: vLLM's semantics for `tools`, `tool_choice` and `parallel_tool_calls`.

- tools: OpenAI function tools; they go to the chat template as transformers' apply_chat_template(tools=)
  passes them (also with tool_choice none: rendered, never parsed, as vLLM).
- tool_choice: "none"; "auto" (the default when tools are given): the output is parsed with
  --tool-call-parser, which needs --enable-auto-tool-choice (without it, a 400, as vLLM);
  "required": the output is constrained (structured outputs) to a JSON list of
  {"name": one of the tools, "parameters": its schema}, at least one (exactly one when
  parallel_tool_calls is false); a named function {"type": "function", "function": {"name": N}}:
  the output is constrained to N's parameters schema and is N's arguments. Constrained arguments
  always parse. They are compact JSON (no whitespace between tokens: a model cannot spend its
  tokens on whitespace, as small models do when it is allowed), and a function without parameters
  gets {} (vLLM's intent; its schema allowed any object).
- parallel_tool_calls false: at most one call is returned (vLLM keeps the first).
- finish_reason is "tool_calls" when auto or required produced calls; a named function keeps the
  engine's ("stop"), as OpenAI does for a forced function.
Assistant messages' tool_calls reach the template with arguments as objects (vLLM and transformers
templates read them so). Streams send a call as vLLM does: its id, type and name first, then its
arguments piece by piece as they come (a call whose name does not come first goes out whole once complete).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from kvfit.errors import ConfigError, RequestError
from kvfit.server.protocol import TokenizeRequest, bad_request
from kvfit.server.tool_parsers import (_DECODER, PARSERS, ToolCall, _decode_objects, get_parser,
                                       mistral_tool_call_id, random_tool_call_id)

_LAX_BOOL = TypeAdapter(bool)

MAX_TOOLS = 128                 # OpenAI's limit on tools per request
TOOL_CHOICES = ("none", "auto", "required")
# a function without parameters takes none: its arguments are {} (vLLM's intent; it allows any object)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_NAMED_USAGE = 'a named tool_choice is {"type": "function", "function": {"name": "my_function"}}'


@dataclass(frozen=True)
class ToolOptions:
    """The server's flags: --enable-auto-tool-choice and --tool-call-parser (vLLM's)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser!r} is not one of kvfit's parsers: "
                              f"{', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                              f"{', '.join(PARSERS)})")
        # --tool-call-parser alone is accepted, as vLLM accepts it: tool_choice auto stays a 400 without
        # --enable-auto-tool-choice (kvfit serves required and a named function with or without a parser; vLLM
        # builds its parser only with both flags and answers them 400 otherwise)


NO_TOOLS = ToolOptions()


# the request ------------------------------------------------------------------------------------
def _check_tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"{where}.function must be an object with a non-empty name", param="tools")
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise bad_request(f"{where}.function.{key} must be a {kind.__name__}, got "
                              f"{type(function[key]).__name__}", param="tools")
    # the shape vLLM 0.26 hands templates (tool.model_dump()): name, description and parameters always (null when
    # absent: a template's `tool | tojson` renders the same prompt), strict when given, other keys after them
    shaped = {"name": function["name"], "description": function.get("description"),
              "parameters": function.get("parameters")}
    shaped.update((k, v) for k, v in function.items() if k not in shaped and (k != "strict" or v is not None))
    return {"type": "function", "function": shaped,
            **{k: v for k, v in tool.items() if k not in ("type", "function") and v is not None}}


def _named(choice) -> str:
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f"tool_choice {json.dumps(choice)[:80]} is not valid; {_NAMED_USAGE}", param="tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tool_choice.function.name must be a non-empty string; {_NAMED_USAGE}",
                          param="tool_choice")
    return name


@dataclass(frozen=True)
class ToolRequest:
    """A request's validated tool fields: tools as the template gets them (None: none given), the
    choice ("none", "auto", "required" or a function's name) and parallel_tool_calls."""

    tools: list | None
    choice: str
    named: bool
    parallel: bool


def tool_request(body) -> ToolRequest:
    """The tool fields of a chat body, checked as vLLM's ChatCompletionRequest checks them (a 400 naming
    the field); tool_choice defaults to auto when tools are given, none otherwise."""
    tools, choice = body.tools, getattr(body, "tool_choice", None)
    parallel = getattr(body, "parallel_tool_calls", None)
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list of function tools", param="tools")
        if not tools and not isinstance(body, TokenizeRequest):   # vLLM's chat refuses it (its /tokenize does not)
            raise bad_request("tools must not be an empty list; leave tools out for no tools", param="tools")
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
        tools = [_check_tool(t, i) for i, t in enumerate(tools)]
    if parallel is not None:
        try:
            parallel = _LAX_BOOL.validate_python(parallel)          # read laxly, as the request's other fields
        except ValidationError:
            raise bad_request(f"parallel_tool_calls must be true or false, got {parallel!r:.40}",
                              param="parallel_tool_calls") from None
    parallel = True if parallel is None else parallel
    if choice is None:
        return ToolRequest(tools, "auto" if tools else "none", False, parallel)
    if isinstance(choice, str) and choice not in TOOL_CHOICES or not isinstance(choice, (str, dict)):
        raise bad_request(f"tool_choice must be none, auto, required or a named function, got {choice!r:.60}",
                          param="tool_choice")
    if choice == "none":
        return ToolRequest(tools, "none", False, parallel)
    if tools is None:
        raise bad_request("tool_choice needs tools: give the tools the model may call", param="tool_choice")
    if isinstance(choice, dict):
        name = _named(choice)
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names the function {name[:64]!r}, which is not in tools",
                              param="tool_choice")
        return ToolRequest(tools, name, True, parallel)
    return ToolRequest(tools, choice, False, parallel)


def check_tokenize_tools(body) -> None:
    """/tokenize: tools are checked, and they need messages (a prompt is not rendered, so they would do nothing)."""
    if template_tools(body) is not None and getattr(body, "messages", None) is None:
        raise bad_request("tools are rendered into a chat's messages; /tokenize with a prompt takes no tools",
                          param="tools")


def template_tools(body) -> list | None:
    """The tools the chat template renders (validated; None when the request has none)."""
    return tool_request(body).tools


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for the template: an assistant's tool_calls get their arguments as objects, as vLLM
    hands them to Hugging Face templates (text.chat_template.tool_arguments_as_objects); a 400 otherwise."""
    from kvfit.errors import RequestError
    from kvfit.text.chat_template import tool_arguments_as_objects
    try:
        return tool_arguments_as_objects(messages)
    except RequestError as exc:
        raise bad_request(str(exc), param="messages") from None


# the plan of one request ------------------------------------------------------------------------
def _required_schema(tools: list, parallel: bool) -> dict:
    """vLLM's schema for tool_choice required: a list of {name, parameters} of the tools, one or more
    (exactly one without parallel calls); a call holds nothing else (vLLM's allowed other keys)."""
    def one(function: dict) -> dict:
        params = function.get("parameters") or NO_PARAMETERS
        params = {k: v for k, v in params.items() if k != "$defs"}
        return {"properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": params},
                "required": ["name", "parameters"], "additionalProperties": False}
    schema = {"type": "array", "minItems": 1,
              "items": {"type": "object", "anyOf": [one(t["function"]) for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    defs = {k: v for t in tools for k, v in ((t["function"].get("parameters") or {}).get("$defs") or {}).items()}
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output becomes tool calls: mode auto (parser), required or named (function)."""

    mode: str
    parallel: bool
    parser: str | None = None
    function: str | None = None
    mistral_ids: bool = False      # --tool-call-parser mistral: 9-character ids (Mistral's templates check them)

    def new_id(self) -> str:
        return mistral_tool_call_id() if self.mistral_ids else random_tool_call_id()

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The full response's message and finish_reason for an output text (an output the engine ended
        with an error holds no calls: its text is the content)."""
        calls, content = self._calls(text, finish_reason == "length") if finish_reason != "error" else ([], text)
        if not self.parallel:
            calls = calls[:1]
        message = {"role": "assistant", "content": content}
        if calls:           # vLLM's ChatMessage leaves an empty tool_calls out
            message["tool_calls"] = [c.as_json() for c in calls]
            if content is not None and not content.strip():      # and text beside calls that is only whitespace
                message["content"] = None
        if self.mode in ("named", "required"):      # vLLM: content or "" for a forced call
            message["content"] = message["content"] or ""
        return message, self.finish_reason(bool(calls), finish_reason)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        if called and (self.mode == "auto" or self.mode == "required" and reason in ("stop", None)):
            return "tool_calls"
        return reason

    def _calls(self, text: str, cut: bool = False) -> tuple[list[ToolCall], str | None]:
        if self.mode == "named":
            return [ToolCall(self.new_id(), self.function, text)], None
        if self.mode == "required":
            # cut by max_tokens: the calls whose objects closed before the cut, as the stream sent them
            calls = _required_calls(text, True, self.new_id) or (cut and _required_calls(text, False, self.new_id))
            return (calls, None) if calls else ([], text)
        extracted = get_parser(self.parser).extract(text)
        return list(extracted.tool_calls), extracted.content

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def _required_calls(text: str, whole: bool, new_id) -> list[ToolCall] | None:
    """The {name, parameters} objects of required's JSON list (whole: all of it must parse)."""
    body = text.strip()
    if not body.startswith("["):
        return None
    inner = body[1:].rstrip()
    if whole:
        if not inner.endswith("]"):
            return None
        inner = inner[:-1]
    values, complete = _decode_objects(inner, ",")
    if whole and not complete:
        return None
    calls = []
    for v in values:
        if not isinstance(v, dict) or not isinstance(v.get("name"), str):
            return None
        calls.append(ToolCall(new_id(), v["name"],
                              json.dumps(v.get("parameters") or {}, ensure_ascii=False)))
    return calls


def tool_plan(req: ToolRequest, options: ToolOptions, body) -> ToolPlan | None:
    """The plan for a request (None: its output is plain content); a 400 for auto without
    --enable-auto-tool-choice, and for a constraint of its own beside required or a named function."""
    if req.choice == "none":
        return None
    if req.choice == "auto":
        if not options.enable_auto_tool_choice:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set on the server (or send tool_choice none, required or a named function)",
                              param="tool_choice")
        return ToolPlan("auto", req.parallel, parser=options.tool_call_parser)
    mistral_ids = options.tool_call_parser == "mistral"
    if body.structured_outputs is not None or (body.response_format or {}).get("type") not in (None, "text"):
        field = "structured_outputs" if body.structured_outputs is not None else "response_format"
        raise bad_request(f"tool_choice {req.choice if not req.named else 'with a named function'} constrains the "
                          f"output to the tools' arguments; drop {field}", param=field)
    if req.named:
        return ToolPlan("named", req.parallel, function=req.choice, mistral_ids=mistral_ids)
    return ToolPlan("required", req.parallel, mistral_ids=mistral_ids)


def tool_constraint(req: ToolRequest):
    """The structured-outputs constraint of tool_choice required or a named function (None for auto and
    none): the tools' schemas; a spec past structured outputs' limits is a 400 naming tools."""
    from kvfit.structured_params import StructuredOutputsParams
    if req.choice in ("none", "auto"):
        return None
    try:
        if req.named:
            function = next(t["function"] for t in req.tools if t["function"]["name"] == req.choice)
            return StructuredOutputsParams(json=function.get("parameters") or NO_PARAMETERS,
                                           disable_any_whitespace=True)
        return StructuredOutputsParams(json=_required_schema(req.tools, req.parallel), disable_any_whitespace=True)
    except RequestError as exc:
        raise bad_request(f"tools: {exc}", param="tools") from None


def check_tool_constraint(body) -> None:
    """The prepare step's check (as for a request's own structured_outputs): the constraint of required or
    a named function compiles, else a 400 naming tools, so the engine never gets one it cannot compile."""
    if getattr(body, "tools", None) is None:
        return
    spec = tool_constraint(tool_request(body))
    if spec is not None:
        from kvfit.structured.grammar import check_spec
        try:
            check_spec(spec)
        except RequestError as exc:
            raise bad_request(f"tools: {exc}", param="tools") from None


def apply_tools(inp, body, options: ToolOptions):
    """A chat's GenerateInput with its tool plan: the constraint of required or a named function set in
    its params, special tokens kept where the parser's markers are special (vLLM's adjust_request)."""
    req = tool_request(body)
    plan = tool_plan(req, options, body)
    if plan is None:
        return inp
    changes = {}
    spec = tool_constraint(req)
    if spec is not None:
        changes["structured_outputs"] = spec
    elif get_parser(plan.parser).keeps_special_tokens:
        changes["skip_special_tokens"] = False
    return dataclasses.replace(inp, params=dataclasses.replace(inp.params, **changes), tools=plan)


# streams ----------------------------------------------------------------------------------------
class ToolStream:
    """One choice's stream: from the output text so far to OpenAI deltas (content and tool_calls)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.content_sent = 0          # characters of text sent as content
        self.calls: list[ToolCall] = []
        self.arguments_sent = 0        # named, or auto's call in progress: characters of its arguments sent
        self.parsed_upto = 0           # auto: the text length the calls were last parsed at
        self.streaming: ToolCall | None = None   # auto: the call whose name went out, arguments coming (id, name)

    def delta(self, text: str, finished: bool, reason: str | None = None) -> dict:
        """The delta for text (cumulative; a finished one is final, ended for `reason`): {} when nothing new."""
        if self.plan.mode == "named":
            return self._named_delta(text)
        if self.plan.mode == "required":
            # cut by max_tokens: the calls whose objects closed, as the full reply shows them (ToolPlan._calls)
            whole = finished and reason != "length"
            calls = _required_calls(text, whole, self.plan.new_id) or []
            content_end = len(text) if finished and not calls and not self.calls else 0
        else:
            calls, content_end = self._auto(text, finished)
        out = {}
        if content_end > self.content_sent:
            out["content"] = text[self.content_sent:content_end]
            self.content_sent = content_end
        entries = []
        for i in range(len(self.calls), len(calls) if self.plan.parallel else min(len(calls), 1)):
            if self.streaming is not None:      # begun piece by piece: the rest of its arguments, same id
                rest = self._arguments_so_far(text)[self.arguments_sent:]
                self.calls.append(ToolCall(self.streaming.id, calls[i].name, calls[i].arguments))
                self.streaming = None
                entries += [{"index": i, "function": {"arguments": rest}}] if rest else []
            else:
                self.calls.append(calls[i])
                entries.append({"index": i, **calls[i].as_json()})
        if self.plan.mode == "auto" and not finished and (self.plan.parallel or not self.calls):
            entries += self._partial_entries(text)
        if finished and self.streaming is not None:     # a call begun and never closed: the rest of its arguments
            rest = self._arguments_so_far(text)[self.arguments_sent:]      # (vLLM sends them at the end too)
            entries += [{"index": len(self.calls), "function": {"arguments": rest}}] if rest else []
        if entries:
            out["tool_calls"] = entries
        return out

    def _arguments_so_far(self, text: str) -> str:
        """The raw arguments text of the call in progress (auto): all of it while its object is open, up
        to its closing brace once closed ("" when its opening is not there)."""
        parser = get_parser(self.plan.parser)
        start = parser.tool_start(text)
        partial = None if start is None else parser.partial_call(text[start:], len(self.calls))
        if partial is None:
            return ""
        raw = partial[1]
        try:
            return raw[:_DECODER.raw_decode(raw)[1]]
        except ValueError:        # still open: every character so far is inside the arguments
            return raw

    def _partial_entries(self, text: str) -> list[dict]:
        """vLLM's piece-by-piece stream of the call in progress: its id, type and name once they are known,
        then its arguments as they come."""
        parser = get_parser(self.plan.parser)
        start = parser.tool_start(text)
        partial = None if start is None else parser.partial_call(text[start:], len(self.calls))
        if partial is None:
            return []
        entries, index = [], len(self.calls)
        if self.streaming is None:
            self.streaming, self.arguments_sent = ToolCall(parser.new_id(), partial[0], ""), 0
            entries.append({"index": index, **self.streaming.as_json()})
        arguments = self._arguments_so_far(text)
        if len(arguments) > self.arguments_sent:
            piece, self.arguments_sent = arguments[self.arguments_sent:], len(arguments)
            if entries:
                entries[0]["function"]["arguments"] = piece
            else:
                entries.append({"index": index, "function": {"arguments": piece}})
        return entries

    def _auto(self, text: str, finished: bool) -> tuple[list[ToolCall], int]:
        parser = get_parser(self.plan.parser)
        start = parser.tool_start(text)
        if finished:
            extracted = parser.extract(text)
            if extracted.tools_called and start is not None:   # (llama3_json's full reply may find calls in
                return list(extracted.tool_calls), start        # text the stream already sent as content)
            return [], (start if self.calls or self.streaming is not None else len(text))
        if start is None:
            return [], len(text) - parser.held_back(text)
        # a call closes with '}' (JSON) or '>' (</tool_call>): text without one adds no call, so the
        # calls are parsed again only then (a long call is not re-parsed on every token)
        if not any(c in text[self.parsed_upto:] for c in "}>"):
            return self.calls, start
        self.parsed_upto = len(text)
        return parser.complete_calls(text[start:]), start

    def _named_delta(self, text: str) -> dict:
        new = text[self.arguments_sent:]
        if self.calls and not new:
            return {}
        self.arguments_sent = len(text)
        if not self.calls:
            self.calls.append(ToolCall(self.plan.new_id(), self.plan.function, ""))
            return {"tool_calls": [{"index": 0, **ToolCall(self.calls[0].id, self.plan.function, new).as_json()}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}

    def finish_reason(self, reason: str | None) -> str | None:
        """A call begun in the stream counts, closed or not: the client has its id and name (vLLM's rule)."""
        return self.plan.finish_reason(bool(self.calls) or self.streaming is not None, reason)
