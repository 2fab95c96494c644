"""Fused MoE (kvfit.kernels.fused_moe) on the GPU: sweep launch configs per batch size, against the torch reference.

python benchmarks/bench_fused_moe.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--m 1 8 32 128 512 2048 8192]
                                     [--budget-s 360] [--dtype bfloat16] [--tp 1]
For each MoE shape (one layer's experts, random bf16 weights, softmax routing of random logits) and each
token count M: every candidate config (pruned by tokens per expert) is checked against moe_reference and
timed as a CUDA graph of whole fused_moe calls (align + both launches + the sum over k: what decode
replays); the best is then also timed eagerly, beside the reference (eager; it syncs once per call) and
vLLM's fused_experts where vLLM is importable. Prints a table, then the best configs as a dict literal to
paste into fused_moe.TUNED_CONFIGS. Stops sweeping (keeping the default config) once --budget-s is spent,
so one device call of < 8 minutes always ends with a result. --tp N sweeps one rank's slice (I / N), the
shape a tensor-parallel rank runs (TUNED_CONFIGS is keyed by the per-rank I).

python benchmarks/bench_fused_moe.py --align [--shapes ...] [--m ...]
times moe_align alone instead (no sweep): the one-program kernel, the two-launch parallel path and what
moe_align picks (moe_align.align_num_programs), each as a CUDA graph and eagerly, beside vLLM's
moe_align_block_size where vLLM is importable; the two paths are checked to group the pairs alike. The
largest M where one program wins is the crossover for moe_align.ALIGN_ONE_PROGRAM_MAX_PAIRS.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import time

import torch
from common import gpu_only

# name -> (E, top_k, H, I): one layer's experts at tensor parallel 1
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
M_VALUES = (1, 8, 32, 128, 512, 2048, 8192)
ALIGN_M_VALUES = (1, 16, 64, 128, 192, 256, 384, 512, 1024, 2048, 8192, 16384)
DEVICE = "cuda"


def candidates(m: int, num_experts: int, top_k: int, dtype: torch.dtype) -> list[dict[str, int]]:
    """Configs worth timing at m tokens: tile rows by tokens per expert, the rest from a short list."""
    from kvfit.kernels.fused_moe import SMEM_BYTES, default_config, make_config, stage_bytes
    rows = m * top_k / num_experts
    if rows <= 4:        # decode: bound by reading the weights; wide K tiles and deep pipelines
        tiles = [(16, n, k, 4, s) for n, k, s in ((32, 128, 4), (32, 256, 3), (64, 128, 4), (64, 64, 5),
                                                   (64, 256, 3), (128, 64, 4), (128, 128, 3))]
    else:
        block_ms = (16, 32) if rows <= 32 else (32, 64) if rows <= 128 else (64, 128)
        tiles = [(bm, n, k, w, 3 if bm >= 64 else 4)
                 for bm, (n, k), w in itertools.product(block_ms, ((64, 64), (64, 128), (128, 64), (128, 128)), (4, 8))
                 if not (w == 8 and bm * n < 64 * 64) and not (w == 4 and bm * n >= 128 * 128)]   # 4: spills
    group = 1 if rows <= 16 else 8
    configs = [default_config(m, num_experts, top_k, dtype)]
    for bm, n, k, warps, stages in tiles:
        if stages * stage_bytes(bm, n, k, torch.finfo(dtype).bits // 8) <= SMEM_BYTES:
            cfg = make_config(bm, n, k, group, warps, stages)
            if cfg not in configs:
                configs.append(cfg)
    return configs


def graph_seconds(fn, target_s: float = 0.02) -> float:
    """Seconds per call: bench_gemv's graph timer over enough calls to take about target_s per replay."""
    from bench_gemv import graph_time
    fn()
    calls = max(1, min(200, int(target_s / max(eager_seconds(fn), 1e-6))))
    try:
        return graph_time(lambda _x, _w: fn(), None, range(calls), reps=5)
    except RuntimeError as e:   # decode needs capture: say so loudly, then time it eagerly
        print(f"  NOT CAPTURABLE in a CUDA graph ({type(e).__name__}: {e}); timed eagerly", flush=True)
        return eager_seconds(fn)


