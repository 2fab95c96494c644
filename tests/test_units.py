"""Byte sizes: parse_bytes accepts the usual spellings, rejects the rest naming the flag; gib formats."""

from __future__ import annotations

import pytest

from kvfit.errors import ConfigError
from kvfit.units import GiB, MiB, gib, parse_bytes


def test_constants():
    assert GiB == 2**30 and MiB == 2**20


@pytest.mark.parametrize("text,expected", [
    (1, 1),
    (150_109_880_320, 150_109_880_320),
    ("  1024B  ", 1024),
    ("1024B", 1024),
    ("1024 b", 1024),
    ("80GiB", 80 * 2**30),
    ("80 GiB", 80 * 2**30),
    ("80gib", 80 * 2**30),
    ("80Gi", 80 * 2**30),
    ("80GB", 80 * 10**9),
    ("80 gb", 80 * 10**9),
    ("80G", 80 * 10**9),
    ("1.5GiB", 3 * 2**29),
    ("0.5 MiB", 2**19),
    (".5KiB", 512),
    ("2KiB", 2048),
    ("2Ki", 2048),
    ("2KB", 2000),
    ("2k", 2000),
    ("3MB", 3 * 10**6),
    ("3M", 3 * 10**6),
    ("7MiB", 7 * 2**20),
    ("1TB", 10**12),
    ("1T", 10**12),
    ("1TiB", 2**40),
    ("1Ti", 2**40),
    ("1.5e9B", 1_500_000_000),
    ("8e9 B", 8 * 10**9),
    ("2E3b", 2000),
    ("1e-3GB", 10**6),
    ("1.5e3 MiB", 1500 * 2**20),
    (1.5e9, 1_500_000_000),            # a float from a YAML/JSON config
])
def test_parse_bytes_forms(text, expected):
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


def test_fractions_round_down_to_whole_bytes():
    assert parse_bytes("1.9B") == 1
    assert parse_bytes(1.9) == 1
    assert parse_bytes("0.1GiB") == int(0.1 * 2**30)


@pytest.mark.parametrize("text", ["", "   ", "GiB", "80 GiBs", "80XB", "eighty", "80 G i B", "1,024", "80GiB!",
                                  "--80", "-80GiB", "+80", "1e", "0x10", "inf", "nan", None, [80], True, False])
def test_not_a_byte_size(text):
    with pytest.raises(ConfigError) as err:
        parse_bytes(text, flag="--kv-cache-memory")
    msg = str(err.value)
    assert msg.startswith("--kv-cache-memory")
    assert "GiB" in msg and "\n" not in msg


@pytest.mark.parametrize("text", ["80", "1024", " 80 ", "8e9", "1.5", "0"])
def test_text_without_a_unit_is_rejected(text):
    # `--device-memory 80` would mean 80 bytes: nobody means that, so a unit is required
    with pytest.raises(ConfigError) as err:
        parse_bytes(text, flag="--device-memory")
    assert str(err.value).startswith("--device-memory needs a unit, e.g. 80GiB or 80GB")


@pytest.mark.parametrize("number,expected", [(8 * GiB, 8 * GiB), (8e9, 8 * 10**9)])
def test_python_numbers_are_bytes(number, expected):
    assert parse_bytes(number) == expected


@pytest.mark.parametrize("number", [float("inf"), 1e400, 2.0**64])
def test_huge_python_numbers_are_too_large(number):
    with pytest.raises(ConfigError, match="too large"):
        parse_bytes(number, flag="kv_cache_memory")


@pytest.mark.parametrize("text", [0, -1, -5 * GiB, "0B", "0GiB", "0.0B", "0.4B", "1e-12GiB", float("nan")])
def test_zero_and_negative_are_rejected(text):
    with pytest.raises(ConfigError, match="--device-memory must be positive"):
        parse_bytes(text, flag="--device-memory")


def test_default_flag_name():
    with pytest.raises(ConfigError, match="^size"):
        parse_bytes("lots")


def test_errors_are_value_errors_too():
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.parametrize("num_bytes,text", [
    (0, "0.00 GiB"),
    (GiB, "1.00 GiB"),
    (GiB // 2, "0.50 GiB"),
    (141 * GiB, "141.00 GiB"),
    (150_109_880_320, f"{150_109_880_320 / 2**30:.2f} GiB"),
    (int(139.8 * GiB), "139.80 GiB"),
    (GiB + GiB // 200, "1.00 GiB"),       # 1.005 rounds to two decimals
    (-2 * GiB, "-2.00 GiB"),
    (1, "0.00 GiB"),
])
def test_gib_formatting(num_bytes, text):
    assert gib(num_bytes) == text


def test_parse_then_format_round_trip():
    for n in (1, 8, 80, 141):
        assert gib(parse_bytes(f"{n}GiB")) == f"{n:.2f} GiB"


def test_large_integer_strings_are_exact():
    assert parse_bytes("9007199254740993B") == 2**53 + 1
