"""Offset widths the backends declare, readable without importing torch or triton."""

from kvfit.errors import ConfigError
from kvfit.kv.plan import OFFSET_64_BIT

# Both shipped backends compute every element offset in int64 (see their modules).
BACKEND_OFFSETS = {"torch": OFFSET_64_BIT, "triton": OFFSET_64_BIT}


def backend_max_offset(name: str) -> int:
    """The largest element offset backend `name` can address."""
    if name not in BACKEND_OFFSETS:
        raise ConfigError(f"unknown attention backend {name!r}; use one of {', '.join(BACKEND_OFFSETS)}")
    return BACKEND_OFFSETS[name]
