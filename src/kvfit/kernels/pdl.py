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

Kernels use it on CUDA devices of compute capability 9.0 or newer unless the engine's setting is off
(DeviceConfig.pdl: LLM(pdl=False) or KVFIT_PDL=0), which is in force while the runner launches work
(`setting`, a context manager that always resets; outside any engine it is on).
"""

from __future__ import annotations

import contextvars
import functools
from contextlib import contextmanager

import torch

from kvfit.platforms.gate import on_gpu

# DeviceConfig.pdl of the engine launching kernels in this context (outside any engine: on)
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvfit_pdl", default=True)


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    # griddepcontrol is PTX: NVIDIA sm90+ only (ROCm reports its own "capabilities", 9.4 on MI300)
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


@contextmanager
def setting(enabled: bool):
    """Kernels launched inside may use PDL only if `enabled` (the engine's DeviceConfig.pdl); reset on exit."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled(t: torch.Tensor) -> bool:
    """Launch kernels working on t with PDL: a CUDA tensor on sm90+, and the setting on."""
    return on_gpu(t) and _ENABLED.get() and _device_supports(t.device.index if t.device.index is not None
                                                              else torch.cuda.current_device())


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr, and Triton's launch_pdl when on."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
