"""The typed JSON field reader (model_facts/fields.py): each kind, each bound, null and absent, and the
one-line errors that name the file, the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from kvfit.errors import ConfigError
from kvfit.model_facts.fields import read_config_json, read_field, read_json_object, read_positive_int


@pytest.mark.parametrize("kind,value,allowed", [
    ("bool", 1, "true or false (a JSON boolean)"),
    ("bool", "true", "true or false (a JSON boolean)"),
    ("int", 2.0, "an integer"),
    ("int", False, "an integer"),                  # a JSON boolean is not a number
    ("number", "1e-5", "a finite number"),
    ("number", float("nan"), "a finite number"),
    ("number", True, "a finite number"),
    ("str", 3, "a string"),
    ("object", [], "a JSON object"),
    ("list", {}, "a JSON list"),
])
def test_a_value_of_the_wrong_kind_is_one_line_naming_file_field_value_and_kind(kind, value, allowed):
    with pytest.raises(ConfigError) as err:
        read_field({"hidden_size": value}, "hidden_size", kind, "m/config.json")
    assert str(err.value) == f"m/config.json: 'hidden_size' must be {allowed}, got {value!r}"


@pytest.mark.parametrize("kind,value,bounds,allowed", [
    ("int", 1, {"minimum": 2}, "an integer >= 2"),
    ("int", 0, {"minimum": 1}, "a positive integer"),
    ("int", 3, {"above": 3}, "an integer > 3"),
    ("number", 0.5, {"minimum": 1}, "a finite number >= 1"),
    ("number", -1.0, {"above": 0}, "a positive finite number"),
])
def test_a_value_out_of_bounds_names_the_bounds(kind, value, bounds, allowed):
    with pytest.raises(ConfigError) as err:
        read_field({"f": value}, "f", kind, "f.json", **bounds)
    assert str(err.value) == f"f.json: 'f' must be {allowed}, got {value!r}"


def test_values_within_bounds_come_back_and_numbers_as_floats():
    assert read_field({"f": 2}, "f", "int", minimum=2) == 2
    assert read_field({"f": 4}, "f", "number", above=3) == 4.0
    assert isinstance(read_field({"f": 4}, "f", "number"), float)
    assert read_field({"f": [1]}, "f", "list") == [1] and read_field({"f": {}}, "f", "object") == {}


def test_absent_or_null_is_the_default_and_a_required_one_is_missing():
    assert read_field({}, "f", "int") is None
    assert read_field({"f": None}, "f", "int", default=7) == 7
    assert read_field({}, "f", "int", required=True, default=7) == 7       # a default satisfies required
    with pytest.raises(ConfigError) as err:
        read_field({"f": None}, "f", "int", "x.json", required=True)
    assert str(err.value) == "x.json: missing 'f'; a Hugging Face config for this architecture needs it"


def test_a_default_is_not_checked_against_the_bounds():
    assert read_field({}, "f", "int", default=0, minimum=1) == 0


def test_a_long_value_is_cut_short_and_the_error_stays_one_line():
    with pytest.raises(ConfigError) as err:
        read_field({"f": "x" * 10_000}, "f", "int")
    message = str(err.value)
    assert message.endswith("...") and len(message) < 120 and "\n" not in message


def test_an_integer_past_floats_range_is_not_a_finite_number():
    with pytest.raises(ConfigError, match="'f' must be a finite number"):
        read_field({"f": 10**400}, "f", "number")


def test_read_positive_int():
    assert read_positive_int({"n": 3}, "n") == 3
    assert read_positive_int({}, "n", default=5) == 5
    with pytest.raises(ConfigError, match="^config.json: 'n' must be a positive integer, got 0$"):
        read_positive_int({"n": 0}, "n")
    with pytest.raises(ConfigError, match="^a.json: missing 'n'"):
        read_positive_int({}, "n", "a.json")


@pytest.mark.parametrize("text,message", [
    ('{"a": 1,', "is not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("[" * 100_000, "nested too deeply"),
    ('{"a": ' + "9" * 5000 + "}", "is not valid JSON"),          # past Python's int digit limit
])
def test_read_json_object_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_json_object(str(path))
    assert str(path) in str(err.value) and message in str(err.value) and "\n" not in str(err.value)


def test_read_json_object_of_an_unreadable_path(tmp_path):
    with pytest.raises(ConfigError, match="^cannot read "):
        read_json_object(str(tmp_path))           # a folder


def test_read_config_json_needs_the_file(tmp_path):
    with pytest.raises(ConfigError, match="^no config.json at "):
        read_config_json(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert read_config_json(str(tmp_path / "config.json")) == {"hidden_size": 8}
