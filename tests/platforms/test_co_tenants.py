"""Co-tenants through a fake NVML on the CPU (issue 32 (2)): other processes on the GPU are named with their
memory, the plan says how many blocks each costs (the capacity line and `kvfit profile`), and a missing or
failing NVML changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfit.kv.plan import MemoryReading, PlanLimits, plan_kv_cache
from kvfit.kv.spec import KVSpec
from kvfit.platforms.nvml import co_tenant_note, co_tenants

GiB = 2**30


class FakeNvml:
    """The calls platforms/nvml.py makes, answering from a table {uuid: [(pid, bytes or None)]}."""

    def __init__(self, processes, names=None, fail_init=False):
        self.processes, self.names, self.fail_init = processes, names or {}, fail_init
        self.calls = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetHandleByIndex(self, index):
        return list(self.processes)[index]

    def nvmlDeviceGetComputeProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes[handle]]

    def nvmlDeviceGetGraphicsProcesses(self, handle):
        return []

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return self.names[pid].encode()


def test_other_processes_are_named_largest_first_without_this_one():
    nvml = FakeNvml({"GPU-a": [(100, 1 * GiB), (4242, 12 * GiB), (7, None)], "GPU-b": [(999_999_999, GiB)]},
                    names={4242: "/usr/bin/python", 7: "hidden"})
    found = co_tenants("GPU-a", 0, own_pid=100, nvml=nvml)
    # this process (100) left out; a process whose memory NVML does not report (7) left out; no name: "?"
    assert found == ((4242, "python", 12 * GiB),)
    assert nvml.calls == ["init", "shutdown"]
    assert co_tenants(None, 1, own_pid=100, nvml=nvml) == ((999_999_999, "?", GiB),)


def test_no_nvml_means_no_co_tenants():
    assert co_tenants("GPU-a", 0, nvml=FakeNvml({}, fail_init=True)) == ()
    assert co_tenants("GPU-missing", 0, nvml=FakeNvml({})) == ()          # a lookup that raises


def spec() -> KVSpec:
    return KVSpec(num_layers=2, block_size=16, kv_heads_per_rank=2, head_dim=64, dtype="bfloat16")


def test_the_plan_says_how_many_blocks_each_co_tenant_costs():
    s = spec()
    tenants = ((4242, "python", 12 * GiB), (99, "tiny", 1000))
    reading = MemoryReading(total_bytes=80 * GiB, budget_bytes=72 * GiB, weights_bytes=2 * GiB,
                            in_use_at_start_bytes=13 * GiB, co_tenants=tenants)
    plan = plan_kv_cache(reading, s, PlanLimits(max_model_len=4096))
    alone = plan_kv_cache(MemoryReading(total_bytes=80 * GiB, budget_bytes=72 * GiB, weights_bytes=2 * GiB,
                                        in_use_at_start_bytes=1 * GiB), s, PlanLimits(max_model_len=4096))
    fewer = alone.num_blocks - plan.num_blocks
    assert fewer > 0 and plan.co_tenants == [f"pid 4242 python holds 12.00 GiB of the device: {fewer:,} blocks fewer"]
    assert plan.co_tenants[0] in plan.log_line()          # the capacity line names it
    # 1,000 bytes cost no whole block: not named; a cap below the memory limit: they cost nothing
    capped = plan_kv_cache(reading, s, PlanLimits(max_model_len=1024, max_num_blocks=100))
    assert capped.co_tenants == [] and "pid" not in capped.log_line()


def test_an_explicit_kv_size_is_not_costed_and_the_budget_error_says_who():
    reading = MemoryReading(total_bytes=80 * GiB, budget_bytes=72 * GiB, in_use_at_start_bytes=70 * GiB,
                            weights_bytes=4 * GiB, co_tenants=((4242, "python", 69 * GiB),))
    from kvfit.errors import CapacityError
    with pytest.raises(CapacityError, match="pid 4242 python holds 69.00 GiB"):
        plan_kv_cache(reading, spec(), PlanLimits(max_model_len=4096))
    explicit = MemoryReading(total_bytes=80 * GiB, budget_bytes=72 * GiB, kv_cache_memory_bytes=GiB,
                             co_tenants=((4242, "python", 12 * GiB),))
    assert plan_kv_cache(explicit, spec(), PlanLimits(max_model_len=4096)).co_tenants == []
    assert co_tenant_note(((4242, "python", 12 * GiB),), 2**20) == "pid 4242 python holds 12.00 GiB: 12,288 blocks fewer"


def test_cuda_measure_names_co_tenants_and_refuses_saying_who(monkeypatch):
    from test_platforms import FakeCuda, fake_steps      # tests/platforms/test_platforms.py's fake torch.cuda
    from kvfit.config import CacheConfig
    from kvfit.errors import CapacityError
    from kvfit.platforms import cuda as cuda_platform
    dev = FakeCuda(total=80 * GiB, others=13 * GiB)
    monkeypatch.setattr(cuda_platform.torch, "cuda", dev.module())
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device, platform.device_index = "cuda:0", 0
    platform.nvml = FakeNvml({"GPU-0": [(4242, 12 * GiB)]}, names={4242: "python"})
    reading = platform.measure(fake_steps(dev, GiB, GiB, 0, 0), CacheConfig())
    assert reading.co_tenants == ((4242, "python", 12 * GiB),) and reading.in_use_at_start_bytes == 13 * GiB
    dev.others = 79 * GiB
    with pytest.raises(CapacityError, match=r"held by other processes \(pid 4242 python holds 12.00 GiB\)"):
        platform.measure(fake_steps(dev, GiB, GiB, 0, 0), CacheConfig())


def test_memory_nvml_names_nobody_for_is_still_costed(monkeypatch):
    """A PID namespace (another container) hides the process holding 12 GiB: NVML lists nothing, so the reading
    names what no listed process accounts for (in use outside this process's torch memory, less its own CUDA
    context), and the plan costs it in blocks; a few hundred MiB beyond the context is no co-tenant."""
    from test_platforms import FakeCuda, fake_steps
    from kvfit.config import CacheConfig
    from kvfit.kv.plan import UNLISTED_PID
    from kvfit.platforms import cuda as cuda_platform
    from kvfit.platforms.estimate import CUDA_CONTEXT_BYTES
    from kvfit.platforms.nvml import UNLISTED_NAME
    dev = FakeCuda(total=80 * GiB, others=12 * GiB + CUDA_CONTEXT_BYTES)
    monkeypatch.setattr(cuda_platform.torch, "cuda", dev.module())
    platform = cuda_platform.CudaPlatform.__new__(cuda_platform.CudaPlatform)
    platform.device, platform.device_index = "cuda:0", 0
    platform.nvml = FakeNvml({"GPU-0": []})
    reading = platform.measure(fake_steps(dev, GiB, GiB, 0, 0), CacheConfig())
    assert reading.co_tenants == ((UNLISTED_PID, UNLISTED_NAME, 12 * GiB),)
    plan = plan_kv_cache(reading, spec(), PlanLimits(max_model_len=1024))
    assert plan.co_tenants and plan.co_tenants[0].startswith(f"{UNLISTED_NAME} holds 12.00 GiB of the device: ")
    assert "pid 0" not in plan.log_line() and UNLISTED_NAME in reading.explain()
    dev.others = CUDA_CONTEXT_BYTES + 300 * 2**20
    assert platform.measure(fake_steps(dev, GiB, GiB, 0, 0), CacheConfig()).co_tenants == ()
