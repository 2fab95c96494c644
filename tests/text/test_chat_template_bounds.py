"""Issue 27 (12) and (8): a chat template that loops, recurses, includes, builds a huge value or trips over
chat_template_kwargs is a one-line RequestError (the server's 400), and a loop is stopped where it runs."""

from __future__ import annotations

import sys
import time

import pytest

from kvfit.errors import RequestError
from kvfit.text import chat_template
from kvfit.text.chat_template import compile_chat_template, render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _refused(source: str, *words: str, **kwargs) -> str:
    with pytest.raises(RequestError) as info:
        render_chat_template(compile_chat_template(source), MESSAGES, True, {"eos_token": "</s>"}, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    for word in words:
        assert word in message, message
    return message


def test_a_looping_template_is_stopped_at_its_cpu_budget(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_CPU_SECONDS", 0.2)
    trace = sys.gettrace()
    start = time.monotonic()
    _refused(LOOP, "CPU time", "0.2 s")
    assert time.monotonic() - start < 5
    assert sys.gettrace() is trace          # the thread's own trace hook (a debugger, coverage) is back


@pytest.mark.parametrize("source, words", [
    ("{% for i in range(10**9) %}{% endfor %}", ["1000000000", "limit"]),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ["recursed"]),
    ("{% for m in [1] recursive %}{{ loop([1]) }}{% endfor %}", ["recursed"]),
    ("{% include 'other.jinja' %}", ["includes or imports 'other.jinja'"]),
    ("{% import 'macros.jinja' as m %}{{ m.x() }}", ["includes or imports 'macros.jinja'"]),
    ("{% extends 'base.jinja' %}", ["'base.jinja'"]),
    ("{{ 'a' * 10**9 }}", ["repeat"]),
    ("{{ 2 ** 100000000 }}", ["bits"]),
    ("{{ 'a'|center(10**9) }}", ["center"]),
    ("{{ 'a'.ljust(10**9) }}", ["ljust"]),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", ["~"]),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", ["+"]),
    ("{{ ('a' * 100000)|replace('a', 'a' * 1000) }}", ["replace"]),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}" * 2, ["rendered chat"]),
    ("{{ '{:>10000000000}'.format(1) }}", ["format width"]),
    ("{{ '{a:>10000000000}'.format_map({'a': 1}) }}", ["format width"]),
    ("{{ '%10000000000d' % 1 }}", ["format width"]),
    ("{{ '%10000000000d'|format(1) }}", ["format width"]),
    ("{{ messages[0].content + 1 }}", ["TypeError"]),
])
def test_what_used_to_be_a_500_or_a_hang_is_one_clear_line(source, words):
    _refused(source, *words)


def test_ordinary_formatting_still_renders():
    template = compile_chat_template("{{ '{0:>4}|{a}'.format(3, a='x') }}{{ '%3d' % 7 }}{{ 7 % 3 }}")
    assert render_chat_template(template, MESSAGES, False, {}) == "   3|x  71"


def test_chat_template_kwargs_cannot_shadow_helpers_and_self_is_a_plain_variable():
    _refused("{{ raise_exception('x') }}", "raise_exception", template_kwargs={"raise_exception": 1})
    template = compile_chat_template("{{ self_note }}{{ messages[0].content }}")
    # before: render(**kwargs) took "self" as its own parameter (TypeError, a 500)
    assert render_chat_template(template, MESSAGES, False, {}, template_kwargs={"self": 1, "self_note": "n:"}) == "n:hi"


def test_a_looping_template_through_the_prepare_step_is_a_400(monkeypatch):
    from kvfit.server.prepare import PrepareContext, prepare_request
    from kvfit.server.protocol import APIError, ChatCompletionRequest
    monkeypatch.setattr(chat_template, "MAX_RENDER_CPU_SECONDS", 0.2)

    class Tok:
        chat_template = LOOP

        def apply_chat_template(self, messages, add_generation_prompt, **kwargs):
            return render_chat_template(compile_chat_template(LOOP), messages, add_generation_prompt, {})
    context = PrepareContext(model_names=("m",), chat_template=None, max_prompt_chars=10**6, max_model_len=512)
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    with pytest.raises(APIError) as info:
        prepare_request(raw, ChatCompletionRequest, context, Tok(), {})
    assert info.value.status == 400 and "CPU time" in info.value.message
