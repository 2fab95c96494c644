"""Render a model's Jinja chat template the way transformers does (sandboxed, same helpers and flags).

A template is the operator's (--chat-template) or the model's, but it runs on every chat request with
the client's messages, so rendering is bounded (issue 27, item 12): MAX_RENDER_CPU_SECONDS of the
rendering thread's CPU time (counted on the template's own lines through a per-thread trace hook, so
a loop is stopped where it runs), MAX_RENDERED_CHARS of output, and no single operation that builds a
value past MAX_RENDERED_CHARS (`'a' * n`, `x ** n`, a filter or method given a huge width or count).
Past a bound, a recursing macro, an include/import (kvfit loads no other templates) or any error the
template raises is a RequestError (a 400) saying what happened, never a hung prepare thread or a 500.

A rendering on a thread of a process that also runs an event loop holds that process's GIL: a template that
runs long there slows every stream (a 2 s loop held streams 100-350 ms at a time on 2 cores). Inside
`thread_share(seconds, fn, ...)` a rendering past `seconds` of CPU time stops with RenderOnProcess, and the
server prepares the request again in a worker process (server/prepare_pool.py), where the full bound applies.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from datetime import datetime

from kvfit.errors import ConfigError, RequestError

MAX_RENDER_CPU_SECONDS = 2.0          # CPU time one rendering may take (a 25,000-message chat takes ~0.1 s)
MAX_RENDERED_CHARS = 16 * 2**20       # output of one rendering (more than any --max-model-len can take)
MAX_POWER_BITS = 4096                 # `x ** n` in a template: a result of at most this many bits
_TEMPLATE_FILE = "<template>"         # the code file name of a template compiled from a string
_STEPS_PER_CLOCK_READ = 1024
TEXT_PART_SEPARATOR = "\n"           # a message's text parts become one string (vLLM's "string" content format)
_DIGIT_RUNS = re.compile(r"\d+")


class TemplateBudgetError(Exception):
    """A rendering went past one of this module's bounds."""


class RenderOnProcess(Exception):
    """A rendering inside thread_share ran past the thread's share of CPU time: render it in a process."""


_thread = threading.local()         # share: CPU seconds a rendering on this thread may take (thread_share)


def thread_share(cpu_seconds: float, fn, *args):
    """fn(*args) with every chat template it renders on this thread stopped after cpu_seconds of CPU time
    (RenderOnProcess) instead of MAX_RENDER_CPU_SECONDS."""
    _thread.share = cpu_seconds
    try:
        return fn(*args)
    finally:
        _thread.share = None


def _check_size(what: str, size: int) -> None:
    if size > MAX_RENDERED_CHARS:
        raise TemplateBudgetError(f"{what} of {size} would exceed kvfit's limit of {MAX_RENDERED_CHARS} characters")


