"""Helpers shared by the engine subcommands."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from contextlib import contextmanager


def setup_logging() -> None:
    """Every command's log in the server's one format (level, time, logger: kvfit.server.logs)."""
    from kvfit.server.logs import configure_logging
    configure_logging("info")


def add_sampling_flags(p) -> None:
    """Sampling flags; one left out takes --generation-config's default, else vLLM's (as a request does)."""
    from kvfit.commands.flags import int_flag
    p.add_argument("--max-tokens", type=int_flag, default=None,
                   help="tokens to generate per prompt (default: the generation config's max_new_tokens, else 16)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the generation config's, else 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens whose "
                   "probabilities add up to this (default: the generation config's, else 1.0)")
    p.add_argument("--top-k", type=int_flag, default=None,
                   help="sample among the k likeliest tokens, -1: all (default: the generation config's, else -1)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args, seed, defaults):
    """The flags' SamplingParams over `defaults` (LLM.get_default_sampling_params())."""
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "max_tokens")
             if getattr(args, name) is not None}
    return dataclasses.replace(defaults, seed=seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos, **given)


# --- start-up on the CPU: minutes for a large model, so say so and show it is still going ----------------
# Assumed rate of reading a checkpoint into host memory and converting it (safetensors from a warm page
# cache; a cold disk or a network file system is slower). Random weights (--load-format dummy) cost about
# the same per byte.
CPU_LOAD_BYTES_PER_S = 1e9
CPU_SLOW_START_S = 30.0          # a start-up estimated past this gets the warning and progress lines
PROGRESS_EVERY_S = 30.0          # seconds between "still starting" lines
_MATMUL_SIZE = 512               # the matmul timed to measure this CPU's rate in the run's dtype
_FASTEST_CPU_FLOPS = 5e11        # no CPU profiles faster (a 2-core VM: ~0.06 TFLOP/s in bf16); below it, nothing is timed


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def measured_matmul_flops(torch_dtype) -> float:
    """This CPU's matmul rate (FLOP/s) in torch_dtype, timed on a few square matmuls."""
    import torch
    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(torch_dtype)
    a @ a   # warm-up: thread pool and kernels
    reps = 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ a
    return 2 * _MATMUL_SIZE ** 3 * reps / max(time.perf_counter() - start, 1e-9)


def cpu_startup_work(facts, config) -> tuple[int, int]:
    """(checkpoint bytes to load, FLOPs of the start-up profile): the profile runs the model once over
    max_num_batched_tokens tokens (twice when the widest and the longest step differ), ~2 FLOPs per
    parameter per token (every expert counted for MoE: an upper bound)."""
    from kvfit.model_facts import DTYPE_ALIASES, DTYPE_BYTES
    from kvfit.planning import resolve_max_model_len
    dtype = facts.torch_dtype if config.model.dtype == "auto" else DTYPE_ALIASES[config.model.dtype.lower()]
    sched = config.scheduler
    max_len = resolve_max_model_len(facts, config.model.max_model_len)
    num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_len)
    passes = 1 if min(sched.max_num_seqs, num_tokens) == max(-(-num_tokens // max_len), 1) else 2
    return facts.num_params * DTYPE_BYTES[dtype], 2 * facts.num_params * num_tokens * passes


def cpu_startup_estimate(facts, config) -> tuple[float, str] | None:
    """(seconds, a warning saying so) when starting on the CPU is estimated to take long, else None."""
    from kvfit.platforms.cpu import read_meminfo
    load_bytes, flops = cpu_startup_work(facts, config)
    if load_bytes / CPU_LOAD_BYTES_PER_S + flops / _FASTEST_CPU_FLOPS < CPU_SLOW_START_S:
        return None     # fast even on the fastest CPU: nothing to time
    if load_bytes > read_meminfo()[1]:     # the load fails at once ("the weights do not fit"): no wait to announce
        return None
    from kvfit.model_facts import DTYPE_ALIASES
    from kvfit.runner.kv_cache import TORCH_DTYPES
    dtype = facts.torch_dtype if config.model.dtype == "auto" else DTYPE_ALIASES[config.model.dtype.lower()]
    rate = measured_matmul_flops(TORCH_DTYPES[dtype])
    seconds = load_bytes / CPU_LOAD_BYTES_PER_S + flops / rate
    if seconds < CPU_SLOW_START_S:
        return None
    return seconds, (
        f"warning: starting {facts.num_params / 1e9:.1f}B parameters ({load_bytes / 2**30:.1f} GiB in {dtype}) "
        f"on the CPU will take about {_duration(seconds)} (an estimate: loading at an assumed "
        f"{CPU_LOAD_BYTES_PER_S / 1e9:.0f} GB/s, then profiling {config.scheduler.max_num_batched_tokens} tokens "
        f"at the {rate / 1e9:.0f} GFLOP/s measured here); a GPU (--device cuda) or a lower "
        "--max-num-batched-tokens starts faster")


def _slow_start(config) -> tuple[float, str] | None:
    from kvfit.model_facts import load_model_facts
    from kvfit.platforms import get_platform
    # a GPU loads and profiles in seconds; the host CPU is the platform whose start-up takes minutes
    if get_platform(config.device.device).name != "cpu":
        return None
    if config.model.load_format != "dummy":     # missing weights fail at once (the loader's error): no wait to announce
        from kvfit.models.loader import safetensors_files
        safetensors_files(config.model.model)
    return cpu_startup_estimate(load_model_facts(config.model.model, config.model.quantization), config)


def _progress(stop: threading.Event, start: float, seconds: float, every: float) -> None:
    while not stop.wait(every):
        print(f"kvfit: still starting, {_duration(time.monotonic() - start)} of about {_duration(seconds)} "
              "(estimated)", file=sys.stderr, flush=True)


@contextmanager
def engine_startup(config):
    """Around building the engine: when starting on the CPU is estimated to take long, a warning with
    the estimate first, then a "still starting" line every PROGRESS_EVERY_S until the engine is up."""
    notice = _slow_start(config)
    if notice is None:
        yield
        return
    seconds, warning = notice
    print(warning, file=sys.stderr, flush=True)
    start, stop = time.monotonic(), threading.Event()
    ticker = threading.Thread(target=_progress, args=(stop, start, seconds, PROGRESS_EVERY_S), daemon=True,
                              name="kvfit-startup-progress")
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
    print(f"kvfit: started in {_duration(time.monotonic() - start)}", file=sys.stderr, flush=True)
