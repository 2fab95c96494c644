"""A typed reader of JSON fields: config.json and the other files of a model folder.

Every value is checked against its kind (bool, int, number, str, object, list) and bounds; a wrong one is
a one-line ConfigError naming the file, the field, the value and what is allowed. Absent or null means
the default, as transformers reads it. No torch.
"""

from __future__ import annotations

import json
import math
import os

from kvfit.errors import ConfigError


def show(value) -> str:
    """repr of a config value, cut short so an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite_float(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:   # an integer past float's range
        return None
    return number if math.isfinite(number) else None


# kind -> (check, what the error says is allowed)
_KINDS = {
    "bool": (lambda v: isinstance(v, bool), "true or false (a JSON boolean)"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: _finite_float(v) is not None, "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a JSON list"),
}


def read_field(cfg: dict, name: str, kind: str, source: str = "config.json", default=None, required: bool = False,
               minimum=None, above=None, maximum=None):
    """cfg[name] checked against kind (bool, int, number, str, object, list) and the bounds (value >= minimum,
    value > above, value <= maximum); absent or null gives default, as transformers does. Anything else is a one-line
    ConfigError naming source, the field, the value and what is allowed. A "number" comes back as a float.
    """
    value = cfg.get(name)
    if value is None:
        if required and default is None:
            raise ConfigError(f"{source}: missing '{name}'; a Hugging Face config for this architecture needs it")
        return default
    check, allowed = _KINDS[kind]
    in_range = check(value) and (minimum is None or value >= minimum) and (above is None or value > above) \
        and (maximum is None or value <= maximum)
    if not in_range:
        raise ConfigError(f"{source}: '{name}' must be {_allowed(kind, allowed, minimum, above, maximum)}, "
                          f"got {show(value)}")
    return float(value) if kind == "number" else value


def _allowed(kind: str, allowed: str, minimum, above, maximum=None) -> str:
    if kind == "int" and minimum == 1 and above is None and maximum is not None:
        return f"an integer from 1 to {maximum:,} (far past any published model; fix the file)"
    if kind == "int" and minimum == 1 and above is None:
        return "a positive integer"
    if kind == "number" and above == 0 and minimum is None and maximum is None:
        return "a positive finite number"
    return allowed + "".join(f" {op} {bound}" for op, bound in ((">=", minimum), (">", above), ("<=", maximum))
                             if bound is not None)


def read_positive_int(cfg: dict, name: str, source: str = "config.json", default=None, maximum=None) -> int:
    """cfg[name], a required integer >= 1 (and <= maximum, if given; default when absent, if given)."""
    return read_field(cfg, name, "int", source, default=default, required=True, minimum=1, maximum=maximum)


def read_json_object(path: str) -> dict:
    """Parse a JSON file that must hold an object; malformed, too deeply nested or with integers past
    Python's 4,300 digits, it is a one-line ConfigError naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to parse; fix or replace the file") from None
    except (ValueError, UnicodeDecodeError) as exc:   # JSONDecodeError, and the int digit limit
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path} is not valid JSON ({reason}); fix or replace the file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}; fix or replace the file")
    return data


def read_config_json(path: str) -> dict:
    """Parse a config.json file; a missing or malformed file is a ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json at {path}: give a Hugging Face model folder, a config.json or a catalog name")
    return read_json_object(path)
