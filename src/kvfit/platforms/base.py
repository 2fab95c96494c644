"""The platform interface: measure() runs the start-up steps and reads memory around them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvfit.config import CacheConfig
from kvfit.errors import ConfigError
from kvfit.kv.plan import MemoryReading


@dataclass
class StartupSteps:
    """The engine's start-up work, handed to a platform so it can measure around each step."""

    load_weights: Callable[[], int]             # loads the model; returns its parameter bytes
    profile: Callable[[], int]                  # one forward + sample at max_num_batched_tokens;
                                                # returns the bytes of the scratch KV cache it used
    capture_graphs: Callable[[], None] | None = None   # trial capture, to measure graph memory
    release_graphs: Callable[[], None] | None = None


class Platform:
    """A device kind. Subclasses implement measure() and name their backend; nothing else."""

    name = "abstract"
    default_backend = "torch"

    def torch_device(self):
        raise NotImplementedError

    def measure(self, steps: StartupSteps, cache: CacheConfig) -> MemoryReading:
        raise NotImplementedError

    def keep_within(self, reading: MemoryReading) -> None:
        """After a step: hand cached memory back if this process holds more than reading's budget
        allows (an allocator cache can grow past the profiled peak). Default: nothing cached."""


def get_platform(device: str = "auto", device_index: int = 0) -> Platform:
    """The platform for --device: cuda when asked (or auto with a GPU), else cpu."""
    import torch
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        from kvfit.platforms.cuda import CudaPlatform
        return CudaPlatform(device_index)
    if device not in ("auto", "cpu"):
        raise ConfigError(f"--device {device!r} is not supported; use auto, cpu or cuda")
    from kvfit.platforms.cpu import CpuPlatform
    return CpuPlatform()
