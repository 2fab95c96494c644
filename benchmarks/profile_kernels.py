"""Where the device time of a step goes, kernel by kernel (torch.profiler), and what the host adds.

python benchmarks/profile_kernels.py --model qwen3-0.6b --num-requests 256
python benchmarks/profile_kernels.py --model llama-3.1-8b --num-requests 1

Runs the throughput workload (or one request), profiles one prefill step and a few steady-state
decode steps (graph replay and eager), and times the host phases of a decode step. Prints the top
kernels by device time and a per-phase table.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import gpu_only


def kernel_table(prof, steps: int, top: int = 14) -> str:
    rows = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            rows[evt.name][0] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            rows[evt.name][1] += 1
    total = sum(t for t, _ in rows.values())
    lines = [f"  device total {total / steps / 1e3:8.3f} ms/step"]
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / steps / 1e3:8.3f} ms/step {100 * t / max(total, 1):5.1f}%  x{n // steps:<4d} {name[:90]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--decode-warm", type=int, default=60, help="decode steps before profiling")
    args = ap.parse_args()
    if not gpu_only("profile_kernels"):
        return 0
    from torch.profiler import ProfilerActivity, profile

    from common import request_set
    from kvfit import LLM, SamplingParams
    from kvfit.model_facts import load_model_facts
    from kvfit.runner.batch import build_inputs
    from kvfit.runner.sampler import sample
    prompts, outs = request_set(args.num_requests, vocab=load_model_facts(args.model).vocab_size)
    if args.num_requests == 1:
        prompts, outs = [prompts[0][:128]], [400]
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048,
              enable_prefix_caching=False)
    engine = llm.engine
    runner = engine.workers.runner
    for p, n in zip(prompts, outs):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    prefill_done = False
    num_mixed = 0
    while True:
        plan = engine.scheduler.schedule()
        mixed = any(len(s.token_ids) > 1 for s in plan.seqs)
        if mixed and num_mixed == 1:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                sampled = engine.workers.execute(plan)
                torch.cuda.synchronize()
            print(f"== prefill step: {plan.num_tokens} tokens, {len(plan.seqs)} seqs")
            print(kernel_table(prof, 1))
        else:
            sampled = engine.workers.execute(plan)
        num_mixed += mixed
        engine.scheduler.update(plan, sampled)
        if not mixed:
            if not prefill_done:
                prefill_done = True
                warm = args.decode_warm
            warm -= 1
            if warm == 0:
                break
    # steady-state decode: graph replay under the profiler
    plan = engine.scheduler.schedule()
    ctx = [s.start_pos + 1 for s in plan.seqs]
    print(f"== decode: batch {len(plan.seqs)}, mean context {sum(ctx) / len(ctx):.0f}")
    steps = 5
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.workers.execute(plan)          # same plan: rewrites the same slots
        torch.cuda.synchronize()
    print("-- graph replay + lm head + sample")
    print(kernel_table(prof, steps, top=18))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner._execute(plan, runner.kv_caches)
        torch.cuda.synchronize()
    print("-- eager")
    print(kernel_table(prof, steps, top=24))

    # host phases (synchronised) and an unsynchronised step
    timings = defaultdict(float)
    reps = 20

    def timed(name, fn, *a):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a)
        torch.cuda.synchronize()
        timings[name] += (time.perf_counter() - t0) / reps
        return out

    graphs = runner.graphs
    for _ in range(reps):
        inputs = timed("build_inputs", build_inputs, plan, runner.spec.block_size, runner.device)
        meta = inputs.meta
        logits = timed("replay+lm_head", graphs.replay, inputs.input_ids, inputs.positions, meta.slot_mapping,
                       meta.seq_lens, meta.block_tables)
        timed("sample", sample, logits, [s.params for s in plan.seqs], [s.num_generated for s in plan.seqs])
        timed("execute (all)", engine.workers.execute, plan)
    size = graphs.bucket_for(len(plan.seqs))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graphs.graphs[size].replay()
    end.record()
    end.synchronize()
    timings["graph replay only (events)"] = start.elapsed_time(end) / 1e3 / reps
    # whole engine steps, unsynchronised, on the live requests
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished() and n < reps:
        engine.step()
        n += 1
    torch.cuda.synchronize()
    timings["engine.step (live)"] = (time.perf_counter() - t0) / max(n, 1)
    for name, t in timings.items():
        print(f"  {name:28s} {t * 1e3:8.3f} ms")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
