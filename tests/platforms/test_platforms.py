"""Platforms only measure: the same reading gives the same plan whichever platform measured it."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from kvfit.config import CacheConfig
from kvfit.errors import CapacityError
from kvfit.kv.plan import PlanLimits, plan_kv_cache
from kvfit.kv.spec import KVSpec
from kvfit.platforms.base import StartupSteps
from kvfit.platforms.cpu import CpuPlatform
from kvfit.platforms import cuda as cuda_platform

GiB = 1 << 30


class FakeCuda:
    """A fake torch.cuda: a device of `total` bytes where allocations move the counters."""

    def __init__(self, total, others):
        self.total, self.others = total, others
        self.allocated = self.reserved = self.peak = self.peak_reserved = 0
        self.non_torch = 0

    def alloc(self, n):
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n):
        self.allocated -= n

    def mem_get_info(self, device=None):
        used = self.others + self.reserved + self.non_torch
        return self.total - used, self.total

    def module(self):
        m = types.SimpleNamespace()
        m.mem_get_info = self.mem_get_info
        m.memory_reserved = lambda d=None: self.reserved
        m.memory_allocated = lambda d=None: self.allocated
        m.max_memory_allocated = lambda d=None: self.peak
        m.max_memory_reserved = lambda d=None: self.peak_reserved
        m.memory_stats = lambda d=None: {"reserved_bytes.all.current": self.reserved,
                                         "allocated_bytes.all.current": self.allocated}
        m.reset_peak_memory_stats = lambda d=None: (setattr(self, "peak", self.allocated),
                                                    setattr(self, "peak_reserved", self.reserved))
        m.empty_cache = lambda: setattr(self, "reserved", self.allocated)
        m.set_device = m.synchronize = m.init = lambda *a: None
        m.memory = types.SimpleNamespace()
        return m


def fake_steps(dev, weights, activations, scratch, non_torch):
    def load():
        dev.alloc(weights)
        return weights

    def profile():
        dev.alloc(scratch + activations)
        dev.free(scratch + activations)
        dev.non_torch = non_torch
        return scratch
    return StartupSteps(load_weights=load, profile=profile)


@pytest.fixture
def fake_cuda(monkeypatch):
    dev = FakeCuda(total=100 * GiB, others=3 * GiB)
    monkeypatch.setattr(cuda_platform.torch, "cuda", dev.module())
    return dev


def test_cuda_measure_reads_each_part(fake_cuda):
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device = "cuda:0"
    steps = fake_steps(fake_cuda, weights=10 * GiB, activations=2 * GiB, scratch=GiB, non_torch=GiB // 2)
    reading = platform.measure(steps, CacheConfig(gpu_memory_utilization=0.9))
    assert reading.total_bytes == 100 * GiB
    assert reading.budget_bytes == int(100 * GiB * 0.9)
    assert reading.weights_bytes == 10 * GiB
    assert reading.activation_peak_bytes == 2 * GiB        # the scratch KV cache is left out
    assert reading.non_torch_bytes == GiB // 2
    assert reading.in_use_at_start_bytes == 3 * GiB
    assert reading.available_kv_bytes == int(100 * GiB * 0.9) - (10 + 2 + 3) * GiB - GiB // 2


def test_cuda_counts_the_process_own_torch_memory_from_before_as_in_use(fake_cuda):
    # 2 GiB of tensors the process held before the engine (the caller's, an earlier engine's): the engine
    # cannot use them, so they count against the budget like another process's memory
    fake_cuda.alloc(2 * GiB)
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device = "cuda:0"
    steps = fake_steps(fake_cuda, weights=10 * GiB, activations=2 * GiB, scratch=GiB, non_torch=GiB // 2)
    reading = platform.measure(steps, CacheConfig(gpu_memory_utilization=0.9))
    assert reading.in_use_at_start_bytes == 5 * GiB
    assert reading.weights_bytes == 10 * GiB and reading.activation_peak_bytes == 2 * GiB
    assert reading.non_torch_bytes == GiB // 2
    assert reading.available_kv_bytes == int(100 * GiB * 0.9) - (10 + 2 + 5) * GiB - GiB // 2
    # the allocator's cap while serving holds those 2 GiB too (they are inside memory_reserved)
    assert reading.own_torch_at_start_bytes == 2 * GiB
    assert reading.process_budget_bytes == int(100 * GiB * 0.9) - GiB // 2 - 3 * GiB
    platform.num_cache_releases = 0
    fake_cuda.alloc(reading.available_kv_bytes + GiB)        # the KV cache and half the activation peak
    platform.keep_within(reading)
    assert platform.num_cache_releases == 0                  # inside the budget: nothing to release
    fake_cuda.alloc(2 * GiB)
    fake_cuda.free(2 * GiB)                                  # cached past the peak: over the budget
    platform._cache_block = lambda n: (fake_cuda.alloc(n), fake_cuda.free(n))
    platform.keep_within(reading)
    assert platform.num_cache_releases == 1
    # the release handed back the activation reserve too: it is held again at once, the allocator's own
    # segments' slack left free, so the next step's cache does not pass the budget again
    # (up to the activation peak; here half of it is still live, so what remains of the budget)
    slack = cuda_platform.HOLD_SLACK_BYTES
    assert fake_cuda.reserved == min(fake_cuda.allocated + 2 * GiB, reading.process_budget_bytes - slack)
    assert fake_cuda.reserved > fake_cuda.allocated + GiB // 2
    fake_cuda.alloc(GiB // 2)
    fake_cuda.free(GiB // 2)                                 # a step inside the held reserve
    platform.keep_within(reading)
    assert platform.num_cache_releases == 1


def test_cuda_refuses_when_others_use_the_whole_budget(fake_cuda):
    fake_cuda.others = 95 * GiB
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device = "cuda:0"
    steps = fake_steps(fake_cuda, GiB, GiB, 0, 0)
    with pytest.raises(CapacityError, match="gpu-memory-utilization"):
        platform.measure(steps, CacheConfig(gpu_memory_utilization=0.9))


def test_cpu_measure_uses_kv_cache_memory():
    steps = StartupSteps(load_weights=lambda: 123, profile=lambda: 0)
    reading = CpuPlatform().measure(steps, CacheConfig(kv_cache_memory="1GiB"))
    assert reading.kv_cache_memory_bytes == GiB
    assert reading.available_kv_bytes == GiB
    assert reading.weights_bytes == 123


def test_cpu_default_is_a_share_of_available_memory():
    from kvfit.platforms.cpu import CPU_KV_CACHE_SHARE, read_meminfo
    steps = StartupSteps(load_weights=lambda: 0, profile=lambda: 0)
    reading = CpuPlatform().measure(steps, CacheConfig())
    _, available = read_meminfo()
    assert reading.kv_cache_memory_bytes == pytest.approx(CPU_KV_CACHE_SHARE * available, rel=0.05)


def test_same_reading_same_plan_on_every_platform(fake_cuda):
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device = "cuda:0"
    cuda_reading = platform.measure(fake_steps(fake_cuda, 10 * GiB, 2 * GiB, 0, 0),
                                    CacheConfig(kv_cache_memory="20GiB"))
    cpu_reading = CpuPlatform().measure(StartupSteps(load_weights=lambda: 10 * GiB, profile=lambda: 0),
                                        CacheConfig(kv_cache_memory="20GiB"))
    spec = KVSpec(num_layers=4, block_size=16, kv_heads_per_rank=2, head_dim=64, dtype="bfloat16")
    limits = PlanLimits(max_model_len=4096)
    a, b = plan_kv_cache(cuda_reading, spec, limits), plan_kv_cache(cpu_reading, spec, limits)
    keep = ("num_blocks", "bound_by", "limits", "kv_cache_bytes", "token_capacity", "max_concurrency")
    assert {k: getattr(a, k) for k in keep} == {k: getattr(b, k) for k in keep}
    assert a.num_blocks == 20 * GiB // spec.bytes_per_block
    # and the readings differ only in what each platform measured
    assert dataclasses.replace(cpu_reading, source="x").kv_cache_memory_bytes == cuda_reading.kv_cache_memory_bytes


def _serving_platform(fake_cuda):
    """A CudaPlatform measured on the fake device, its KV cache allocated, and its reading."""
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device = "cuda:0"
    platform.num_cache_releases = 0
    steps = fake_steps(fake_cuda, weights=10 * GiB, activations=2 * GiB, scratch=GiB, non_torch=GiB // 2)
    reading = platform.measure(steps, CacheConfig(gpu_memory_utilization=0.9))
    fake_cuda.alloc(reading.available_kv_bytes)
    platform._cache_block = lambda n: (fake_cuda.alloc(n), fake_cuda.free(n))
    return platform, reading


def test_keep_within_stops_rehold_that_the_next_step_always_releases_and_resumes_after_a_quiet_step(fake_cuda,
                                                                                                     caplog):
    platform, reading = _serving_platform(fake_cuda)
    cap = reading.process_budget_bytes
    holds = []
    hold = platform.hold_activation_reserve
    platform.hold_activation_reserve = lambda r: holds.append(hold(r))

    def step_past_the_cap():           # a step whose cache cannot reuse the held block: new segments past the cap
        size = cap - fake_cuda.allocated + GiB
        fake_cuda.alloc(size)
        fake_cuda.free(size)
        platform.keep_within(reading)
    for _ in range(cuda_platform.MAX_FUTILE_REHOLDS + 3):
        step_past_the_cap()
    assert platform.num_cache_releases == cuda_platform.MAX_FUTILE_REHOLDS + 3
    assert len(holds) == cuda_platform.MAX_FUTILE_REHOLDS          # the first release, then two futile re-holds
    assert sum("no longer held between steps" in r.message for r in caplog.records) == 1
    platform.keep_within(reading)                                   # inside the budget: a quiet step
    step_past_the_cap()
    assert len(holds) == cuda_platform.MAX_FUTILE_REHOLDS + 1       # the reserve is taken again
    for _ in range(cuda_platform.MAX_FUTILE_REHOLDS + 1):
        step_past_the_cap()
    assert sum("no longer held between steps" in r.message for r in caplog.records) == 1   # said once


def test_keep_within_survives_a_reserve_someone_else_took(fake_cuda):
    platform, reading = _serving_platform(fake_cuda)

    def taken(n):
        raise torch.OutOfMemoryError("CUDA out of memory")
    platform._cache_block = taken
    fake_cuda.alloc(3 * GiB)
    fake_cuda.free(3 * GiB)                              # cached past the budget
    platform.keep_within(reading)
    assert platform.num_cache_releases == 1 and fake_cuda.reserved == fake_cuda.allocated
    assert platform.hold_activation_reserve(reading) == 0
