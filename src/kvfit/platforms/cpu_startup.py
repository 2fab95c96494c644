"""How long starting on the CPU takes: minutes for a large model, so the command says so before it starts.

The estimate is the checkpoint's load plus the start-up profile's FLOPs at this CPU's measured matmul rate
(CpuPlatform.startup_estimate asks it; commands/common.py prints it and the progress lines). A GPU loads and
profiles in seconds: its platform estimates nothing.
"""

from __future__ import annotations

import time

from kvfit.model_facts import DTYPE_BYTES, ModelFacts
from kvfit.planning import resolve_max_model_len, resolve_model_dtype
from kvfit.units import duration

# Assumed rate of reading a checkpoint into host memory and converting it (safetensors from a warm page
# cache; a cold disk or a network file system is slower). Random weights (--load-format dummy) are timed
# instead (measured_init_bytes_per_s): torch's normal_ fills 0.15 GB/s of bf16 on a 2-core VM.
CPU_LOAD_BYTES_PER_S = 1e9
CPU_FIXED_START_S = 3.0          # importing torch and kvfit, the model's facts, the KV cache (3.3 s on a 2-core VM)
CPU_SLOW_START_S = 30.0          # a start-up estimated past this gets the warning and progress lines
_MATMUL_SIZE = 1024              # the linear timed to measure this CPU's rate in the run's dtype
# below this much profile work no CPU starts slowly (a 2-core VM runs ~0.01 TFLOP/s in bf16 without native bf16
# instructions, 0.05 in fp32): nothing is timed
_NEGLIGIBLE_FLOPS = 1e11


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


def cpu_startup_work(facts: ModelFacts, config) -> tuple[int, int]:
    """(checkpoint bytes to load, FLOPs of the start-up profile). Each profiled step runs the model over
    its tokens at ~2 FLOPs per parameter per token (every expert counted for MoE: an upper bound; the LM
    head counted for every token, as the profile asks every position for prompt logprobs), plus attention:
    4 x heads x head_dim x query x key positions per layer and sequence (the reference backend's masked
    SDPA computes the whole square, masked half included). config: resolved (a platform's defaults in)."""
    max_len = resolve_max_model_len(facts, config.model.max_model_len)
    flops = 0
    for num_seqs, tokens_each in profile_shapes(config, max_len):
        flops += 2 * facts.num_params * num_seqs * tokens_each
        flops += 4 * facts.num_attention_heads * facts.head_dim * tokens_each ** 2 * num_seqs * facts.num_layers
    return facts.num_params * DTYPE_BYTES[resolve_model_dtype(facts, config.model.dtype)], flops


def cpu_startup_estimate(facts: ModelFacts, config, available_bytes: int) -> tuple[float, str] | None:
    """(seconds, a warning saying so) when starting on the CPU is estimated to take long, else None.
    config: resolved (a platform's defaults in); available_bytes: host memory available now."""
    load_bytes, flops = cpu_startup_work(facts, config)
    if flops < _NEGLIGIBLE_FLOPS and load_bytes / CPU_LOAD_BYTES_PER_S < CPU_SLOW_START_S / 2:
        return None     # fast on any CPU: nothing to time
    if load_bytes > available_bytes:     # the load fails at once ("the weights do not fit"): no wait to announce
        return None
    import torch
    dtype = resolve_model_dtype(facts, config.model.dtype)
    rate = measured_matmul_flops(getattr(torch, dtype))
    dummy = config.model.load_format == "dummy"
    load_rate = measured_init_bytes_per_s(getattr(torch, dtype)) if dummy else CPU_LOAD_BYTES_PER_S
    seconds = CPU_FIXED_START_S + load_bytes / load_rate + flops / rate
    if seconds < CPU_SLOW_START_S:
        return None
    loading = (f"random weights at the {load_rate / 1e9:.2f} GB/s measured here" if dummy
               else f"loading at an assumed {load_rate / 1e9:.0f} GB/s")
    return seconds, (
        f"warning: starting {facts.num_params / 1e9:.1f}B parameters ({load_bytes / 2**30:.1f} GiB in {dtype}) "
        f"on the CPU will take about {duration(seconds)} (an estimate: {loading}, "
        f"then profiling {config.scheduler.max_num_batched_tokens} tokens, "
        f"{flops / 1e12:.1f} TFLOP with attention, at the {rate / 1e9:.0f} GFLOP/s measured here); a GPU "
        "(--device cuda) or a lower --max-num-batched-tokens starts faster")
