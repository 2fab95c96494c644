"""StructuredOutputsParams -> an llguidance grammar definition, as vLLM's `guidance` backend builds it.

json: the schema through llguidance's JSON compiler (whitespace_flexible unless disable_any_whitespace;
whitespace_pattern passed on; disable_additional_properties adds additionalProperties: false to every
object that lists properties and sets none); json_object: the schema {"type": "object"}; regex; choice
(one literal per choice); grammar: Lark, or GBNF/EBNF converted to Lark by llguidance.
"""

from __future__ import annotations

import copy
import json
import re

import llguidance

from kvfit.errors import RequestError
from kvfit.structured.ascii_regex import ascii_classes
from kvfit.structured.validate import check_definition, one_line
from kvfit.structured_params import PARAM, StructuredOutputsParams

__all__ = ["check_spec", "grammar_definition", "one_line"]


def _close_objects(node):
    """vLLM's disable_additional_properties: additionalProperties false wherever properties are listed."""
    if isinstance(node, dict):
        for value in node.values():
            _close_objects(value)
        if "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for item in node:
            _close_objects(item)


def _json_grammar(spec: StructuredOutputsParams, schema) -> str:
    if isinstance(schema, str):
        schema = json.loads(schema)
    if spec.disable_additional_properties:
        schema = copy.deepcopy(schema)
        _close_objects(schema)
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)


def grammar_definition(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for spec; RequestError (param structured_outputs) when the library refuses it."""
    kind = spec.kind
    try:
        if kind == "json":
            return _json_grammar(spec, spec.json)
        if kind == "json_object":
            return _json_grammar(spec, {"type": "object"})
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        if kind == "regex":            # \d and \w ASCII, as vLLM's default backend (ascii_regex.py)
            return llguidance.grammar_from("regex", ascii_classes(spec.regex))
        return _grammar(spec.grammar)
    except ValueError as exc:
        raise RequestError(f"structured_outputs.{kind}: {one_line(str(exc))}", PARAM) from None


# a Lark rule's name at a line's start (?rule / !rule modifiers, a .priority); terminals are upper case
_LARK_RULE = re.compile(r"^[ \t]*[?!]?([a-z_][a-z0-9_]*)(?:\.\d+)?[ \t]*:", re.MULTILINE)
# a GBNF/EBNF rule definition at a line's start (a `::=` inside a Lark string or comment is not one)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][\w-]*[ \t]*::=", re.MULTILINE)


# an escaped backslash (kept as it is), or a \uXXXX / \UXXXXXXXX escape
_UNICODE_ESCAPE = re.compile(r"(\\\\)|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")
_GBNF_SYNTAX = set('\\"[]-^')


def _unicode_literals(text: str) -> str:
    """GBNF's \\uXXXX and \\UXXXXXXXX escapes (xgrammar's EBNF reads them; llguidance's GBNF reader does not) as
    the characters themselves; one that is GBNF syntax or not printable stays an escape."""
    def literal(match: re.Match) -> str:
        if match.group(1):
            return match.group(1)
        code = int(match.group(2) or match.group(3), 16)
        char = chr(code) if code <= 0x10FFFF else ""
        return char if char.isprintable() and char not in _GBNF_SYNTAX else match.group(0)
    return _UNICODE_ESCAPE.sub(literal, text)


def _grammar(text: str) -> str:
    """A grammar in GBNF/EBNF (`::=`) or Lark, as vLLM takes both: a Lark grammar without a start rule starts at
    its first rule (vLLM's convert_lark_to_ebnf makes that the root)."""
    if _GBNF_RULE.search(text):
        return llguidance.grammar_from("grammar", _unicode_literals(text))
    rules = _LARK_RULE.findall(text)
    if rules and "start" not in rules:
        text = f"{text}\nstart: {rules[0]}\n"          # appended: error positions keep their line numbers
    return llguidance.grammar_from("lark", text)


def check_spec(spec: StructuredOutputsParams) -> str:
    """What a front end does before a request reaches the engine: spec's grammar definition, validated by
    llguidance where a crash or a long check cannot take this process (structured/validate.py); a
    RequestError (param structured_outputs) saying why it is refused. spec's own bounds were checked
    when it was built."""
    definition = grammar_definition(spec)
    check_definition(spec.kind, definition)
    return definition
