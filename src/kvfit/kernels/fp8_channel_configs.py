"""Tuned launch configs of the per-channel FP8 GEMM in Triton (fp8_block_gemm.channel_fp8_gemm), per device.

cuBLASLt's rowwise-scaled torch._scaled_mm is the default per-channel GEMM. At small batches it leaves most of
the device idle (one 128 x 128 tile for every shape: llama-3.1-8b's o_proj and down make 32 tiles a row block for
132 SMs), so a sweep on the device (benchmarks/tune_fp8_channel_gemm.py) writes, per weight shape and batch size,
the Triton config that beat _scaled_mm there, or null where none did. On an H100 (2026-12-07) Triton won from 4
to 64 rows (the 8B's linears 1.07-1.22x faster) and lost from 96 (benchmarks/results/2026-12-07-h100-fp8-channel-
tune.log). The file is configs/fp8_channel_gemm.json:

    {"<torch.cuda.get_device_name()>": {"<N>x<K>": [[M, config or null], ...]}, ...}

an entry [M, config] serving every batch of more rows than the entry before it and at most M (rows past the last
entry: _scaled_mm). A device, a shape or a batch the file does not name runs _scaled_mm, as before any sweep.
KVFIT_FP8_GEMM_CONFIGS, read once when the kernels are imported, names another file (the sweep's output, before
it is committed; a name of no file is a ConfigError) or `off` (none).
"""

from __future__ import annotations

import functools
import json
import os

import torch

from kvfit.errors import ConfigError

CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "fp8_channel_gemm.json")
ENV = "KVFIT_FP8_GEMM_CONFIGS"
CONFIG_PATH = os.environ.get(ENV, "") or CONFIG_FILE      # read once, when the kernels are imported


def config_file() -> str | None:
    """The file the configs come from (KVFIT_FP8_GEMM_CONFIGS as the process started, else the packaged one), or
    None for `off`."""
    return None if CONFIG_PATH == "off" else CONFIG_PATH


@functools.lru_cache(maxsize=None)
def _table(path: str | None, device_name: str) -> dict[str, list[tuple[int, tuple[int, ...] | None]]]:
    if path is None or (path == CONFIG_FILE and not os.path.exists(path)):
        return {}
    if not os.path.isfile(path):      # a file the environment names must be there: never _scaled_mm in silence
        raise ConfigError(f"{ENV}={path[:200]} names no file; give the tuned configs' JSON file, or off for none")
    with open(path) as f:
        data = json.load(f)
    shapes = data.get(device_name, {})
    return {shape: sorted((int(m), tuple(c) if c else None) for m, c in entries) for shape, entries in shapes.items()}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=4096)
def _lookup(path: str | None, device_name: str, m: int, n: int, k: int) -> tuple[int, ...] | None:
    for m_max, config in _table(path, device_name).get(f"{n}x{k}") or ():
        if m <= m_max:
            return config
    return None


def channel_config(device: torch.device, m: int, n: int, k: int) -> tuple[int, ...] | None:
    """The tuned (BLOCK_M, BLOCK_N, warps, stages, SPLIT_K, BLOCK_K) for m rows of an [n, k] weight on this CUDA
    device, or None: _scaled_mm runs. Cached: fp8_linear asks on every eager call."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _lookup(config_file(), _device_name(index), m, n, k)
