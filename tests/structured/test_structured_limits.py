"""Issue 27 (1), (8), (9) and the low items: specs past kvfit's limits are refused when built, naming the field
and the limit; a definition that crashes llguidance is refused from a child process while this one survives;
a Rust panic is one clear line; the compiled-grammar cache is bounded by bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvfit.errors import RequestError
from kvfit.structured_params import (MAX_CHOICES, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_REFS, MAX_SPEC_CHARS,
                                     StructuredOutputsParams as Params)

from grammar_bombs import CHAIN, lark_chain, ref_chain

pytest.importorskip("llguidance")


def _refused(limit_words: list[str], **kwargs) -> str:
    with pytest.raises(RequestError) as info:
        Params(**kwargs)
    message = str(info.value)
    assert info.value.param == "structured_outputs" and "\n" not in message
    for word in limit_words:
        assert word in message, message
    return message


def test_the_crashing_specs_of_issue_27_are_refused_when_built():
    _refused(["grammar", str(MAX_GRAMMAR_RULES)], grammar=lark_chain(CHAIN))
    _refused(["$ref", str(MAX_SCHEMA_REFS)], json=ref_chain(CHAIN))
    _refused(["$ref", str(MAX_SCHEMA_REFS)], json=ref_chain(CHAIN, all_of=True))
    _refused(["kvfit's limit"], json=json.dumps(ref_chain(CHAIN, all_of=True)))     # as text: past the size first


def test_deep_and_large_specs_are_refused_without_recursion():
    deep_text = '{"a":' * 5000 + "1" + "}" * 5000            # (8): json.loads recursed, a 500 before
    _refused(["json", str(MAX_SCHEMA_DEPTH)], json=deep_text)
    deep = node = {}
    for _ in range(100_000):                                  # an offline dict of any depth
        node["a"] = node = {}
    _refused([str(MAX_SCHEMA_DEPTH)], json=deep)
    _refused(["choice", str(MAX_CHOICES)], choice=[str(i) for i in range(90_000)])
    _refused(["regex", str(MAX_SPEC_CHARS)], regex="a" * (MAX_SPEC_CHARS + 1))
    _refused(["whitespace_pattern"], json={"type": "object"}, whitespace_pattern=" " * 5000)
    # within the limits, a schema with a string "[" deep inside strings is no nesting at all
    Params(json=json.dumps({"type": "string", "description": "[" * 100}))


def test_a_definition_that_crashes_llguidance_is_refused_from_a_child_process():
    from kvfit.structured.grammar import grammar_definition
    from kvfit.structured.validate import check_definition
    import llguidance
    definition = llguidance.grammar_from("grammar", lark_chain(CHAIN))   # past the rule limit, checked anyway
    with pytest.raises(RequestError) as info:
        check_definition("grammar", definition)
    assert "crashed" in str(info.value) and info.value.param == "structured_outputs"
    # this process is alive, and a good spec still validates
    check_definition("json", grammar_definition(Params(json=ref_chain(500))))


def test_a_slow_check_is_stopped_at_its_timeout():
    from kvfit.structured.grammar import grammar_definition
    from kvfit.structured.validate import check_definition
    definition = grammar_definition(Params(choice=[f"c{i}" for i in range(MAX_CHOICES)]))
    with pytest.raises(RequestError) as info:
        check_definition("choice", definition, timeout_s=0.001)
    assert "did not finish" in str(info.value)


def test_a_rust_panic_is_one_line_without_build_paths():
    from kvfit.structured.validate import one_line
    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10 <backtrace> 0: <unknown>\n"
             " 16: type_call at /tmp/python-build.2026/Python-3.11.7/Objects/typeobject.c:1091:11")
    line = one_line(panic)
    assert "\n" not in line and "/tmp" not in line and "backtrace" not in line
    assert line.startswith("the grammar library cannot build this grammar") and "give a smaller one" in line


def test_the_http_front_end_check_is_a_400_naming_the_field():
    from kvfit.server.prepare import _check_grammar
    from kvfit.server.protocol import APIError, CompletionRequest
    for fields in ({"grammar": lark_chain(CHAIN)}, {"json": '{"a":' * 5000 + "1" + "}" * 5000},
                   {"regex": "(unclosed"}):
        body = CompletionRequest(prompt="a", structured_outputs=fields)
        with pytest.raises(APIError) as info:
            _check_grammar(body)
        assert info.value.status == 400 and info.value.param == "structured_outputs", info.value


def test_a_crashing_spec_does_not_kill_the_process_that_checks_it():
    # the whole front-end path in a fresh interpreter: it must exit 0 with a refusal, not die of SIGSEGV
    code = ("import json, llguidance\n"
            "from kvfit.structured.validate import check_definition\n"
            "from kvfit.errors import RequestError\n"
            f"defs = {{f'a{{i}}': {{'$ref': f'#/$defs/a{{i + 1}}'}} for i in range({CHAIN})}}\n"
            f"defs['a{CHAIN}'] = {{'type': 'string'}}\n"
            "d = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({'$ref': '#/$defs/a0', '$defs': defs}))\n"
            "try:\n    check_definition('json', d)\nexcept RequestError as e:\n    print('refused:', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "crashed" in done.stdout
