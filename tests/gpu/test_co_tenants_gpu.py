"""Co-tenants on a real GPU (issue 32 (2)): a second process holding 2 GiB of the device is named in the reading
through NVML (or, where NVML lists no process, as memory no listed process accounts for), and the plan prices it
in blocks (the capacity line and `kvfit profile` print it). The budget is
derived from the GPU, the other process's memory included (gpu_capacity.gpu_budget).

Run: python -m pytest tests/gpu/test_co_tenants_gpu.py -q -s
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pynvml = pytest.importorskip("pynvml")

HOLD_BYTES = 2 << 30
SETTINGS = dict(load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=16, enable_prefix_caching=False)
KV_CACHE_BYTES, LEAST_KV_BYTES = 4 << 30, 1 << 30
HOLDER = ("import sys, time, torch; x = torch.empty({n}, dtype=torch.uint8, device='cuda'); "
          "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()")


def test_another_process_on_the_gpu_is_named_and_costed():
    from gpu_capacity import gpu_budget

    from kvfit import LLM
    from kvfit.kv.plan import tenant_label
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(n=HOLD_BYTES)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        llm = LLM("qwen3-0.6b", **gpu_budget("qwen3-0.6b", SETTINGS, KV_CACHE_BYTES, LEAST_KV_BYTES))
        try:
            reading, plan = llm.engine.readings[0], llm.capacity
            print(f"\nco-tenants {reading.co_tenants}\nplan {plan.log_line()}")
            # where NVML lists nobody (a PID namespace, no permission) the holder's memory is still named, as
            # memory no listed process accounts for (kv.plan.UNLISTED_PID)
            big = [t for t in reading.co_tenants if t[2] >= HOLD_BYTES]
            assert big, reading.co_tenants
            assert reading.in_use_at_start_bytes >= sum(t[2] for t in reading.co_tenants)
            pid, name, used = big[0]
            line = next(line for line in plan.co_tenants if line.startswith(tenant_label(pid, name) + " "))
            # the cost: the blocks its bytes would add to the memory limit (nothing else binds here)
            fewer = ((plan.available_kv_bytes + used) // plan.bytes_per_block) - plan.num_blocks
            assert f"{fewer:,} blocks fewer" in line and line in plan.log_line()
        finally:
            llm.shutdown()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
