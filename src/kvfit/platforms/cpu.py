"""CPU platform: the KV budget is --kv-cache-memory, else a documented share of available RAM.

--gpu-memory-utilization is a share of GPU memory: on the CPU it is refused (anything but its default),
pointing to --kv-cache-memory. Steps carry fewer tokens by default than on a GPU (CPU_MAX_NUM_BATCHED_TOKENS),
as vLLM's CPU backend lowers its token budget: the start-up profile runs the model over that many tokens
twice, and a step of a 2-core CPU in bf16 takes about 0.1 s per token of a 0.6B model (docs/benchmarks.md).
A start-up estimated to take long is announced first (startup_estimate: platforms/cpu_startup.py).
"""

from __future__ import annotations

import os

from kvfit.config import DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig, EngineConfig
from kvfit.errors import ConfigError
from kvfit.kv.plan import MemoryReading
from kvfit.platforms.base import Platform, StartupSteps

# --max-num-batched-tokens on the CPU when not given: prefills go in chunks of this many tokens, and
# the start-up profile (the widest and the longest step) runs two forwards of this many tokens
CPU_MAX_NUM_BATCHED_TOKENS = 64
# Share of the memory available at start-up that the KV cache takes when --kv-cache-memory is not given
CPU_KV_CACHE_SHARE = 0.25


def read_meminfo() -> tuple[int, int]:
    """(total, available) bytes of host memory, from /proc/meminfo where there is one."""
    try:
        values = {}
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
        return values["MemTotal"], values.get("MemAvailable", values["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


class CpuPlatform(Platform):
    """The host: always available; ranks each take a usable core; torch attention only."""

    name = "cpu"
    label = "CPU"
    device_count_unit = "CPU cores"
    distributed_backend = "gloo"
    supports_graphs = False
    supported_backends = ("torch",)
    default_backend = "torch"
    default_max_num_batched_tokens = CPU_MAX_NUM_BATCHED_TOKENS

    @classmethod
    def is_available(cls) -> bool:
        return True

    def resolve_config(self, config: EngineConfig) -> EngineConfig:
        util = config.cache.gpu_memory_utilization
        if util != DEFAULT_GPU_MEMORY_UTILIZATION:
            raise ConfigError(
                f"--gpu-memory-utilization {util} is a share of GPU memory and means nothing on the CPU, where "
                f"the KV cache takes {CPU_KV_CACHE_SHARE:.0%} of the RAM available at start-up; size it with "
                "--kv-cache-memory instead, e.g. --kv-cache-memory 4GiB")
        return super().resolve_config(config)

    def startup_estimate(self, config: EngineConfig) -> tuple[float, str] | None:
        # loading and profiling at host speed takes minutes for a large model (platforms/cpu_startup.py)
        if config.model.load_format != "dummy":     # missing weights fail at once (the loader's error): no wait
            from kvfit.models.loader import checkpoint_files
            checkpoint_files(config.model.model, config.model.load_format)
        from kvfit.model_facts import load_model_facts
        from kvfit.platforms.cpu_startup import cpu_startup_estimate
        facts = load_model_facts(config.model.model, config.model.quantization)
        return cpu_startup_estimate(facts, self.resolve_config(config), read_meminfo()[1])

    def device_count(self) -> int:
        """Cores this process may run on (its affinity mask, where the OS has one)."""
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1

    def total_device_bytes(self) -> int | None:
        return read_meminfo()[0] or None

    def torch_device(self):
        import torch
        return torch.device("cpu")

    def measure(self, steps: StartupSteps, cache: CacheConfig) -> MemoryReading:
        total, available_at_start = read_meminfo()
        weights = steps.load_weights()
        steps.profile()
        _, available = read_meminfo()
        kv_bytes = cache.kv_cache_memory or int(CPU_KV_CACHE_SHARE * available)
        return MemoryReading(total_bytes=total, budget_bytes=available_at_start, weights_bytes=weights,
                             kv_cache_memory_bytes=kv_bytes, source="cpu")
