"""StructuredOutputsParams: what a request's output must match (vLLM's fields and semantics).

A contract type below SamplingParams (which holds one as `structured_outputs`); kvfit.structured
compiles it. Exactly one kind is set: json (a JSON schema), regex, choice, grammar (Lark or GBNF,
as vLLM's `guidance` backend accepts), json_object (any JSON object). The options
disable_any_whitespace, disable_additional_properties and whitespace_pattern shape JSON output and
are refused with the other kinds (they could not be honoured there). structural_tag is vLLM's too,
but kvfit refuses it: a clear error instead of output that ignores it.

Every constraint is bounded when it is built (a RequestError naming the field and the limit, a 400 from
the server): the limits below keep llguidance well inside what it compiles safely and quickly (a chain of
about 2,600 grammar rules or $refs overflows its stack and kills the process; a 50,000-entry choice takes
seconds). docs/reliability.md lists them.
"""

from __future__ import annotations

import json as json_module
import re
from dataclasses import dataclass, field, fields

from kvfit.errors import RequestError

PARAM = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
JSON_KINDS = ("json", "json_object")

MAX_SPEC_CHARS = 128 * 1024     # a regex, a grammar, a JSON schema (as compact JSON text), all choices together
MAX_CHOICES = 8192              # entries of a choice
MAX_GRAMMAR_RULES = 1000        # rule and terminal definitions of a Lark or GBNF grammar
MAX_SCHEMA_DEPTH = 32           # nesting of a JSON schema's objects and arrays (as the request body's own limit)
MAX_SCHEMA_REFS = 1000          # "$ref"s in a JSON schema (a chain of them nests as deep as it is long)
MAX_WHITESPACE_PATTERN_CHARS = 1024
# a definition at the start of a line: Lark `name:` / `NAME.2:` / `?name:`, GBNF `name ::=`
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:[ \t]*\.[ \t]*-?\d+)?[ \t]*(?:::=|:)", re.M)
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _fail(message: str):
    raise RequestError(f"structured_outputs: {message}", PARAM)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; `kind` says which, `key` identifies it (the grammar cache key).

    json may be a schema dict or its JSON text; choice a list or tuple of strings (stored as a tuple).
    """

    json: str | dict | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            _fail(f"set exactly one of {', '.join(KINDS)} (got {' and '.join(given) if given else 'none'})")
        kind = given[0]
        if kind == "json":
            self._check_json()
        elif kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            _fail(f"{kind} must be a string, got {type(getattr(self, kind)).__name__}")
        elif kind == "grammar" and not self.grammar.strip():
            _fail("grammar is empty; give a Lark or GBNF grammar")
        elif kind in ("regex", "grammar"):
            _check_text_size(kind, getattr(self, kind))
            if kind == "grammar":
                _check_rules(self.grammar)
        elif kind == "choice":
            self._check_choice()
        elif kind == "json_object" and self.json_object is not True:
            _fail(f"json_object must be true (or left unset), got {self.json_object!r}")
        elif kind == "structural_tag":
            _fail("structural_tag is not supported by kvfit; use json, regex, choice or grammar")
        self._check_options(kind)

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            _check_text_size("json", schema)
            _check_text_depth(schema)           # before parsing: json.loads recurses once per level
            try:
                schema = json_module.loads(schema)
            except ValueError as exc:
                _fail(f"json is not valid JSON ({exc}); give a JSON schema object")
        if not isinstance(schema, dict):
            _fail(f"json must be a JSON schema object (a dict or its JSON text), got {type(schema).__name__}")
        _check_schema_shape(schema)
        text = self._canonical_json(schema)
        _check_text_size("json", text)
        object.__setattr__(self, "_json_text", text)       # the cache key's form, computed once

    def _canonical_json(self, schema=None) -> str:
        if schema is None:
            schema = json_module.loads(self.json) if isinstance(self.json, str) else self.json
        try:
            return json_module.dumps(schema, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            _fail(f"json must hold JSON values only ({exc})")

    def _check_choice(self) -> None:
        if not isinstance(self.choice, (list, tuple)) or not self.choice:
            _fail(f"choice must be a non-empty list of strings, got {self.choice!r:.60}")
        if any(not isinstance(c, str) for c in self.choice):
            _fail("choice must be a list of strings")
        if len(self.choice) > MAX_CHOICES:
            _fail(f"choice has {len(self.choice)} entries, more than kvfit's limit of {MAX_CHOICES}; give fewer "
                  "choices, or a regex or grammar that describes them")
        total = sum(map(len, self.choice))
        if total > MAX_SPEC_CHARS:
            _fail(f"choice entries hold {total} characters together, more than kvfit's limit of {MAX_SPEC_CHARS}")
        object.__setattr__(self, "choice", tuple(self.choice))

    def _check_options(self, kind: str) -> None:
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            _fail(f"whitespace_pattern must be a regex string, got {type(self.whitespace_pattern).__name__}")
        if self.whitespace_pattern is not None and len(self.whitespace_pattern) > MAX_WHITESPACE_PATTERN_CHARS:
            _fail(f"whitespace_pattern has {len(self.whitespace_pattern)} characters, more than kvfit's limit of "
                  f"{MAX_WHITESPACE_PATTERN_CHARS}")
        options = [n for n in ("disable_any_whitespace", "disable_additional_properties") if getattr(self, n)]
        options += ["whitespace_pattern"] * (self.whitespace_pattern is not None)
        if options and kind not in JSON_KINDS:
            _fail(f"{', '.join(options)} applies to json and json_object only, not to {kind}")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            _fail("set disable_any_whitespace or whitespace_pattern, not both")
        if self.disable_additional_properties and kind != "json":
            _fail("disable_additional_properties applies to json only")

    @classmethod
    def from_dict(cls, value) -> "StructuredOutputsParams":
        """From a request's `structured_outputs` object (HTTP JSON or an offline dict); RequestError naming
        an unknown field or a value that is not an object."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _fail(f"must be an object with one of {', '.join(KINDS)}, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            _fail(f"unknown field {unknown[0]!r}; the fields are {', '.join(f.name for f in fields(cls))}")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, regex, choice, grammar, json_object."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """A hashable identity of the constraint: equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            # computed when built; a copy rebuilt from the fields alone (another process) computes it again
            value = self.__dict__.get("_json_text") or self._canonical_json()
        return (kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


def _check_text_size(kind: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        _fail(f"{kind} has {len(text)} characters, more than kvfit's limit of {MAX_SPEC_CHARS}; give a smaller "
              f"{'schema' if kind == 'json' else kind}")


def _check_rules(grammar: str) -> None:
    num_rules = len(_RULE.findall(grammar))
    if num_rules > MAX_GRAMMAR_RULES:
        _fail(f"grammar defines {num_rules} rules, more than kvfit's limit of {MAX_GRAMMAR_RULES}; give a "
              "smaller grammar")


def _depth_failure() -> None:
    _fail(f"json: the schema nests deeper than kvfit's limit of {MAX_SCHEMA_DEPTH} levels; flatten it (use $defs "
          "for repeated parts)")


def _check_text_depth(text: str) -> None:
    """JSON text nesting past MAX_SCHEMA_DEPTH, found without parsing it (strings skipped)."""
    if text.count("[") + text.count("{") <= MAX_SCHEMA_DEPTH:
        return
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_SCHEMA_DEPTH:
                _depth_failure()
        elif bracket in "]}":
            depth -= 1


def _check_schema_shape(schema: dict) -> None:
    """Nesting within MAX_SCHEMA_DEPTH and "$ref"s within MAX_SCHEMA_REFS, walked without recursion
    (an offline caller may hand a dict of any depth)."""
    num_refs = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            _depth_failure()
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict) and "$ref" in node:
            num_refs += 1
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    if num_refs > MAX_SCHEMA_REFS:
        _fail(f"json: the schema has {num_refs} $refs, more than kvfit's limit of {MAX_SCHEMA_REFS}; give a "
              "smaller schema")
