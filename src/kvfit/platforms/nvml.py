"""Co-tenants: the other processes holding a GPU and their memory, read through NVML (`nvidia-ml-py`).

Their memory is already inside the reading's in_use_at_start_bytes (CUDA's free memory leaves it out); this
names who holds it, so the plan can say what they cost ("pid 4242 python holds 12.1 GiB: 8,200 blocks
fewer") and a start-up they prevent can say who. Without the binding, a driver or a permission to list
processes, the answer is () and nothing else changes. In a container with its own PID namespace NVML
reports host PIDs, so this process may not be told apart from the others by its pid alone.
"""

from __future__ import annotations

import os

from kvfit.kv.plan import UNLISTED_PID, tenant_label
from kvfit.units import GiB, gib

# memory in use at start outside this process's torch memory, past its own CUDA context, that NVML lists no
# process for (a PID namespace hides other containers' processes, or no permission) is named as one entry at
# least this large (below it: the context's own size varies by device and driver)
UNLISTED_MIN_BYTES = 1 * GiB
UNLISTED_NAME = "memory no listed process accounts for (another container, or NVML without permission)"


def unlisted_tenant(outside_torch_bytes: int, own_context_bytes: int) -> tuple[tuple[int, str, int], ...]:
    """Where NVML names nobody: one (UNLISTED_PID, UNLISTED_NAME, bytes) entry for what is in use outside this
    process's torch memory and its context, when that is at least UNLISTED_MIN_BYTES; else ()."""
    unlisted = outside_torch_bytes - own_context_bytes
    return ((UNLISTED_PID, UNLISTED_NAME, unlisted),) if unlisted >= UNLISTED_MIN_BYTES else ()


def _binding():
    try:
        import pynvml               # nvidia-ml-py, NVIDIA's maintained binding (imports without a GPU)
    except ImportError:
        return None
    return pynvml


def _name(nvml, pid: int) -> str:
    try:
        name = nvml.nvmlSystemGetProcessName(pid)
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:               # NVML's errors and a process that ended meanwhile
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as fh:
                name = fh.read()
        except OSError:
            return "?"
    return os.path.basename(name.strip()) or "?"


def co_tenants(uuid: str | None, index: int, own_pid: int | None = None,
               nvml=None) -> tuple[tuple[int, str, int], ...]:
    """(pid, process name, bytes) of every other process holding the GPU (by its UUID, else NVML index),
    largest first; () where NVML cannot tell. nvml: the binding module (tests pass a fake)."""
    nvml = _binding() if nvml is None else nvml
    if nvml is None:
        return ()
    own_pid = os.getpid() if own_pid is None else own_pid
    try:
        nvml.nvmlInit()
    except Exception:               # no driver, no library: nothing to say
        return ()
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else nvml.nvmlDeviceGetHandleByIndex(index)
        held: dict[int, int] = {}
        for listing in (nvml.nvmlDeviceGetComputeProcesses, nvml.nvmlDeviceGetGraphicsProcesses):
            for proc in listing(handle):
                used = getattr(proc, "usedGpuMemory", None)     # None: not reported (no permission)
                if proc.pid != own_pid and used:
                    held[proc.pid] = max(held.get(proc.pid, 0), int(used))
        found = [(pid, _name(nvml, pid), used) for pid, used in held.items()]
    except Exception:
        return ()
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return tuple(sorted(found, key=lambda t: -t[2]))


def co_tenant_note(tenants, bytes_per_block: int | None = None) -> str:
    """'pid 4242 python holds 12.10 GiB: 8,200 blocks fewer; ...' (blocks only with bytes_per_block)."""
    parts = []
    for pid, name, used in tenants:
        blocks = f": {used // bytes_per_block:,} blocks fewer" if bytes_per_block else ""
        parts.append(f"{tenant_label(pid, name)} holds {gib(used)}{blocks}")
    return "; ".join(parts)