def eager_seconds(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") / 1e3


def kernel_breakdown(fn, calls: int = 5) -> dict[str, float]:
    """Device seconds per call of each kernel fn launches (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            name = event.key.removeprefix("_").split("(")[0][:40]
            times[name] = times.get(name, 0.0) + event.self_device_time_total / 1e6 / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def vllm_function(module: str, name: str):
    """vLLM's module.name (fused_experts, moe_align_block_size) when vLLM is importable, else None."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM column
        print(f"vLLM's {name} not importable ({type(e).__name__}: {e}); no vLLM column")
        return None


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def sweep_configs(label, problem, configs, ref, deadline) -> dict[str, float]:
    """json(config) -> graph seconds per call, for each config that matches the reference, until the deadline."""
    from kvfit.kernels.fused_moe import fused_moe
    results = {}
    for cfg in configs:
        if results and time.monotonic() > deadline:
            print(f"  {label}: budget spent, {len(results)} configs timed")
            break
        try:
            err = relative_error(fused_moe(*problem, config=cfg), ref)
            assert err < 2e-2, f"{label} {cfg}: relative error {err:.2e} against moe_reference"
            results[json.dumps(cfg)] = graph_seconds(lambda c=cfg: fused_moe(*problem, config=c))
        except triton_resource_errors() as e:
            print(f"  skip {cfg}: {type(e).__name__}")
    return results


def best_row(label, m, problem, cfg, results, ref, default_cfg, vllm) -> dict:
    """The winner beside the default, eager timing, the reference, vLLM and a per-kernel breakdown."""
    from kvfit.kernels.fused_moe import fused_moe, moe_reference
    x, w13, w2, weights, ids = problem
    row = {"shape": label, "m": m, "best": cfg, "fused_graph_s": results[json.dumps(cfg)],
           "default_graph_s": results.get(json.dumps(default_cfg)),
           "fused_eager_s": eager_seconds(lambda: fused_moe(*problem, config=cfg)),
           "reference_s": eager_seconds(lambda: moe_reference(*problem)),
           "error": relative_error(fused_moe(*problem, config=cfg), ref)}
    if vllm is not None:
        ids32 = ids.to(torch.int32)                                   # vLLM's routing dtype
        try:
            row["vllm_graph_s"] = graph_seconds(lambda: vllm(x, w13, w2, weights, ids32))
        except Exception as e:  # noqa: BLE001 - report, keep the sweep going
            print(f"  vLLM fused_experts failed at M={m}: {type(e).__name__}: {e}")
    try:
        row["kernels_s"] = kernel_breakdown(lambda: fused_moe(*problem, config=cfg))
    except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the sweep
        row["kernels_s"] = {}
        print(f"  profiler failed: {type(e).__name__}: {e}")
    return row


def sweep_shape(label, shape, m_values, dtype, deadline, vllm, rows, best):
    """Every M for one layer shape: appends table rows, records the best config per M in best."""
    from kvfit.kernels import fused_moe as fm
    num_experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=DEVICE, generator=gen) / inter ** 0.5).to(dtype)
    tuned = best.setdefault((num_experts, hidden, inter, top_k, str(dtype).removeprefix("torch.")), {})
    for m in m_values:
        x = torch.randn(m, hidden, device=DEVICE, generator=gen).to(dtype)
        weights, ids = fm.select_experts(torch.randn(m, num_experts, device=DEVICE, generator=gen), top_k, True)
        problem = (x, w13, w2, weights, ids)
        ref = fm.moe_reference(*problem)
        results = sweep_configs(f"{label} M={m}", problem, candidates(m, num_experts, top_k, dtype), ref, deadline)
        if not results:
            print(f"  {label} M={m}: no config ran")
            continue
        tuned[m] = cfg = json.loads(min(results, key=results.get))
        row = best_row(label, m, problem, cfg, results, ref, fm.default_config(m, num_experts, top_k, dtype), vllm)
        rows.append(row)
        print_row(row, len(results))
        print("    kernels: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row["kernels_s"].items()))
    del w13, w2
    torch.cuda.empty_cache()


def triton_resource_errors() -> tuple[type[BaseException], ...]:
    from triton.runtime.errors import OutOfResources
    return (OutOfResources,)


def print_row(row, num_timed: int) -> None:
    us = lambda s: f"{s * 1e6:9.1f}" if s else "        -"   # noqa: E731
    vllm = us(row.get("vllm_graph_s"))
    ratio = f"{row['vllm_graph_s'] / row['fused_graph_s']:5.2f}x" if row.get("vllm_graph_s") else "    -"
    print(f"{row['shape']:14s} M={row['m']:5d} fused(graph) {us(row['fused_graph_s'])} us"
          f"  default {us(row['default_graph_s'])} us"
          f"  eager {us(row['fused_eager_s'])} us  reference {us(row['reference_s'])} us"
          f"  ref/fused {row['reference_s'] / row['fused_graph_s']:6.2f}x  vLLM {vllm} us (vLLM/fused {ratio})"
          f"  err {row['error']:.1e}  [{num_timed} configs] best {row['best']}", flush=True)


def align_key(sorted_ids, block_experts, block_m: int, num_pairs: int) -> torch.Tensor:
    """(expert, pair id) of every row as one sorted key: equal for two aligns that group the pairs alike,
    whatever order the atomics gave inside a group."""
    experts = block_experts.long().repeat_interleave(block_m)
    return torch.sort(experts * (num_pairs + 1) + sorted_ids.long()).values


def time_align(shapes, m_values, dtype, tp: int) -> list[dict]:
    """moe_align at each M, with the block_m get_config picks there: one program vs the parallel path."""
    from kvfit.kernels import fused_moe as fm
    from kvfit.kernels import moe_align as ma
    vllm = vllm_function("vllm.model_executor.layers.fused_moe.moe_align_block_size", "moe_align_block_size")
    us = lambda s: f"{s * 1e6:7.1f}" if s else "      -"   # noqa: E731
    rows = []
    for name in shapes:
        num_experts, top_k, hidden, inter = SHAPES[name]
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        for m in m_values:
            _, ids = fm.select_experts(torch.randn(m, num_experts, device=DEVICE, generator=gen), top_k, True)
            block_m = fm.get_config(m, num_experts, hidden, inter // tp, top_k, dtype)["BLOCK_SIZE_M"]
            num_pairs, programs = ids.numel(), ma.parallel_align_programs(ids.numel(), num_experts, block_m)
            one = lambda: ma.moe_align(ids, num_experts, block_m, num_programs=1)   # noqa: E731
            parallel = lambda: ma.moe_align(ids, num_experts, block_m, num_programs=programs)   # noqa: E731
            assert torch.equal(align_key(*one(), block_m, num_pairs), align_key(*parallel(), block_m, num_pairs)), \
                f"{name} M={m}: the parallel align groups the pairs differently from the one-program kernel"
            row = {"shape": name, "m": m, "pairs": num_pairs, "block_m": block_m, "programs": programs,
                   "picked_programs": ma.align_num_programs(num_pairs, num_experts, block_m),
                   "one_program_graph_s": graph_seconds(one), "parallel_graph_s": graph_seconds(parallel),
                   "one_program_eager_s": eager_seconds(one), "parallel_eager_s": eager_seconds(parallel)}
            if vllm is not None:
                ids32 = ids.to(torch.int32)                                 # vLLM's routing dtype
                row["vllm_graph_s"] = graph_seconds(lambda: vllm(ids32, block_m, num_experts))
            row["parallel_kernels_s"] = kernel_breakdown(parallel)
            rows.append(row)
            print(f"{name:14s} M={m:5d} pairs {num_pairs:6d} block_m {block_m:3d}  graph: one program "
                  f"{us(row['one_program_graph_s'])} us, {programs:3d} programs {us(row['parallel_graph_s'])} us, "
                  f"vLLM {us(row.get('vllm_graph_s'))} us  eager: {us(row['one_program_eager_s'])} / "
                  f"{us(row['parallel_eager_s'])} us  picked {row['picked_programs']} program(s)", flush=True)
            kernels = row["parallel_kernels_s"].items()
            print("    parallel kernels: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in kernels))
        wins = [r["pairs"] for r in rows if r["shape"] == name and r["one_program_graph_s"] <= r["parallel_graph_s"]]
        print(f"{name}: one program wins (graph) up to {max(wins, default=0)} pairs; "
              f"ALIGN_ONE_PROGRAM_MAX_PAIRS = {ma.ALIGN_ONE_PROGRAM_MAX_PAIRS}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=None,
                    help=f"token counts (default {M_VALUES}; with --align {ALIGN_M_VALUES})")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="stop sweeping after this many seconds (each later M still times its default config)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: each rank holds I / tp channels")
    ap.add_argument("--align", action="store_true",
                    help="time moe_align alone (one program vs the parallel path, and vLLM's); no config sweep")
    args = ap.parse_args()
    if not gpu_only("bench_fused_moe"):
        return 0
    if args.align:
        rows = time_align(args.shapes, args.m or ALIGN_M_VALUES, getattr(torch, args.dtype), args.tp)
        print("RESULT " + json.dumps({"device": torch.cuda.get_device_name(), "align": rows}))
        return 0
    args.m = args.m or list(M_VALUES)
    start = time.monotonic()
    deadline = start + args.budget_s
    dtype = getattr(torch, args.dtype)
    vllm = vllm_function("vllm.model_executor.layers.fused_moe", "fused_experts")
    rows, best = [], {}
    for name in args.shapes:
        num_experts, top_k, hidden, inter = SHAPES[name]
        if inter % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide {name}'s intermediate size {inter}")
        shape = (num_experts, top_k, hidden, inter // args.tp)
        sweep_shape(name if args.tp == 1 else f"{name}/tp{args.tp}", shape, args.m, dtype, deadline, vllm, rows, best)
    print(f"swept in {time.monotonic() - start:.0f} s; paste into fused_moe.TUNED_CONFIGS (device "
          f"{torch.cuda.get_device_name()}):")
    print("TUNED_CONFIGS = {")
    for key, per_m in best.items():
        print(f"    {key!r}: {{")
        for m, cfg in per_m.items():
            print(f"        {m}: {cfg!r},")
        print("    },")
    print("}")
    print("RESULT " + json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