def _check_args(name: str, args, kwargs) -> None:
    """An integer argument past MAX_RENDERED_CHARS (a width, a count, a range) is refused before the call."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDERED_CHARS:
            raise TemplateBudgetError(f"{name} called with {value}, past kvfit's limit of {MAX_RENDERED_CHARS}")


def _check_replace(text, old, new) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        _check_size("a replace", len(text) + (text.count(old) if old else len(text) + 1) * (len(new) - len(old)))


def _check_format(fmt) -> None:
    """A format string ('{:>N}', '%Nd') whose width or precision would build a value past MAX_RENDERED_CHARS."""
    if isinstance(fmt, str):
        for digits in _DIGIT_RUNS.findall(fmt):
            if len(digits) > 8 or int(digits) > MAX_RENDERED_CHARS:
                raise TemplateBudgetError(f"a format width of {digits[:20]} is past kvfit's limit of "
                                          f"{MAX_RENDERED_CHARS}")


def _check_result(what: str, value):
    if isinstance(value, (str, list, tuple)):
        _check_size(what, len(value))
    return value


def _bounded_filter(name: str, fn):
    @functools.wraps(fn)        # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        values = [a for a in args if not hasattr(a, "environment")][:3]    # past a passed context/environment
        _check_args(f"the filter {name}", values[1:], kwargs)
        if name == "replace" and len(values) == 3:
            _check_replace(*values)
        if name == "format" and values:
            _check_format(values[0])
        return _check_result(f"the filter {name}'s result", fn(*args, **kwargs))
    return bounded


def _bounded_concat(items) -> str:
    """jinja's `a ~ b` (str_join), refused past MAX_RENDERED_CHARS before it is built."""
    texts = [str(item) for item in items]
    _check_size("a ~ concatenation", sum(map(len, texts)))
    return "".join(texts)


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks; here it renders as-is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own tojson, which escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):
            # `a ~ b` through the environment's bounded concat instead of a bare "".join
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = BoundedCodeGenerator
        bounded_concat = staticmethod(_bounded_concat)

        def call_binop(self, context, operator, left, right):
            if operator == "%":
                _check_format(left)
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                    _check_size("a + concatenation", len(left) + len(right))
            elif operator == "*":
                for seq, count in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                        _check_size("a repeat", len(seq) * count)
            elif isinstance(left, int) and isinstance(right, int) and right > 0:
                if left.bit_length() * right > MAX_POWER_BITS:
                    raise TemplateBudgetError(f"{left} ** {right} is past kvfit's limit of {MAX_POWER_BITS} bits")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            name = getattr(__obj, "__name__", "a function")
            _check_args(name, args, kwargs)
            if name == "replace" and isinstance(getattr(__obj, "__self__", None), str) and len(args) >= 2:
                _check_replace(__obj.__self__, args[0], args[1])
            # the sandbox hands str.format out wrapped (functools.update_wrapper keeps the method as __wrapped__)
            method = getattr(__obj, "__wrapped__", __obj)
            if name in ("format", "format_map") and isinstance(getattr(method, "__self__", None), str):
                _check_format(method.__self__)
            return _check_result(f"{name}'s result", super().call(__context, __obj, *args, **kwargs))

    # an empty loader: {% include %} / {% import %} / {% extends %} find nothing (TemplateNotFound)
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, loader=jinja2.DictLoader({}),
                         extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters.update({name: _bounded_filter(name, fn) for name, fn in env.filters.items()})
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# template variables the renderer sets itself and the helpers templates call: chat_template_kwargs may not
# replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "chat_template", "raise_exception",
                                         "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace"})
# transformers marks the end of the message to continue with this, renders, then cuts there
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# a --chat-template value holding one of these is a template, else a path (vLLM's rule)
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text of --chat-template: a file's contents, or the value itself when it is a
    template (it holds '{', '}' or a newline); ConfigError for a path that cannot be read or a
    template that does not parse."""
    import os
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as fh:
                source = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"cannot read --chat-template {value}: {reason}") from None
    elif any(c in value for c in _TEMPLATE_CHARS):
        source = value
    else:
        raise ConfigError(f"--chat-template {value!r} is not a file (and holds no '{{' or '}}', so it is not an "
                          "inline template); give the path of a .jinja file or the template text")
    compile_chat_template(source, origin="--chat-template")
    return source


def compile_chat_template(source: str, origin: str = "the model's chat_template"):
    """A compiled template; a template that does not parse (or is not text) is a ConfigError."""
    import jinja2
    if not isinstance(source, str):
        raise ConfigError(f"{origin} must be a Jinja template string, got {type(source).__name__}")
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        fix = "fix tokenizer_config.json or chat_template.jinja" if origin.startswith("the model") else "fix it"
        raise ConfigError(f"{origin} does not parse (line {exc.lineno}: {exc.message}); {fix}") from None


def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller (jinja's undeclared variables)."""
    from jinja2 import meta
    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


