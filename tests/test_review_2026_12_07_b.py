"""Review of 3ef266e..HEAD (the .bin loader, vLLM's serve flags round two, the per-channel FP8 GEMM): defects found,
each with the test that failed before its fix."""

from __future__ import annotations

import pytest
import torch

from kvfit.cli import parse_args
from kvfit.errors import ConfigError

MODEL = "qwen3-0.6b"        # a catalog name: parsing reads no files


@pytest.mark.parametrize("value, expected", [
    ("8G", 8 * 2**30), ("1K", 2**10), ("3M", 3 * 2**20), ("2T", 2 * 2**40),      # upper case: binary
    ("8g", 8 * 10**9), ("25.6k", 25_600), ("1073741824", 2**30),                 # lower case: decimal
    ("20GiB", 20 * 2**30), ("20GB", 20 * 10**9),                                 # kvfit's own units still
])
def test_kv_cache_memory_bytes_reads_suffixes_as_vllm_does(value, expected):
    """vLLM parses --kv-cache-memory-bytes with human_readable_int: an upper-case K/M/G/T is binary (8G is
    8 GiB), a lower-case one decimal. kvfit read 8G as 8 GB, a KV cache 7% smaller than the same vLLM command's."""
    assert parse_args(["plan", MODEL, "--kv-cache-memory-bytes", value]).kv_cache_memory == expected


def test_a_missing_fp8_gemm_config_file_named_by_the_environment_is_an_error(tmp_path, monkeypatch):
    """KVFIT_FP8_GEMM_CONFIGS naming a file that is not there (a typo, or a sweep that wrote nothing) was
    silently read as no tuned configs: _scaled_mm everywhere, a 'tuned' benchmark measuring the untuned path."""
    from kvfit.kernels import fp8_channel_configs as cc
    monkeypatch.setattr(cc, "CONFIG_PATH", str(tmp_path / "missing.json"))
    monkeypatch.setattr(cc, "_device_name", lambda index: "GPU X")
    with pytest.raises(ConfigError, match="KVFIT_FP8_GEMM_CONFIGS") as info:
        cc.channel_config(torch.device("cuda", 0), 16, 4096, 4096)
    assert "missing.json" in str(info.value) and "\n" not in str(info.value)
    monkeypatch.setattr(cc, "CONFIG_PATH", "off")                      # off: none, as before
    assert cc.channel_config(torch.device("cuda", 0), 16, 4096, 4096) is None


@pytest.mark.parametrize("overrides, needle", [
    ({"top_p": 2}, "top_p must be in (0, 1], got 2"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
])
def test_override_generation_config_out_of_range_fails_before_loading(overrides, needle):
    """FrontendOptions is built before the model loads ("so `kvfit serve` fails before loading"); a value that
    SamplingParams refuses (top_p past 1, min_p past 1) passed it and failed only in create_app, after a load
    that takes minutes for a large model."""
    from kvfit.server.frontend import FrontendOptions
    with pytest.raises(ConfigError) as info:
        FrontendOptions(override_generation_config=overrides)
    message = str(info.value)
    assert message.startswith("--override-generation-config") and needle in message and "\n" not in message
