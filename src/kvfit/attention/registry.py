"""Backend names -> classes; a platform names its default backend."""

from __future__ import annotations

from kvfit.attention.offsets import BACKEND_OFFSETS
from kvfit.errors import ConfigError


def backend_names() -> tuple[str, ...]:
    """The backends there are: the ones that declare an offset width."""
    return tuple(BACKEND_OFFSETS)


def get_backend(name: str):
    """An attention backend instance by name ('torch' reference or 'triton')."""
    if name == "torch":
        from kvfit.attention.torch_ref import TorchReferenceBackend
        return TorchReferenceBackend()
    if name == "triton":
        from kvfit.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ConfigError(f"unknown attention backend {name!r}; use one of {', '.join(backend_names())}")
