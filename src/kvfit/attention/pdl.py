"""Programmatic dependent launch (PDL) for kvfit's Triton kernels on Hopper and newer GPUs.

A decode step at batch 1 is some 300 small kernels, and each one's launch and ramp-up costs a few
microseconds in which the GPU reads no weights. With PDL a kernel may be scheduled while the kernel
before it on the stream is still finishing, so its programs are resident when that one ends.

The contract every kernel that takes a `PDL` constexpr keeps (and must keep):
- it calls `gdc_wait()` in every program before its first access to memory another kernel writes or
  reads (inputs, outputs, caches, block tables), and before any early return; only read-only data
  (weights) may be loaded before it;
- it calls `gdc_launch_dependents()` once its main loop is done (a hint: the next kernel may launch).
Both are no-ops when the kernel was launched without PDL.

`KVFIT_PDL=0` turns it off (for A/B measurements; read once per process); default on for CUDA devices
of compute capability 9.0 or newer.
"""

from __future__ import annotations

import functools
import os

import torch

from kvfit.errors import ConfigError
from kvfit.platforms.gate import on_gpu

ENV = "KVFIT_PDL"


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    # griddepcontrol is PTX: NVIDIA sm90+ only (ROCm reports its own "capabilities", 9.4 on MI300)
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=1)
def _allowed() -> bool:
    text = os.environ.get(ENV, "1").strip()
    if text not in ("0", "1"):
        raise ConfigError(f"{ENV}={text!r} is not allowed; set it to 1 (launch kernels with programmatic "
                          "dependent launch, the default on sm90+) or 0 (without)")
    return text == "1"


def check_env() -> None:
    """Validate KVFIT_PDL now (engine start-up) rather than at the first kernel launch; ConfigError if bad."""
    _allowed()


def enabled(t: torch.Tensor) -> bool:
    """Launch kernels working on t with PDL: a CUDA tensor on sm90+, and KVFIT_PDL not 0."""
    return on_gpu(t) and _allowed() and _device_supports(t.device.index if t.device.index is not None
                                                         else torch.cuda.current_device())


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr, and Triton's launch_pdl when on."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
