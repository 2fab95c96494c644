"""Device memory a tiny MoE engine leaves outside torch's allocator, and every compiled kvfit Triton
kernel's registers, spills and shared memory.

A kernel that spills makes the CUDA driver reserve local memory for every thread the device can hold, and
the reservation stays with the process: fused_moe's 16-bit wide tiles compiled for fp32 left 3.4 GiB
outside torch on the H200 (before their fp32 tiles were narrowed), which later engines of the process
count as memory in use at start-up.

python benchmarks/probe_local_memory.py      # on a GPU; prints [lmem] and [kern] lines
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def outside_torch(tag: str) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"[lmem] {tag}: outside torch {(total - free - torch.cuda.memory_reserved()) / 2**30:.2f} GiB", flush=True)


def compiled_kernels():
    """(module.name, compiled kernel) for every Triton kernel of kvfit compiled in this process."""
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("kvfit") or mod is None:
            continue
        for name, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if not caches:
                continue
            for entry in caches.values():
                kernels = entry[0] if isinstance(entry, tuple) else entry
                for kernel in kernels.values():
                    yield f"{modname}.{name}", kernel


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_local_memory needs a CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from tiny_models import make_tiny_model
    from kvfit import LLM, SamplingParams
    torch.cuda.init()
    outside_torch("start")
    folder = make_tiny_model(Path(tempfile.mkdtemp()), arch="qwen3_moe", seed=11,
                             moe={"num_experts": 8, "top_k": 2, "norm_topk_prob": True})
    llm = LLM(folder, device="cuda", kv_cache_memory="64MiB")
    outside_torch("qwen3_moe engine built")
    llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    outside_torch("qwen3_moe generated")
    llm.shutdown()
    del llm
    outside_torch("qwen3_moe shut down")
    for name, kernel in compiled_kernels():
        kernel._init_handles()
        print(f"[kern] {name}: regs {kernel.n_regs} spills {kernel.n_spills} shared {kernel.metadata.shared} "
              f"warps {kernel.metadata.num_warps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
