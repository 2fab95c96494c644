"""The platform interface: measure() runs the start-up steps and reads memory around them.

A platform also owns the facts about its device that the rest of kvfit asks for (how many
devices, the collective backend, CUDA-graph support, scheduler steps, attention backends), so
nothing outside platforms/ checks which device it is on. Platforms are found by name in
registry.py; this module knows none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from kvfit.config import CacheConfig, EngineConfig
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
    """A device kind: measures memory at start-up and answers questions about its device."""

    name = "abstract"                  # the --device value
    label = "abstract"                 # the device kind in messages ("CPU", "CUDA")
    device_count_unit = "devices"      # what device_count() counts, for messages ("GPUs", "CPU cores")
    distributed_backend = "gloo"       # torch.distributed backend of the model's collectives
    supports_graphs = False            # decode steps may be captured as CUDA graphs
    supported_backends: tuple[str, ...] = ("torch",)   # attention backends that run here
    default_backend = "torch"
    default_max_num_batched_tokens = 8192   # --max-num-batched-tokens when not given (vLLM's GPU default)

    def __init__(self, device_index: int = 0):
        self.device_index = device_index

    @classmethod
    def is_available(cls) -> bool:
        """Whether this process can use the platform (`--device auto` takes the first that can)."""
        raise NotImplementedError

    def device_count(self) -> int:
        """Devices that tensor-parallel ranks can each take one of."""
        raise NotImplementedError

    def torch_device(self):
        raise NotImplementedError

    def set_current_device(self) -> None:
        """Make this platform's device the process's current one (collectives use it). Default: nothing."""

    def resolve_config(self, config: EngineConfig) -> EngineConfig:
        """config with this platform's defaults in the settings left unset; raises a ConfigError for a
        setting that means nothing here. The engine runs on what this returns."""
        return with_default_batched_tokens(config, self.default_max_num_batched_tokens)

    def startup_estimate(self, config: EngineConfig) -> tuple[float, str] | None:
        """(seconds, a warning saying so) where starting an engine of config here is estimated to take long
        enough to announce (the command then shows progress until it is up); None (the default): it starts in
        seconds, or fails at once."""
        return None

    def default_scheduler_steps(self, tensor_parallel_size: int) -> int:
        """Decode steps per scheduling round when --num-scheduler-steps is not given."""
        return 1

    def check_backend(self, name: str) -> None:
        """Raise a ConfigError when attention backend `name` cannot run on this platform."""
        if name in self.supported_backends:
            return
        from kvfit.platforms.registry import platforms_supporting
        devices = " or ".join(f"--device {d}" for d in platforms_supporting(name))
        needs = f"needs {devices}" if devices else f"does not run on --device {self.name}"
        raise ConfigError(f"--attention-backend {name} {needs}; use --attention-backend {self.default_backend} "
                          f"on {self.label}")

    def host_copy(self, t):
        """A host copy of t that lands without blocking the host (read it after ready_event()'s synchronize);
        t itself where it is on the host already (the default: the device is the host)."""
        return t

    def ready_event(self):
        """An event recorded after everything queued so far on this device's current stream: its synchronize()
        waits for that work only, not for work queued after it. None (the default): work is done on return."""
        return None

    def release_cached_memory(self) -> None:
        """Hand the memory the allocator caches back to the device (an engine shut down). Default: none cached."""

    def free_device_bytes(self) -> int | None:
        """Free device memory now, where the device reports it (None: it does not)."""
        return None

    def total_device_bytes(self) -> int | None:
        """The device's whole memory, where it reports it (None: it does not)."""
        return None

    def measure(self, steps: StartupSteps, cache: CacheConfig) -> MemoryReading:
        raise NotImplementedError

    def keep_within(self, reading: MemoryReading) -> None:
        """After a step: hand cached memory back if this process holds more than reading's budget
        allows (an allocator cache can grow past the profiled peak). Default: nothing cached."""

    def hold_activation_reserve(self, reading: MemoryReading) -> int:
        """After the KV cache and graphs are in: make the allocator hold the profiled activation peak, so memory
        the plan gave the steps cannot be taken by another process while serving. Bytes held; default 0."""
        return 0


def with_default_batched_tokens(config: EngineConfig, default: int) -> EngineConfig:
    """config with --max-num-batched-tokens `default` where it was not given."""
    sched = config.scheduler
    if sched.max_num_batched_tokens is not None:
        return config
    return dataclasses.replace(config, scheduler=dataclasses.replace(sched, max_num_batched_tokens=default))
