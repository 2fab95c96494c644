"""The headroom scenario of tests/gpu/test_headroom_gpu.py with the allocator's figures per step (MiB).

python benchmarks/probe_headroom.py new|old     (a CUDA device; PYTHONPATH=src:tests)

qwen3-0.6b (dummy), util 0.5, 256 x 256-token prompts, 64 seqs; after 32 finish a second process takes all free
device memory but 100 MiB, and lets go once the watchdog pauses admission. Prints the reading (process budget,
activation peak, CUDA graphs), reserved / allocated / free and keep_within's cache releases, and whether it ended in
an out-of-memory. `old` patches CudaPlatform.keep_within back to a release without taking the activation reserve
again (the hold's slack, HOLD_SLACK_BYTES, stays as the code has it). Output of 2026-12-07:
benchmarks/results/2026-12-07-h100-headroom-reserve-fix.txt.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

sys.path.insert(0, "tests/gpu")
from test_headroom_gpu import GRABBER  # noqa: E402

from kvfit import LLM, SamplingParams  # noqa: E402
from kvfit.platforms import cuda as cuda_platform  # noqa: E402


def mib(n: int) -> int:
    return n >> 20


def memory(plat) -> str:
    return (f"reserved {mib(torch.cuda.memory_reserved())} alloc {mib(torch.cuda.memory_allocated())} "
            f"releases {plat.num_cache_releases} free {mib(torch.cuda.mem_get_info()[0])}")


def scenario(label: str) -> None:
    llm = LLM("qwen3-0.6b", load_format="dummy", device="cuda", max_model_len=1024, gpu_memory_utilization=0.5,
              max_num_seqs=64, enable_prefix_caching=False)
    engine = llm.engine
    plat, r = engine.workers.platform, engine.workers.reading
    print(label, "reading", (mib(r.process_budget_bytes), mib(r.activation_peak_bytes), mib(r.cuda_graph_bytes)))
    print(label, "after start", memory(plat))
    engine.headroom.check_every_steps = 1
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add_request([100 + (i * 7 + j) % 1000 for j in range(256)], params, f"r{i}")
    grabber, finished, n, seen = None, set(), 0, False
    try:
        while engine.has_unfinished():
            n += 1
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
            if n % 10 == 0:
                print(label, n, "fin", len(finished), memory(plat), "paused", engine.stats()["admission_paused"])
            if grabber is None and len(finished) >= 32:
                grabber = subprocess.Popen([sys.executable, "-c", GRABBER], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
                print(label, "grabber:", grabber.stdout.readline().strip())
                time.sleep(0.2)
            if engine.stats()["admission_paused"] and grabber.poll() is None:
                print(label, "PAUSED at", n)
                seen = True
                grabber.stdin.close()
                grabber.wait(30)
        print(label, "OK finished", len(finished), "releases", plat.num_cache_releases, "paused seen", seen)
    except torch.OutOfMemoryError as e:
        print(label, "OOM at step", n, str(e)[:200])
    finally:
        if grabber is not None and grabber.poll() is None:
            grabber.kill()
    llm.shutdown()


def keep_within_without_rehold(self, reading) -> None:
    if torch.cuda.memory_reserved(self.device) > reading.process_budget_bytes:
        torch.cuda.empty_cache()
        self.num_cache_releases += 1


if __name__ == "__main__":
    if sys.argv[1:] == ["old"]:
        cuda_platform.CudaPlatform.keep_within = keep_within_without_rehold
    scenario(sys.argv[1] if sys.argv[1:] else "new")
