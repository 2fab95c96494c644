"""StructuredOutputsParams: what a request's output must match (vLLM's fields and semantics).

A contract type below SamplingParams (which holds one as `structured_outputs`); kvfit.structured
compiles it. Exactly one kind is set: json (a JSON schema), regex, choice, grammar (Lark or GBNF,
as vLLM's `guidance` backend accepts), json_object (any JSON object). The options
disable_any_whitespace, disable_additional_properties and whitespace_pattern shape JSON output and
are refused with the other kinds (they could not be honoured there). structural_tag is vLLM's too,
but kvfit refuses it: a clear error instead of output that ignores it.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field, fields

from kvfit.errors import RequestError

PARAM = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
JSON_KINDS = ("json", "json_object")


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
            try:
                schema = json_module.loads(schema)
            except ValueError as exc:
                _fail(f"json is not valid JSON ({exc}); give a JSON schema object")
        if not isinstance(schema, dict):
            _fail(f"json must be a JSON schema object (a dict or its JSON text), got {type(schema).__name__}")

    def _check_choice(self) -> None:
        if not isinstance(self.choice, (list, tuple)) or not self.choice:
            _fail(f"choice must be a non-empty list of strings, got {self.choice!r:.60}")
        if any(not isinstance(c, str) for c in self.choice):
            _fail("choice must be a list of strings")
        object.__setattr__(self, "choice", tuple(self.choice))

    def _check_options(self, kind: str) -> None:
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            _fail(f"whitespace_pattern must be a regex string, got {type(self.whitespace_pattern).__name__}")
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
            schema = json_module.loads(value) if isinstance(value, str) else value
            value = json_module.dumps(schema, sort_keys=True, separators=(",", ":"))
        return (kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)
