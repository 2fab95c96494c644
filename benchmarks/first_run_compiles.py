"""Which Triton kernels compile during the first full workload run, after the start-up and warm-up.

python3 benchmarks/first_run_compiles.py --model qwen3-0.6b
Runs with an empty TRITON_CACHE_DIR; lists the kernels compiled by start-up + the 8-request warm-up, then
those first compiled inside the timed throughput run (the cause of a slow first repetition), and times two
runs. Each compiled kernel is a folder in the cache with <name>.json (its constants and specialization).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def compiled() -> dict[str, dict]:
    found = {}
    for path in glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.json")):
        if os.path.basename(path).startswith("__grp__"):
            continue
        with open(path) as fh:
            meta = json.load(fh)
        found[path] = meta
    return found


def describe(meta: dict) -> str:
    keep = {k: meta.get(k) for k in ("name", "num_warps", "num_stages")}
    return f"{keep} constants={meta.get('constants')} attrs={str(meta.get('attrs', ''))[:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    args = ap.parse_args()
    import torch
    from bench_vs_vllm import GROUPS, KvfitEngine, workload
    from kvfit.model_facts import load_model_facts
    t0 = time.perf_counter()
    engine = KvfitEngine(args.model, GROUPS["base"])
    prompts, outs = workload("throughput", load_model_facts(args.model).vocab_size)
    print(f"start-up {time.perf_counter() - t0:.1f} s, kernels compiled {len(compiled())}")
    engine.generate(prompts[:8], outs[:8])
    before = compiled()
    print(f"after warm-up: {len(before)} kernels")
    for rep in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = engine.generate(prompts, outs)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        now = compiled()
        new = [now[p] for p in now if p not in before]
        print(f"run {rep}: {n / dt:.0f} tok/s, {len(new)} kernels compiled during it")
        for meta in new:
            print("   ", describe(meta))
        before = now


if __name__ == "__main__":
    main()
