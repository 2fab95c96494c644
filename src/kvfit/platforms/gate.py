"""The one gate of kvfit's Triton kernels: whether they run on a tensor (a CUDA GPU, with Triton installed).

Kernel launchers (kernels/) and the callers choosing a kernel or torch (the Triton backend, the sampler) ask
here rather than checking the device themselves, so which device runs the kernels is decided in platforms/.
This module imports nothing (not torch, and Triton only once a GPU tensor asks: a CPU run stays Triton-free),
so the kernels, which sit below platforms/, may import it (tests/test_layering.py ranks it low).
"""

from __future__ import annotations

import functools


def on_gpu(t) -> bool:
    """t lives on the GPU the kernels are compiled for (a CUDA device); elsewhere only Triton's interpreter
    runs them (tests)."""
    return t.is_cuda


def on_cpu(t) -> bool:
    """t lives in host memory: torch's CPU kernels run on it, whose costs differ from a GPU's (the sampler picks
    its ops by this: a whole-row sort or an argmax costs far more there than a reduction)."""
    return t.device.type == "cpu"


@functools.cache
def triton_importable() -> bool:
    """Triton imports in this process, with what every kernel module imports from it (read once)."""
    try:
        import triton.language  # noqa: F401
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:   # CPU-only installs
        return False
    return True


def triton_applies(t) -> bool:
    """Launch the Triton kernels on t: it is on a CUDA GPU and Triton is installed (else the torch path)."""
    return on_gpu(t) and triton_importable()
