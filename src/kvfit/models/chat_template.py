"""Render a model's Jinja chat template the way transformers does (sandboxed, same helpers and flags)."""

from __future__ import annotations

import json
from datetime import datetime

from kvfit.errors import ConfigError, RequestError


def _environment():
    import jinja2
    from jinja2 import nodes
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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# template variables the renderer sets itself: chat_template_kwargs may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
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
    """A compiled template; a template that does not parse is a ConfigError."""
    import jinja2
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
                         template_kwargs: dict | None = None, tools: list | None = None) -> str:
    """Render messages as transformers' apply_chat_template(tokenize=False) does; an error the
    template raises (e.g. roles out of order) or a bad option is a RequestError.

    continue_final_message: the last message is left open (no end-of-turn after it), so the model
    continues it. template_kwargs: extra template variables (vLLM's chat_template_kwargs, e.g.
    enable_thinking); they override the special tokens, as in transformers. tools: OpenAI function
    tools, passed as transformers passes them (None: no tools)."""
    import jinja2
    if continue_final_message and add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true; set "
                           "add_generation_prompt to false to continue the last message", "continue_final_message")
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(template_kwargs or ()))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them; use the "
                           "request fields)", "chat_template_kwargs")
    plain = [dict(m) for m in messages]
    final = None
    if continue_final_message:
        if not plain or not isinstance(plain[-1].get("content"), str):
            raise RequestError("continue_final_message needs a last message with text content",
                               "continue_final_message")
        final = plain[-1]["content"]
        plain[-1]["content"] = final + _CONTINUE_TAG
    variables = {**special_tokens, **(template_kwargs or {})}
    try:
        text = template.render(messages=plain, add_generation_prompt=add_generation_prompt, tools=tools,
                               documents=None, **variables)
    except jinja2.TemplateError as exc:
        raise RequestError(f"the chat template rejected these messages: {exc}") from None
    return text if final is None else _cut_at_continue_tag(text, final)


def _cut_at_continue_tag(text: str, final: str) -> str:
    """The rendered chat up to the end of the last message's text (transformers' rule)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise RequestError("continue_final_message: the chat template does not render the last message's text "
                           "as given, so it cannot be continued", "continue_final_message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
