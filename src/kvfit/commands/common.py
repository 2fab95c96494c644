"""Helpers shared by the engine subcommands."""

from __future__ import annotations

import dataclasses
import logging
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
# cache; a cold disk or a network file system is slower). Random weights (--load-format dummy) are timed
# instead (measured_init_bytes_per_s): torch's normal_ fills 0.15 GB/s of bf16 on a 2-core VM.
CPU_LOAD_BYTES_PER_S = 1e9
CPU_FIXED_START_S = 3.0          # importing torch and kvfit, the model's facts, the KV cache (3.3 s on a 2-core VM)
CPU_SLOW_START_S = 30.0          # a start-up estimated past this gets the warning and progress lines
PROGRESS_EVERY_S = 30.0          # seconds between "still starting" lines
_MATMUL_SIZE = 1024              # the linear timed to measure this CPU's rate in the run's dtype
# below this much profile work no CPU starts slowly (a 2-core VM runs ~0.01 TFLOP/s in bf16 without native bf16
# instructions, 0.05 in fp32): nothing is timed
_NEGLIGIBLE_FLOPS = 1e11


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def measured_matmul_flops(torch_dtype) -> float:
    """This CPU's rate (FLOP/s) in torch_dtype at the model's own op: F.linear of [128, S] by [2S, S] (S =
    _MATMUL_SIZE), timed a few times. (A square `a @ a` in bf16 takes a path 7x slower than linear's on a CPU
    without bf16 instructions, which made the estimate 5x too long.)"""
    import torch
    x = torch.randn(128, _MATMUL_SIZE).to(torch_dtype)
    w = torch.randn(2 * _MATMUL_SIZE, _MATMUL_SIZE).to(torch_dtype)
    torch.nn.functional.linear(x, w)   # warm-up: thread pool and kernels
    reps = 3
    start = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(x, w)
    return 2 * 128 * 2 * _MATMUL_SIZE ** 2 * reps / max(time.perf_counter() - start, 1e-9)


def measured_init_bytes_per_s(torch_dtype) -> float:
    """This CPU's rate (bytes/s) of filling torch_dtype with normal_, as dummy weights are."""
    import torch
    x = torch.empty(1 << 21, dtype=torch_dtype)
    x.normal_()                          # warm-up
    start = time.perf_counter()
    x.normal_()
    return x.numel() * x.element_size() / max(time.perf_counter() - start, 1e-9)