def render_chat_template(template, messages: list[dict], add_generation_prompt: bool,
                         special_tokens: dict[str, str], continue_final_message: bool = False,
                         template_kwargs: dict | None = None, tools: list | None = None,
                         source: str | None = None, documents: list | None = None) -> str:
    """Render messages as transformers' apply_chat_template(tokenize=False) does; an error the
    template raises (e.g. roles out of order) or a bad option is a RequestError.

    continue_final_message: the last message (its content, or the last text part of a list of parts) is
    left open (no end-of-turn after it), so the model continues it. template_kwargs: extra template
    variables (vLLM's chat_template_kwargs, e.g. enable_thinking); they override the special tokens, as in
    transformers. tools: OpenAI function tools, passed as transformers passes them (None: no tools); documents:
    retrieval documents (transformers' documents=); either may also come in template_kwargs, as vLLM merges
    them (the argument wins). source: the
    template's text (a template that never names the developer role gets developer messages as system ones)."""
    if continue_final_message and add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true; set "
                           "add_generation_prompt to false to continue the last message", "continue_final_message")
    if template_kwargs is not None and (not isinstance(template_kwargs, dict)
                                        or not all(isinstance(k, str) for k in template_kwargs)):
        raise RequestError(f"chat_template_kwargs must be a map from variable names to values, got "
                           f"{type(template_kwargs).__name__}", "chat_template_kwargs")
    template_kwargs = dict(template_kwargs or {})
    tools = template_kwargs.pop("tools", None) if tools is None else tools
    documents = template_kwargs.pop("documents", None) if documents is None else documents
    template_kwargs.pop("tools", None), template_kwargs.pop("documents", None)
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise RequestError("documents must be a list of objects (e.g. {\"title\": ..., \"text\": ...})", "documents")
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(template_kwargs))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (variables the server sets from "
                           "the request's fields, or helpers the template calls)", "chat_template_kwargs")
    plain = messages_for_template(messages, source)
    final = _mark_final_message(plain) if continue_final_message else None
    variables = {**special_tokens, **template_kwargs, "messages": plain,
                 "add_generation_prompt": add_generation_prompt, "tools": tools, "documents": documents}
    text = _render_bounded(template, variables)
    return text if final is None else _cut_at_continue_tag(text, final)


# the names a message's reasoning comes under; templates read reasoning_content (Qwen3), thinking (gpt-oss) or
# reasoning (vLLM's own name)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def messages_for_template(messages: list[dict], source: str | None = None) -> list[dict]:
    """Copies of the messages as the template gets them, as transformers and vLLM prepare them: keys whose value is
    None dropped; a message's reasoning (the first of REASONING_FIELDS it has) also as reasoning_content and
    thinking (transformers' _alias_reasoning_fields); and, for a template that never names the developer role,
    developer messages as system ones, the system messages then merged into one first (vLLM's renderer)."""
    plain = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else message
        if isinstance(message, dict):
            reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        plain.append(message)
    if source is not None and "'developer'" not in source and '"developer"' not in source \
            and any(isinstance(m, dict) and m.get("role") == "developer" for m in plain):
        plain = _developer_as_system(plain)
    return plain


def _developer_as_system(messages: list[dict]) -> list[dict]:
    """vLLM's _convert_developer_to_system then _consolidate_system_messages: developer messages as system ones;
    when a system message is not first or there are several, all of them merged into one first (their texts
    joined by a blank line)."""
    messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                for m in messages]
    systems, others, merge = [], [], False
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system":
            merge = merge or i > 0 or bool(systems)
            content = message.get("content")
            if isinstance(content, list):
                content = "\n".join(p["text"] if isinstance(p, dict) and "text" in p else p
                                     for p in content if isinstance(p, (dict, str)))
            systems.append(content)
        else:
            others.append(message)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(c for c in systems if c)}, *others]


