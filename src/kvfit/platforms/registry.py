"""Platform names (--device) -> classes; `auto` takes the first available one, in PLATFORMS' order.

Classes are named by "module:Class" and imported when asked for: the CUDA platform imports torch,
and `kvfit plan` (which reads platforms/estimate.py) must not. A new platform is one module plus
one line here, placed before the platforms `auto` should prefer it to. This module imports no
platform module, base.py included (base.py asks it which platforms run a backend), and nothing but
kvfit.errors: config.py checks --device against it (tests/test_layering.py ranks it below config).
"""

from __future__ import annotations

import importlib

from kvfit.errors import ConfigError

AUTO = "auto"
# name -> "module:Class"; the order is auto's preference, and the last one is always available
PLATFORMS = {
    "cuda": "kvfit.platforms.cuda:CudaPlatform",
    "cpu": "kvfit.platforms.cpu:CpuPlatform",
}


def platform_names() -> tuple[str, ...]:
    """The --device values a platform answers to (besides auto), in auto's order."""
    return tuple(PLATFORMS)


def _device_choices() -> str:
    *first, last = sorted(PLATFORMS)
    return ", ".join([AUTO, *first]) + f" or {last}"


def _unsupported(name) -> ConfigError:
    return ConfigError(f"--device {name!r} is not supported; use {_device_choices()}")


def check_device(name) -> None:
    """Raise a ConfigError naming the choices unless `name` is a --device value (auto or a platform's name)."""
    if not (isinstance(name, str) and (name == AUTO or name in PLATFORMS)):
        raise _unsupported(name)


def platform_class(name: str) -> type:
    """The Platform subclass of `name`; an unknown name is a ConfigError naming the choices."""
    if name not in PLATFORMS:
        raise _unsupported(name)
    module, _, cls = PLATFORMS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_platform(device: str = AUTO, device_index: int = 0):
    """The Platform for --device: the one named, or with auto the first available (a GPU before the CPU)."""
    if device == AUTO:      # the last platform is always available, so next() finds one
        device = next(name for name in PLATFORMS if platform_class(name).is_available())
    cls = platform_class(device)
    if not cls.is_available():
        raise ConfigError(f"--device {device} was asked for but torch sees no {cls.label} device; "
                          f"use --device {list(PLATFORMS)[-1]}")
    return cls(device_index)


def platform_of(device):
    """The Platform of a torch device, on its index (a platform's name is its torch device type)."""
    return platform_class(device.type)(device.index or 0)


def platforms_supporting(backend: str) -> tuple[str, ...]:
    """Names of the platforms attention backend `backend` runs on (for error messages)."""
    return tuple(name for name in PLATFORMS if backend in platform_class(name).supported_backends)
