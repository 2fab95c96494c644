"""Byte sizes: parsing '80GiB' / '8e9B' and formatting GiB. No torch.

A size written as text needs a unit: `--device-memory 80` would be 80 bytes, never what anyone means,
so it is an error (write 80B for bytes). A Python int or float (LLM(kv_cache_memory=8 * 2**30)) is bytes.
"""

import re

from kvfit.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
# the largest byte count any allocator can be asked for (torch sizes are int64)
MAX_BYTES = (1 << 63) - 1

_UNITS = {
    "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text, flag: str = "size") -> int:
    """Parse '80GiB', '80 GB', '1.5e9B' or a number of bytes; raise ConfigError naming `flag`."""
    if isinstance(text, bool):
        raise ConfigError(f"{flag} must be a byte size like 80GiB or 80GB, got {text!r}")
    if isinstance(text, (int, float)):
        value = _number_bytes(text)
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if unit == "":
            raise ConfigError(f"{flag} needs a unit, e.g. 80GiB or 80GB (B for bytes), got {str(text).strip()[:40]!r}")
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{flag} {text!r} is not a byte size: use a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB or 80GB")
        number = match.group(1)
        if number.isdigit() and len(number) <= 30:   # exact for integers past 2**53, which a float would round
            value = int(number) * _UNITS[unit]
        else:
            scaled = float(number) * _UNITS[unit]   # inf for 1e400 or a 400-digit integer
            value = int(scaled) if scaled <= MAX_BYTES else MAX_BYTES + 1
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    if value > MAX_BYTES:
        raise ConfigError(f"{flag} {str(text)[:40]!r} is too large: at most {MAX_BYTES:,} bytes (8 EiB), e.g. 80GiB")
    return value


def _number_bytes(number) -> int:
    """A Python int or float as bytes (a float from a YAML/JSON config; inf and nan are not sizes)."""
    if isinstance(number, int):
        return number
    if number != number or number in (float("inf"), float("-inf")):
        return MAX_BYTES + 1 if number > 0 else 0
    return int(number) if number <= MAX_BYTES else MAX_BYTES + 1


def gib(num_bytes: int) -> str:
    """Format bytes as GiB with two decimals, e.g. '139.80 GiB'."""
    return f"{num_bytes / GiB:.2f} GiB"


def duration(seconds: float) -> str:
    """Format seconds as minutes and seconds, e.g. '2 min 5 s' ('45 s' under a minute)."""
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"
