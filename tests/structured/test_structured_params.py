"""StructuredOutputsParams: vLLM's fields, exactly one kind, every mistake a one-line RequestError."""

from __future__ import annotations

import dataclasses

import pytest

from kvfit.errors import RequestError
from kvfit.structured_params import StructuredOutputsParams as Params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs, kind", [
    (dict(json=SCHEMA), "json"), (dict(json='{"type": "string"}'), "json"), (dict(regex="[0-9]+"), "regex"),
    (dict(choice=["a", "b"]), "choice"), (dict(grammar='start: "x"'), "grammar"),
    (dict(json_object=True), "json_object"),
    (dict(json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True), "json"),
    (dict(json_object=True, whitespace_pattern=r"[ ]?"), "json_object")])
def test_one_kind_is_accepted(kwargs, kind):
    spec = Params(**kwargs)
    assert spec.kind == kind
    assert hash(spec.key) == hash(Params(**kwargs).key)


def test_choice_is_stored_as_a_tuple_and_the_spec_is_frozen():
    spec = Params(choice=["x", "y"])
    assert spec.choice == ("x", "y")
    assert spec == Params(choice=("x", "y")) and hash(spec) == hash(Params(choice=("x", "y")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.regex = "a"


def test_key_identifies_the_constraint():
    assert Params(json=SCHEMA).key == Params(json='{"required": ["a"], "properties": {"a": {"type": "integer"}},'
                                                  ' "type": "object"}').key
    assert Params(json=SCHEMA).key != Params(json=SCHEMA, disable_any_whitespace=True).key
    assert Params(regex="a").key != Params(grammar="a").key
    assert hash(Params(json=SCHEMA)) == hash(Params(json=SCHEMA))   # a dict schema does not break hashing


@pytest.mark.parametrize("kwargs, words", [
    (dict(), ["exactly one", "none"]),
    (dict(regex="a", choice=["a"]), ["exactly one", "regex and choice"]),
    (dict(json="{not json"), ["json is not valid JSON"]),
    (dict(json="[1, 2]"), ["JSON schema object", "list"]),
    (dict(json=3), ["JSON schema object", "int"]),
    (dict(regex=5), ["regex must be a string"]),
    (dict(grammar="  "), ["grammar is empty"]),
    (dict(choice=[]), ["choice must be a non-empty list"]),
    (dict(choice="abc"), ["choice must be a non-empty list"]),
    (dict(choice=["a", 1]), ["list of strings"]),
    (dict(json_object=False), ["json_object must be true"]),
    (dict(structural_tag='{"type": "structural_tag"}'), ["structural_tag is not supported"]),
    (dict(regex="a", disable_any_whitespace=True), ["disable_any_whitespace applies to json", "not to regex"]),
    (dict(choice=["a"], whitespace_pattern=" "), ["whitespace_pattern applies to json"]),
    (dict(json_object=True, disable_additional_properties=True), ["disable_additional_properties applies to json"]),
    (dict(json=SCHEMA, disable_any_whitespace=True, whitespace_pattern=" "), ["not both"]),
    (dict(json=SCHEMA, disable_any_whitespace="yes"), ["disable_any_whitespace must be true or false"]),
    (dict(json=SCHEMA, whitespace_pattern=1), ["whitespace_pattern must be a regex string"]),
])
def test_mistakes_are_one_line_request_errors(kwargs, words):
    with pytest.raises(RequestError) as info:
        Params(**kwargs)
    message = str(info.value)
    assert info.value.param == "structured_outputs"
    assert message.startswith("structured_outputs: ") and "\n" not in message
    for word in words:
        assert word in message, message


def test_from_dict_takes_a_request_object_and_names_unknown_fields():
    assert Params.from_dict({"choice": ["a"]}) == Params(choice=["a"])
    spec = Params(regex="x")
    assert Params.from_dict(spec) is spec
    for value, words in (({"regex": "x", "guided_regex": "y"}, "unknown field 'guided_regex'"),
                         ("[0-9]", "must be an object"), ({}, "exactly one")):
        with pytest.raises(RequestError, match=words) as info:
            Params.from_dict(value)
        assert info.value.param == "structured_outputs"
