"""Whether kernels launch with programmatic dependent launch: never off CUDA, KVFIT_PDL validated."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention import pdl
from kvfit.errors import ConfigError


@pytest.fixture(autouse=True)
def fresh_env_read():
    pdl._allowed.cache_clear()
    yield
    pdl._allowed.cache_clear()


def test_cpu_tensors_never_launch_with_pdl():
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}


@pytest.mark.parametrize("value,allowed", [("1", True), ("0", False), (" 0 ", False)])
def test_env_switch(monkeypatch, value, allowed):
    monkeypatch.setenv(pdl.ENV, value)
    assert pdl._allowed() is allowed


def test_bad_env_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ConfigError, match="KVFIT_PDL='yes' is not allowed; set it to 1"):
        pdl._allowed()


def test_engine_start_rejects_a_bad_value_before_loading(monkeypatch, tiny_llama):
    from kvfit import LLM
    monkeypatch.setenv(pdl.ENV, "2")
    with pytest.raises(ConfigError, match="KVFIT_PDL='2' is not allowed"):
        LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=16)