def _mark_final_message(plain: list[dict]) -> str:
    """The last message's text to continue, its end marked with _CONTINUE_TAG in `plain` (a copy): a string
    content, or the last text part of a list of parts (transformers' rule)."""
    content = plain[-1].get("content") if plain else None
    if isinstance(content, str):
        plain[-1]["content"] = content + _CONTINUE_TAG
        return content
    texts = [i for i, part in enumerate(content) if isinstance(part, dict) and isinstance(part.get("text"), str)] \
        if isinstance(content, list) else []
    if not texts:
        raise RequestError("continue_final_message needs a last message with text content", "continue_final_message")
    at, final = texts[-1], content[texts[-1]]["text"]
    plain[-1]["content"] = [*content[:at], {**content[at], "text": final + _CONTINUE_TAG}, *content[at + 1:]]
    return final


def _render_bounded(template, variables: dict) -> str:
    """template rendered with variables (one dict: a kwarg named like render's own parameters is just a
    variable) within this module's bounds; every way it fails is a one-line RequestError."""
    import jinja2
    budget = _Budget(MAX_RENDER_CPU_SECONDS, getattr(_thread, "share", None))
    previous = sys.gettrace()
    sys.settrace(budget.trace)
    try:
        pieces, size = [], 0
        for piece in template.generate(variables):
            size += len(piece)
            _check_size("the rendered chat", size)
            pieces.append(piece)
        return "".join(pieces)
    except TemplateBudgetError as exc:
        raise RequestError(f"the chat template went past a bound rendering these messages: {exc}; the template "
                           "(--chat-template or the model's) must be fixed") from None
    except jinja2.TemplateNotFound as exc:
        raise RequestError(f"the chat template includes or imports {exc.name!r}, but kvfit loads no other "
                           "templates; inline it into the chat template") from None
    except jinja2.TemplateError as exc:
        raise RequestError(f"the chat template rejected these messages: {_one_line(exc)}") from None
    except RenderOnProcess:
        raise
    except RecursionError:
        raise RequestError("the chat template recursed too deeply rendering these messages (a macro or a recursive "
                           "loop that does not end); the template must be fixed") from None
    except Exception as exc:      # the template's own code failed on these messages (or on chat_template_kwargs)
        raise RequestError(f"the chat template failed on these messages: {type(exc).__name__}: "
                           f"{_one_line(exc)}") from None
    finally:
        sys.settrace(previous)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


