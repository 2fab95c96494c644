"""Where kvfit's and vLLM's device time goes on the same workload: kernel time by kind, GPU idle, steps.

python3 benchmarks/profile_vs_vllm.py --models llama-3.1-8b [--engines kvfit vllm] [--workload throughput]
        [--out benchmarks/results/x.json]

Each engine in its own process, built as bench_vs_vllm.py builds it (same settings; vLLM's engine core in
this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profiler sees its kernels and its scheduler can be
watched). After a warm-up, the workload runs once unprofiled (wall time) and once under torch.profiler
(CUDA activity only): kernel time summed by kind (GEMM, attention, MoE, norm, ...) and the top kernels,
the device's busy time against the wall time (the rest is the GPU waiting on the host), and the
scheduler's steps (how many, how many tokens each, how many were decode-only). kvfit also runs the
workload a second time unprofiled, timing every engine step of both runs, and prints the steps where the
first run lost the most time against the second (the "first run is slow" question of issue 15). With
prefix caching on (the long group's workloads), the cache is reset before every run, so no run hits the
previous one's prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_vs_vllm import GROUPS, KvfitEngine, VllmEngine, add_run_args, run_worker, workload  # noqa: E402
from common import gpu_only  # noqa: E402

# first match wins; names are lower-cased kernel names
KINDS = [
    ("moe", r"moe|expert|align_block"),
    ("attention", r"flash|fmha|attn|attention|_prefill_kernel|_decode_kernel|paged|reduce_splits|combine"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|matmul|splitk|_gemv|sm90_"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|act_and_mul|gelu|swiglu"),
    ("sampling", r"softmax|argmax|topk|top_k|sort|sample|logit|penalt"),
    ("kv-write", r"reshape_and_cache|write_kv|cache_kernel"),
    ("copy/index", r"copy|memcpy|memset|cat|index|gather|scatter|fill|arange"),
    ("elementwise", r"elementwise|vectorized|reduce|triton_"),
]


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def kernel_summary(prof, top: int) -> dict:
    import torch
    per_name = defaultdict(lambda: [0.0, 0])
    runtime = defaultdict(lambda: [0.0, 0])     # host-side CUDA runtime/driver calls (syncs, mallocs, launches)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_name[evt.name][0] += evt.device_time_total
            per_name[evt.name][1] += 1
        elif evt.name.startswith(("cuda", "cu")):
            runtime[evt.name][0] += evt.cpu_time_total
            runtime[evt.name][1] += 1
    kinds = defaultdict(float)
    for name, (us, _) in per_name.items():
        kinds[kind_of(name)] += us
    return {"busy_s": sum(t for t, _ in per_name.values()) / 1e6,
            "kinds_s": {k: v / 1e6 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:120], "s": t / 1e6, "count": c, "kind": kind_of(n)}
                    for n, (t, c) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]],
            "runtime": [{"name": n[:60], "s": t / 1e6, "count": c}
                        for n, (t, c) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:8]]}


def watch_steps(engine_name: str, engine) -> list[tuple[int, int, int]]:
    """(tokens, requests, model steps) of every scheduled step, appended as the engine schedules."""
    steps: list[tuple[int, int, int]] = []
    if engine_name == "kvfit":
        scheduler = engine.llm.engine.scheduler

        def watched(inner):     # schedule, and schedule_continuation (async decode rounds)
            def call(*args, **kwargs):
                delta = inner(*args, **kwargs)
                if delta is not None and not delta.empty:
                    steps.append((delta.num_tokens, len(delta.request_ids), delta.max_num_steps))
                return delta
            return call
        scheduler.schedule_continuation = watched(scheduler.schedule_continuation)
        scheduler.schedule = watched(scheduler.schedule)
        return steps
    else:
        scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
        inner = scheduler.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            if out.total_num_scheduled_tokens:
                steps.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), 1))
            return out
    scheduler.schedule = schedule
    return steps


def time_engine_steps(engine) -> list[float]:
    """kvfit: the wall time of every LLMEngine.step call, appended as the engine steps."""
    times: list[float] = []
    inner = engine.llm.engine.step

    def step(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)
    engine.llm.engine.step = step
    return times


def first_run_report(first: list[float], second: list[float], top: int = 8) -> dict:
    """Where the first full run lost time against the second: the steps with the largest difference."""
    pairs = sorted(((a - b, i, a, b) for i, (a, b) in enumerate(zip(first, second))), reverse=True)[:top]
    return {"first_s": sum(first), "second_s": sum(second), "steps": [len(first), len(second)],
            "worst": [{"step": i, "first_ms": a * 1e3, "second_ms": b * 1e3} for _, i, a, b in pairs]}


def step_summary(steps: list[tuple[int, int, int]]) -> dict:
    decode = [s for s in steps if s[0] == s[1]]
    mixed = [s for s in steps if s[0] != s[1]]
    return {"rounds": len(steps), "model_steps": sum(s[2] for s in steps),
            "decode_rounds": len(decode), "decode_model_steps": sum(s[2] for s in decode),
            "mean_decode_batch": sum(s[1] for s in decode) / max(len(decode), 1),
            "mixed_steps": len(mixed), "mixed_tokens": sum(s[0] for s in mixed),
            "mean_mixed_tokens": sum(s[0] for s in mixed) / max(len(mixed), 1),
            "mean_mixed_requests": sum(s[1] for s in mixed) / max(len(mixed), 1)}


def worker(engine_name: str, model: str, name: str, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvfit.model_facts import load_model_facts
    vocab = load_model_facts(model).vocab_size
    group = next(g for g in GROUPS.values() if name in g["workloads"])
    engine = (KvfitEngine if engine_name == "kvfit" else VllmEngine)(model, group)
    prompts, outs = workload(name, vocab)
    engine.generate(prompts[:8], outs[:8])
    steps = watch_steps(engine_name, engine)
    step_times = time_engine_steps(engine) if engine_name == "kvfit" else []

    def fresh_cache():          # every run computes its prompts (no prefix hits on the last run's)
        if group["prefix_caching"]:
            engine.reset_prefix_cache()

    fresh_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = engine.generate(prompts, outs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    result = {"engine": engine_name, "model": model, "workload": name, "tokens": n, "wall_s": wall,
              "tok_s": n / wall, "steps": step_summary(steps)}
    if step_times:          # the same workload again, unprofiled: where did the first run lose time?
        first = list(step_times)
        step_times.clear()
        fresh_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, outs)
        torch.cuda.synchronize()
        result["second_wall_s"] = time.perf_counter() - t0
        result["first_run"] = first_run_report(first, step_times)
    fresh_cache()
    alloc = {k: torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR_COUNTS}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, outs)
        torch.cuda.synchronize()
        result["profiled_wall_s"] = time.perf_counter() - t0
    # cudaMalloc/cudaFree and the allocator's free-everything-and-retry during the profiled run: each stalls the host
    result["allocator"] = {k: torch.cuda.memory_stats().get(k, 0) - v for k, v in alloc.items()}
    result.update(kernel_summary(prof, top))
    print("RESULT " + json.dumps(result), flush=True)


def report(r: dict) -> str:
    lines = [f"== {r['engine']} {r['model']} {r['workload']}: {r['tok_s']:.0f} tok/s unprofiled ({r['wall_s']:.2f} s); "
             f"profiled {r['profiled_wall_s']:.2f} s, device busy {r['busy_s']:.2f} s "
             f"({100 * r['busy_s'] / r['profiled_wall_s']:.0f}%)",
             "  steps: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in r["steps"].items())]
    if "first_run" in r:
        fr = r["first_run"]
        lines.append(f"  second unprofiled run {r['second_wall_s']:.2f} s; engine steps {fr['first_s']:.2f} s vs "
                     f"{fr['second_s']:.2f} s over {fr['steps']} steps; largest gaps (ms, first/second): "
                     + ", ".join(f"#{w['step']} {w['first_ms']:.1f}/{w['second_ms']:.1f}" for w in fr["worst"]))
    lines += [f"  {kind:12s} {s:7.3f} s {100 * s / r['busy_s']:5.1f}%" for kind, s in r["kinds_s"].items()]
    lines += [f"    {k['s']:7.3f} s x{k['count']:<7d} [{k['kind']}] {k['name']}" for k in r["top"]]
    if r.get("allocator"):
        lines.append("  allocator during the profiled run: " + ", ".join(f"{k} {v}" for k, v in r["allocator"].items()))
    if r.get("runtime"):        # host time in CUDA API calls: a synchronize or cudaFree here stalls the host
        lines.append("  host CUDA API calls: " + ", ".join(f"{k['name']} {k['s']:.3f} s x{k['count']}"
                                                          for k in r["runtime"]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b"])
    ap.add_argument("--workload", default="throughput",
                    choices=sorted({w for g in GROUPS.values() for w in g["workloads"]} - {"latency"}))
    ap.add_argument("--top", type=int, default=25)
    add_run_args(ap, ("ENGINE", "MODEL", "WORKLOAD"))
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, top=args.top)
        return 0
    if not gpu_only("profile_vs_vllm"):
        return 0
    results = []
    for model in args.models:
        for engine in args.engines:
            cmd = [sys.executable, __file__, "--worker", engine, model, args.workload, "--top", str(args.top)]
            found = run_worker(cmd, f"{engine} {model}", args.timeout, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            for r in found:
                print(report(r), flush=True)
            results += found
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