def profile_shapes(config, max_model_len: int) -> list[tuple[int, int]]:
    """The start-up profile's steps as (sequences, tokens each): the widest step (max_num_batched_tokens over
    max_num_seqs sequences) and the longest (as few sequences as max_model_len allows), once each when they
    are the same shape (runner/model_runner.py's profile_run). config: resolved (a platform's defaults in)."""
    sched = config.scheduler
    num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_model_len)
    wide = max(min(sched.max_num_seqs, num_tokens), 1)
    long = max(-(-num_tokens // max_model_len), 1)
    return [(n, -(-num_tokens // n)) for n in dict.fromkeys((wide, long))]


def cpu_startup_work(facts, config) -> tuple[int, int]:
    """(checkpoint bytes to load, FLOPs of the start-up profile). Each profiled step runs the model over
    its tokens at ~2 FLOPs per parameter per token (every expert counted for MoE: an upper bound; the LM
    head counted for every token, as the profile asks every position for prompt logprobs), plus attention:
    4 x heads x head_dim x query x key positions per layer and sequence (the reference backend's masked
    SDPA computes the whole square, masked half included). config: resolved (a platform's defaults in)."""
    from kvfit.model_facts import DTYPE_ALIASES, DTYPE_BYTES
    from kvfit.planning import resolve_max_model_len
    dtype = facts.torch_dtype if config.model.dtype == "auto" else DTYPE_ALIASES[config.model.dtype.lower()]
    max_len = resolve_max_model_len(facts, config.model.max_model_len)
    flops = 0
    for num_seqs, tokens_each in profile_shapes(config, max_len):
        flops += 2 * facts.num_params * num_seqs * tokens_each
        flops += 4 * facts.num_attention_heads * facts.head_dim * tokens_each ** 2 * num_seqs * facts.num_layers
    return facts.num_params * DTYPE_BYTES[dtype], flops


def cpu_startup_estimate(facts, config) -> tuple[float, str] | None:
    """(seconds, a warning saying so) when starting on the CPU is estimated to take long, else None.
    config: resolved (a platform's defaults in)."""
    from kvfit.platforms.cpu import read_meminfo
    load_bytes, flops = cpu_startup_work(facts, config)
    if flops < _NEGLIGIBLE_FLOPS and load_bytes / CPU_LOAD_BYTES_PER_S < CPU_SLOW_START_S / 2:
        return None     # fast on any CPU: nothing to time
    if load_bytes > read_meminfo()[1]:     # the load fails at once ("the weights do not fit"): no wait to announce
        return None
    from kvfit.model_facts import DTYPE_ALIASES
    from kvfit.runner.kv_cache import TORCH_DTYPES
    dtype = facts.torch_dtype if config.model.dtype == "auto" else DTYPE_ALIASES[config.model.dtype.lower()]
    rate = measured_matmul_flops(TORCH_DTYPES[dtype])
    dummy = config.model.load_format == "dummy"
    load_rate = measured_init_bytes_per_s(TORCH_DTYPES[dtype]) if dummy else CPU_LOAD_BYTES_PER_S
    seconds = CPU_FIXED_START_S + load_bytes / load_rate + flops / rate
    if seconds < CPU_SLOW_START_S:
        return None
    loading = (f"random weights at the {load_rate / 1e9:.2f} GB/s measured here" if dummy
               else f"loading at an assumed {load_rate / 1e9:.0f} GB/s")
    return seconds, (
        f"warning: starting {facts.num_params / 1e9:.1f}B parameters ({load_bytes / 2**30:.1f} GiB in {dtype}) "
        f"on the CPU will take about {_duration(seconds)} (an estimate: {loading}, "
        f"then profiling {config.scheduler.max_num_batched_tokens} tokens, "
        f"{flops / 1e12:.1f} TFLOP with attention, at the {rate / 1e9:.0f} GFLOP/s measured here); a GPU "
        "(--device cuda) or a lower --max-num-batched-tokens starts faster")


def _slow_start(config) -> tuple[float, str] | None:
    from kvfit.model_facts import load_model_facts
    from kvfit.platforms import get_platform
    platform = get_platform(config.device.device)
    # a GPU loads and profiles in seconds; the host CPU is the platform whose start-up takes minutes
    if platform.name != "cpu":
        return None
    if config.model.load_format != "dummy":     # missing weights fail at once (the loader's error): no wait to announce
        from kvfit.models.loader import safetensors_files
        safetensors_files(config.model.model)
    return cpu_startup_estimate(load_model_facts(config.model.model, config.model.quantization),
                                platform.resolve_config(config))


def _notice(level: int, message: str) -> None:
    """A start-up notice on stderr in the log's one format (kvfit.server.logs), shown whether or not
    logging is configured (a notice the user waits on is never dropped)."""
    from kvfit.server.logs import LOG_DATE_FORMAT, LOG_FORMAT
    record = logging.LogRecord("kvfit", level, __file__, 0, message, None, None)
    print(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT).format(record), file=sys.stderr, flush=True)


def _progress(stop: threading.Event, start: float, seconds: float, every: float) -> None:
    while not stop.wait(every):
        _notice(logging.INFO, f"still starting, {_duration(time.monotonic() - start)} of about "
                              f"{_duration(seconds)} (estimated)")


@contextmanager
def engine_startup(config):
    """Around building the engine: when starting on the CPU is estimated to take long, a warning with
    the estimate first, then a "still starting" line every PROGRESS_EVERY_S until the engine is up."""
    notice = _slow_start(config)
    if notice is None:
        yield
        return
    seconds, warning = notice
    _notice(logging.WARNING, warning.removeprefix("warning: "))
    start, stop = time.monotonic(), threading.Event()
    ticker = threading.Thread(target=_progress, args=(stop, start, seconds, PROGRESS_EVERY_S), daemon=True,
                              name="kvfit-startup-progress")
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
    _notice(logging.INFO, f"started in {_duration(time.monotonic() - start)}")
