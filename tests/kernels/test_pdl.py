"""Whether kernels launch with programmatic dependent launch: never off CUDA; the engine's setting
(DeviceConfig.pdl, KVFIT_PDL its default) read once into the config, validated, and in force while the runner
launches work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvfit.kernels import pdl
from kvfit.config import PDL_ENV, DeviceConfig
from kvfit.errors import ConfigError

# a tensor on a PDL-capable GPU, as pdl.enabled sees one (with _device_supports answering yes)
GPU_TENSOR = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)


def test_cpu_tensors_never_launch_with_pdl():
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}
    with pdl.setting(True):
        assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}


def test_the_setting_holds_inside_and_resets(sm90):
    assert pdl.enabled(GPU_TENSOR)                     # outside any engine: on
    with pdl.setting(False):
        assert not pdl.enabled(GPU_TENSOR)
        with pdl.setting(True):
            assert pdl.launch_args(GPU_TENSOR) == {"PDL": True, "launch_pdl": True}
        assert pdl.launch_args(GPU_TENSOR) == {"PDL": False}
    with pytest.raises(RuntimeError), pdl.setting(False):
        raise RuntimeError("a failed step")
    assert pdl.enabled(GPU_TENSOR)                     # reset after an error too


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_the_environment_is_the_default(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(PDL_ENV, value)
    assert DeviceConfig().pdl is on
    assert DeviceConfig(pdl=not on).pdl is (not on)     # a value given wins over the environment


def test_bad_values_are_config_errors(monkeypatch):
    monkeypatch.setenv(PDL_ENV, "yes")
    with pytest.raises(ConfigError, match="KVFIT_PDL='yes' is not allowed; set it to 1"):
        DeviceConfig()
    monkeypatch.delenv(PDL_ENV)
    with pytest.raises(ConfigError, match="pdl must be True, False or None"):
        DeviceConfig(pdl="off")


def test_engine_start_rejects_a_bad_value_before_loading(monkeypatch, tiny_llama):
    from kvfit import LLM
    monkeypatch.setenv(PDL_ENV, "2")
    with pytest.raises(ConfigError, match="KVFIT_PDL='2' is not allowed"):
        LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=16)


@pytest.mark.parametrize("given", [False, True])
def test_the_runner_launches_under_the_configured_setting(monkeypatch, tiny_llama, given):
    from kvfit import LLM, SamplingParams
    seen = []
    real = pdl.setting

    def spy(enabled):
        seen.append(enabled)
        return real(enabled)
    monkeypatch.setattr(pdl, "setting", spy)
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=16, pdl=given)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(seen) >= 3 and set(seen) == {given}      # load, profile and every step
