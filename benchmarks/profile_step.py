"""Where a step's time goes: schedule, execute (device work synchronised), update, outputs.

python benchmarks/profile_step.py --model qwen3-0.6b --num-requests 256
Prints milliseconds per step for each phase, for decode-only steps and for the rest.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import gpu_only


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    args = ap.parse_args()
    if not gpu_only("profile_step"):
        return 0
    from common import request_set
    from kvfit import LLM, SamplingParams
    from kvfit.model_facts import load_model_facts
    prompts, outs = request_set(args.num_requests, vocab=load_model_facts(args.model).vocab_size)
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048,
              enable_prefix_caching=False)
    engine = llm.engine
    runner = engine.workers.runner
    totals = defaultdict(float)
    counts = defaultdict(int)

    def timed(kind, name, fn, *a):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*a)
        torch.cuda.synchronize()
        totals[(kind, name)] += time.perf_counter() - start
        return out

    for p, n in zip(prompts, outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        plan = timed("all", "schedule", engine.scheduler.schedule)
        kind = "decode" if all(len(s.token_ids) == 1 for s in plan.seqs) else "mixed"
        counts[kind] += 1
        start = time.perf_counter()
        from kvfit.runner.batch import build_inputs
        timed(kind, "build_inputs", build_inputs, plan, runner.spec.block_size, runner.device)
        sampled = timed(kind, "execute", engine.workers.execute, plan)
        timed(kind, "update", engine.scheduler.update, plan, sampled)
        totals[(kind, "step")] += time.perf_counter() - start
    for (kind, name), t in sorted(totals.items()):
        n = counts[kind] if kind != "all" else sum(counts.values())
        print(f"{kind:7s} {name:13s} {1e3 * t / max(n, 1):8.3f} ms/step over {n} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
