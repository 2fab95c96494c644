"""The headroom watchdog on a real GPU (issue 32 (3)): another process takes the device's free memory while
an engine serves a full load; admission is held back (no out-of-memory, no lost request), and resumes when
that process lets go.

Run: python -m pytest tests/gpu/test_headroom_gpu.py -q -s
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# take all the device's free memory but 100 MiB (under the watchdog's 256 MiB floor), then wait for stdin
GRABBER = ("import sys, torch; free, _ = torch.cuda.mem_get_info(); "
           "x = torch.empty(max(free - (100 << 20), 0), dtype=torch.uint8, device='cuda'); "
           "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()")


def test_memory_taken_beside_a_full_load_pauses_admission_without_an_oom():
    from kvfit import LLM, SamplingParams
    llm = LLM("qwen3-0.6b", load_format="dummy", device="cuda", max_model_len=1024, gpu_memory_utilization=0.5,
              max_num_seqs=64, enable_prefix_caching=False)
    engine = llm.engine
    engine.headroom.check_every_steps = 1
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add_request([100 + (i * 7 + j) % 1000 for j in range(256)], params, f"r{i}")
    grabber = None
    paused_seen, finished = False, set()
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
                    assert len(out.outputs[0].token_ids) == 64 and out.outputs[0].finish_reason == "length"
            if grabber is None and len(finished) >= 32:
                grabber = subprocess.Popen([sys.executable, "-c", GRABBER], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
                assert grabber.stdout.readline().strip() == "ready"
                time.sleep(0.2)
            stats = engine.stats()
            if stats["admission_paused"]:
                paused_seen = True
                print(f"\npaused at {stats['device_headroom_bytes'] / 2**20:.0f} MiB free, "
                      f"{stats['running']} running, {len(finished)} finished")
                if grabber.poll() is None:
                    grabber.stdin.close()               # let go: admission must come back
                    grabber.wait(30)
    finally:
        if grabber is not None and grabber.poll() is None:
            grabber.kill()
    assert paused_seen, "the watchdog never saw the memory taken beside the engine"
    assert len(finished) == 256 and not engine.stats()["admission_paused"]
    assert engine.stats()["kv_blocks_used"] == 0
    llm.shutdown() if hasattr(llm, "shutdown") else engine.shutdown()
