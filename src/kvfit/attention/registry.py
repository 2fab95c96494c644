"""Attention backends by name: one line of data each. No torch here (`kvfit plan` reads the offsets).

A backend's line names its class ("module:Class", imported when an engine asks for it) and the
largest element offset its kernels compute, which bounds the KV cache (kv/plan.py). Which backends
a device runs is the platform's fact (Platform.supported_backends), not this table's.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from kvfit.errors import ConfigError
from kvfit.kv.plan import OFFSET_64_BIT


class BackendEntry(NamedTuple):
    class_path: str             # "module:Class"
    max_element_offset: int     # the largest element offset its kernels can address


# Both shipped backends compute every element offset in int64 (see their modules).
BACKENDS = {
    "torch": BackendEntry("kvfit.attention.torch_ref:TorchReferenceBackend", OFFSET_64_BIT),
    "triton": BackendEntry("kvfit.attention.triton_backend:TritonBackend", OFFSET_64_BIT),
}


def backend_names() -> tuple[str, ...]:
    """The backends there are."""
    return tuple(BACKENDS)


def _entry(name: str) -> BackendEntry:
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; use one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_max_offset(name: str) -> int:
    """The largest element offset backend `name` can address."""
    return _entry(name).max_element_offset


def backend_class(name: str) -> type:
    """The class of backend `name` (imports its module, and with it torch and maybe triton)."""
    module, _, cls = _entry(name).class_path.partition(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str):
    """An attention backend instance by name ('torch' reference or 'triton')."""
    return backend_class(name)()
