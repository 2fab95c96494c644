"""Start-up on the CPU: time and peak RSS of `kvfit generate MODEL --load-format dummy --device cpu` with the
default flags (issue 32 (6): qwen3-0.6b in under 30 s and 4 GB on a 2-core machine), beside the slow-start
estimate (platforms/cpu_startup.py) for the same settings (aim: within 2x of the measured time).

python benchmarks/bench_cpu_startup.py [--model qwen3-0.6b] [--reps 1] [-- extra kvfit flags]

Each repetition is a fresh process generating one token from a 3-token prompt (the token costs a decode step,
well under a second), so its wall time is the start-up as a user sees it: Python and torch imports, the
model's dummy weights, the start-up profile, the KV cache. Peak RSS is the child's (getrusage). The ratio
printed is measured / estimated.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time


def one_start(model: str, extra: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one fresh `kvfit generate` process. CPU seconds (user +
    system, all threads) hold where other processes share the cores and stretch the wall time."""
    argv = [sys.executable, "-m", "kvfit.cli", "generate", model, "--load-format", "dummy", "--device", "cpu",
            "--prompt-token-ids", "1,2,3", "--max-tokens", "1", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"kvfit generate failed ({done.returncode}):\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, cpu, after.ru_maxrss * 1024        # ru_maxrss: KiB, the largest child so far


def estimate(model: str, extra: list[str]) -> tuple[float, float, int]:
    """(estimated seconds, TFLOP of the profile, tokens profiled) from platforms/cpu_startup.py's formula."""
    import torch

    from kvfit.commands.flags import add_engine_flags, engine_kwargs
    from kvfit.config import EngineConfig
    from kvfit.model_facts import load_model_facts
    from kvfit.planning import resolve_model_dtype
    from kvfit.platforms import cpu_startup
    from kvfit.platforms.cpu import CpuPlatform
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--load-format", "dummy", "--device", "cpu", *extra])
    config = CpuPlatform().resolve_config(EngineConfig.from_kwargs(model, **engine_kwargs(args)))
    facts = load_model_facts(config.model.model)
    load_bytes, flops = cpu_startup.cpu_startup_work(facts, config)
    dtype = getattr(torch, resolve_model_dtype(facts, config.model.dtype))
    rate = cpu_startup.measured_matmul_flops(dtype)
    load_rate = cpu_startup.measured_init_bytes_per_s(dtype)      # --load-format dummy
    seconds = cpu_startup.CPU_FIXED_START_S + load_bytes / load_rate + flops / rate
    return seconds, flops / 1e12, config.scheduler.max_num_batched_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more kvfit flags, after --")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores, load average "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}")
    est_s, tflop, tokens = estimate(args.model, args.extra)
    for rep in range(args.reps):
        load = os.getloadavg()[0]
        seconds, cpu, rss = one_start(args.model, args.extra)
        print(f"{args.model} {' '.join(args.extra) or '(default flags)'}: start + 1 token {seconds:.1f} s wall "
              f"(load average {load:.1f} before), {cpu:.1f} CPU s ({cpu / cores:.1f} s on {cores} idle cores), "
              f"peak RSS {rss / 2**30:.2f} GiB; estimate {est_s:.1f} s ({tokens} tokens profiled, "
              f"{tflop:.2f} TFLOP), measured/estimated {seconds / est_s:.2f}x")


if __name__ == "__main__":
    main()
