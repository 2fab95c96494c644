"""The platform registry: --device names, auto's choice, and the device facts each platform owns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfit.attention.registry import backend_names
from kvfit.config import DeviceConfig
from kvfit.errors import ConfigError
from kvfit.platforms import get_platform, platform_names
from kvfit.platforms.base import Platform
from kvfit.platforms.cpu import CpuPlatform
from kvfit.platforms.cuda import CUDA_SCHEDULER_STEPS, CudaPlatform
from kvfit.platforms.registry import PLATFORMS, platform_class, platform_of, platforms_supporting


@pytest.fixture
def gpu(monkeypatch):
    """Pretend torch sees a GPU (or not): the registry asks only is_available()."""
    def set_available(available: bool):
        monkeypatch.setattr(CudaPlatform, "is_available", classmethod(lambda cls: available))
    return set_available


def test_every_name_resolves_to_its_platform():
    assert platform_names() == ("cuda", "cpu")
    for name in PLATFORMS:
        cls = platform_class(name)
        assert issubclass(cls, Platform) and cls.name == name
        assert cls.default_backend in cls.supported_backends
        assert set(cls.supported_backends) <= set(backend_names())
    assert CpuPlatform.is_available()          # the last one, auto's fallback


@pytest.mark.parametrize("name", ["auto", *platform_names()])
def test_config_accepts_the_registered_devices(name):
    assert DeviceConfig(device=name).device == name


@pytest.mark.parametrize("name", ["tpu", "CUDA", "", None, ["cpu"]])
def test_config_refuses_other_devices_with_the_registry_message(name):
    # config.py asks platforms/registry.py (ranked below config in tests/test_layering.py): one list, one message
    with pytest.raises(ConfigError) as err:
        DeviceConfig(device=name)
    assert str(err.value) == f"--device {name!r} is not supported; use auto, cpu or cuda"


def test_auto_takes_a_gpu_when_there_is_one(gpu):
    gpu(False)
    assert type(get_platform()) is CpuPlatform and type(get_platform("auto")) is CpuPlatform
    gpu(True)
    platform = get_platform("auto", device_index=1)
    assert type(platform) is CudaPlatform and platform.device_index == 1 and str(platform.torch_device()) == "cuda:1"


def test_named_devices(gpu):
    gpu(False)
    assert type(get_platform("cpu")) is CpuPlatform
    with pytest.raises(ConfigError) as err:
        get_platform("cuda")
    assert str(err.value) == "--device cuda was asked for but torch sees no CUDA device; use --device cpu"
    with pytest.raises(ConfigError) as err:
        get_platform("tpu")
    assert str(err.value) == "--device 'tpu' is not supported; use auto, cpu or cuda"


def test_cpu_facts():
    cpu = CpuPlatform()
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cpu.device_count() == expected >= 1 and cpu.device_count_unit == "CPU cores"
    assert cpu.distributed_backend == "gloo" and not cpu.supports_graphs
    assert [cpu.default_scheduler_steps(tp) for tp in (1, 2)] == [1, 1]
    assert cpu.supported_backends == ("torch",) and cpu.default_backend == "torch"
    assert str(cpu.torch_device()) == "cpu" and cpu.free_device_bytes() is None


def test_cuda_facts():
    cuda = CudaPlatform(0)          # builds no CUDA state: a torch.device is only a name
    assert cuda.distributed_backend == "nccl" and cuda.supports_graphs and cuda.device_count_unit == "GPUs"
    assert [cuda.default_scheduler_steps(tp) for tp in (1, 2, 4)] == [CUDA_SCHEDULER_STEPS, 1, 1]
    assert CUDA_SCHEDULER_STEPS == 8
    assert cuda.supported_backends == ("triton", "torch") and cuda.default_backend == "triton"


def test_check_backend():
    CudaPlatform(0).check_backend("triton")
    CudaPlatform(0).check_backend("torch")
    CpuPlatform().check_backend("torch")
    assert platforms_supporting("triton") == ("cuda",) and platforms_supporting("torch") == ("cuda", "cpu")
    with pytest.raises(ConfigError) as err:
        CpuPlatform().check_backend("triton")
    assert str(err.value) == "--attention-backend triton needs --device cuda; use --attention-backend torch on CPU"
    with pytest.raises(ConfigError, match="--attention-backend flash does not run on --device cpu"):
        CpuPlatform().check_backend("flash")


@pytest.mark.parametrize("module,absent", [
    # base.py knows no platform (no import circle); finding one loads no torch until asked
    ("kvfit.platforms.base", ("torch", "kvfit.platforms.cpu", "kvfit.platforms.cuda")),
    # the package loads only the registry
    ("kvfit.platforms", ("torch", "kvfit.config", "kvfit.platforms.base")),
])
def test_imports_stay_light(module, absent):
    code = f"import sys, {module}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_torch_device_finds_its_platform():
    import torch
    cpu = platform_of(torch.device("cpu"))
    assert type(cpu) is CpuPlatform
    cuda = platform_of(torch.device("cuda", 1))      # constructing it asks nothing of a GPU
    assert type(cuda) is CudaPlatform and cuda.device_index == 1 and str(cuda.torch_device()) == "cuda:1"


def test_host_tensors_need_no_copy_and_no_event():
    # the runner's device questions: on the host a tensor is its own host copy and work is done on return
    import torch
    t = torch.arange(3)
    assert CpuPlatform().host_copy(t) is t and CpuPlatform().ready_event() is None
    assert CudaPlatform(0).host_copy(t) is t            # a host tensor is never copied, on any platform
    CpuPlatform().release_cached_memory()
