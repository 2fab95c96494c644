"""Byte sizes: parsing '80GiB' / '1.5e9' and formatting GiB. No torch."""

import re

from kvfit.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
# the largest byte count any allocator can be asked for (torch sizes are int64)
MAX_BYTES = (1 << 63) - 1

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text, flag: str = "size") -> int:
    """Parse '80GiB', '80 GB', '1.5e9' or an int into bytes; raise ConfigError naming `flag`."""
    if isinstance(text, bool):
        raise ConfigError(f"{flag} must be a byte size like 80GiB or 8e9, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{flag} {text!r} is not a byte size: use a number with an optional unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB or 8e9")
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


def gib(num_bytes: int) -> str:
    """Format bytes as GiB with two decimals, e.g. '139.80 GiB'."""
    return f"{num_bytes / GiB:.2f} GiB"
