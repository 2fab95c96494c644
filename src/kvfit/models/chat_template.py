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


def compile_chat_template(source: str):
    """A compiled template; a template that does not parse is a ConfigError."""
    import jinja2
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the model's chat_template does not parse (line {exc.lineno}: {exc.message}); "
                          "fix tokenizer_config.json or chat_template.jinja") from None


def render_chat_template(template, messages: list[dict], add_generation_prompt: bool,
                         special_tokens: dict[str, str]) -> str:
    """Render messages; an error the template raises (e.g. roles out of order) is a RequestError."""
    import jinja2
    plain = [dict(m) for m in messages]
    try:
        return template.render(messages=plain, add_generation_prompt=add_generation_prompt, tools=None,
                               documents=None, **special_tokens)
    except jinja2.TemplateError as exc:
        raise RequestError(f"the chat template rejected these messages: {exc}") from None
