"""Where a step's time goes: schedule, execute (device work synchronised), apply outputs.

python benchmarks/profile_step.py --model qwen3-0.6b --num-requests 256 [--num-scheduler-steps 1] [--stream]

Runs the throughput workload to the end on the engine's internals, as LLMEngine.step does: schedule
-> workers.execute (apply the StepDelta to the persistent batch, build inputs, run, sample) -> apply
(scheduler.update, finish decisions and outputs, once per device step of the delta), with
torch.cuda.synchronize before and after each phase. Prints milliseconds per step for each phase, for
decode-only steps and for mixed steps (some request computes a prefill chunk). With
--num-scheduler-steps K > 1 a decode step is a round of up to K device steps.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import gpu_only

PHASES = ("schedule", "execute", "apply", "step")


def apply_outputs(engine, delta, tokens, stream: bool) -> None:
    """LLMEngine.step's last phase: each device step's tokens recorded, finishes decided, outputs made."""
    outputs = {}
    for step in range(delta.max_num_steps):
        engine._apply(delta, tokens, step, stream, outputs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--num-scheduler-steps", type=int, default=1, help="device steps per decode round")
    ap.add_argument("--stream", action="store_true", help="an output per request each step (as a server)")
    args = ap.parse_args()
    if not gpu_only("profile_step"):
        return 0
    from common import request_set
    from kvfit import LLM, SamplingParams
    from kvfit.model_facts import load_model_facts
    prompts, outs = request_set(args.num_requests, vocab=load_model_facts(args.model).vocab_size)
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048,
              enable_prefix_caching=False, num_scheduler_steps=args.num_scheduler_steps)
    engine = llm.engine
    totals = defaultdict(float)             # (kind, phase) -> seconds
    counts = defaultdict(int)               # kind -> steps

    def timed(fn, *a):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*a)
        torch.cuda.synchronize()
        return out, time.perf_counter() - start

    for p, n in zip(prompts, outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        delta, schedule_s = timed(engine.scheduler.schedule, engine.num_scheduler_steps)
        assert not delta.empty, "scheduler made no progress with requests waiting"
        tokens, execute_s = timed(engine.workers.execute, delta)
        _, apply_s = timed(apply_outputs, engine, delta, tokens, args.stream)
        kind = "decode" if delta.num_tokens == len(delta.request_ids) else "mixed"
        counts[kind] += 1
        for phase, seconds in zip(PHASES, (schedule_s, execute_s, apply_s, schedule_s + execute_s + apply_s)):
            totals[(kind, phase)] += seconds
    for kind in sorted(counts):
        for phase in PHASES:
            n = counts[kind]
            print(f"{kind:7s} {phase:9s} {1e3 * totals[(kind, phase)] / n:8.3f} ms/step over {n} steps")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