class _Budget:
    """A per-thread trace hook that stops a template running past its CPU time: it traces only the template's
    own frames, and reads the clock every _STEPS_PER_CLOCK_READ lines. With a thread share (shorter), past the
    share it raises RenderOnProcess instead."""

    def __init__(self, cpu_seconds: float, share: float | None = None):
        start = time.thread_time()
        self.deadline = start + (cpu_seconds if share is None else min(share, cpu_seconds))
        self.cpu_seconds, self.share = cpu_seconds, share
        self.steps = 0

    def trace(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    def _line(self, frame, event, arg):
        self.steps += 1
        if self.steps % _STEPS_PER_CLOCK_READ == 0 and time.thread_time() > self.deadline:
            if self.share is not None and self.share < self.cpu_seconds:
                raise RenderOnProcess()
            raise TemplateBudgetError(f"it ran for more than kvfit's limit of {self.cpu_seconds:g} s of CPU time")
        return self._line


@functools.lru_cache(maxsize=32)
def detected_content_format(source: str) -> str:
    """--chat-template-content-format auto, as vLLM resolves it: "openai" (content as a list of text parts) for a
    template that loops over a message's content (`for part in message['content']`, or over a variable `content`),
    where the messages come from `messages` by a loop (or an assignment of it, a slice, a filter); else "string"."""
    import jinja2
    from jinja2 import nodes
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"

    def unwrap(node):
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def names(node, wanted: set) -> bool:
        node = unwrap(node)
        return isinstance(node, nodes.Name) and node.name in wanted

    def content_of(node, wanted: set) -> bool:
        node = unwrap(node)
        if isinstance(node, nodes.Getitem):
            return names(node.node, wanted) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return isinstance(node, nodes.Getattr) and names(node.node, wanted) and node.attr == "content"

    lists = {"messages"}
    changed = True
    while changed:            # variables assigned from messages (or from one of those)
        before = len(lists)
        lists |= {a.target.name for a in tree.find_all(nodes.Assign)
                  if isinstance(a.target, nodes.Name) and names(a.node, lists)}
        changed = len(lists) != before
    loops = list(tree.find_all(nodes.For))
    items = {loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and names(loop.iter, lists)}
    for loop in loops:
        if content_of(loop.iter, items) or (isinstance(loop.iter, nodes.Name) and loop.iter.name == "content"):
            return "openai"
    return "string"


def as_text_parts(messages: list[dict]) -> list[dict]:
    """messages for a template of the openai content format: a string content as one text part (a tool message's
    stays a string, as vLLM gives it); parts are checked as text_parts_joined checks them."""
    out = []
    for i, (message, joined) in enumerate(zip(messages, text_parts_joined(messages))):
        content = message.get("content")
        if message.get("role") == "tool":
            message = joined
        elif isinstance(content, str):
            message = {**message, "content": [{"type": "text", "text": content}]}
        elif isinstance(content, list):
            message = {**message, "content": [{"type": "text", "text": t} for t in _part_texts(content, i)]}
        elif content is None:
            message = {**message, "content": []}
        out.append(message)
    return out


# content part types vLLM reads as text, and the key that holds it
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _part_texts(content: list, i: int) -> list[str]:
    """The texts of a message's content parts (a plain string part is one, as vLLM reads it)."""
    texts = []
    for part in content:
        key = TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
        if isinstance(part, str):
            texts.append(part)
        elif key is not None and isinstance(part.get(key), str):
            texts.append(part[key])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"messages[{i}].content holds a {kind!r} part; kvfit serves text models, so "
                               "content is a string or a list of {'type': 'text', 'text': ...} parts", "messages")
    return texts


def text_parts_joined(messages: list[dict]) -> list[dict]:
    """messages with a content given as OpenAI parts ([{"type": "text", "text": ...}]) made one string, the parts
    joined by a line break, as vLLM gives them to a template (and as the server does), a null content the empty
    string; a part other than text is a RequestError (kvfit serves text models)."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None and "content" in message:    # an assistant's tool calls alone: "" (vLLM's), not "None"
            message = {**message, "content": ""}
        if isinstance(content, list):
            message = {**message, "content": TEXT_PART_SEPARATOR.join(_part_texts(content, i))}
        out.append(message)
    return out


def tool_arguments_as_objects(messages: list[dict]) -> list[dict]:
    """messages with each assistant tool call's function.arguments as an object, as vLLM hands them to
    Hugging Face templates (which read `tool_call.arguments | tojson`): a JSON string is parsed, an empty
    one (or null) is {}; an empty tool_calls list is dropped (templates test `'tool_calls' in message`). The caller's
    messages are not changed; a malformed call (or one not of type "function") is a RequestError."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if message.get("role") == "assistant" and isinstance(calls, list):
            if calls:
                message = {**message, "tool_calls": [_call_with_object_arguments(c, i) for i, c in enumerate(calls)]}
            else:
                message = {key: value for key, value in message.items() if key != "tool_calls"}
        out.append(message)
    return out


def _call_with_object_arguments(call, i: int) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
            or call.get("type", "function") != "function":
        raise RequestError(f"an assistant message's tool_calls[{i}] must be {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}", "messages")
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:          # not JSON, or an integer past Python's 4,300 digits
            raise RequestError(f"tool_calls[{i}].function.arguments is not JSON: {arguments[:60]!r}",
                               "messages") from None
        if arguments is None:
            arguments = {}
    elif not arguments:
        arguments = {}
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _cut_at_continue_tag(text: str, final: str) -> str:
    """The rendered chat up to the end of the last message's text (transformers' rule)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise RequestError("continue_final_message: the chat template does not render the last message's text "
                           "as given, so it cannot be continued", "continue_final_message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
