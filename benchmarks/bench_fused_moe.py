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

python benchmarks/bench_fused_moe.py --fp8 block [--shapes qwen3-30b-a3b] [--m 1 2 4 ... 8192] [--budget-s 270]
sweeps fused_fp8_experts (kvfit.kernels.fp8_fused_experts) the same way: random experts quantized with [128, 128]
block scales (--fp8 channel: per output row), each config checked against Fp8Experts' reference loop and
timed as a CUDA graph (quantize + align + both launches + the sum), the down launch's BLOCK_N swept beside
gate/up's; vLLM's fused_experts on the same FP8 weights timed the same way where vLLM is importable (its
error against the reference printed beside it). The table it prints goes into
fp8_fused_experts.TUNED_FP8_CONFIGS.

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


def sweep_configs(label, run, configs, ref, deadline) -> dict[str, float]:
    """json(config) -> graph seconds per run(config), for each config that matches the reference, until the
    deadline (the first config always runs: a late M still gets its default timed)."""
    results = {}
    for cfg in configs:
        if results and time.monotonic() > deadline:
            print(f"  {label}: budget spent, {len(results)} configs timed")
            break
        try:
            err = relative_error(run(cfg), ref)
            if err > 2e-2:      # a wrong kernel: loud, and never a winner (one bad config must not end the call)
                print(f"  WRONG {label} {cfg}: relative error {err:.2e} against the reference", flush=True)
                continue
            results[json.dumps(cfg)] = graph_seconds(lambda c=cfg: run(c))
        except triton_resource_errors() as e:
            print(f"  skip {cfg}: {type(e).__name__}")
    return results


def best_row(label, m, run, cfg, results, ref, default_cfg, reference=None, vllm_call=None) -> dict:
    """The winner beside the default, eager timing, the reference (when given), vLLM's call (its graph time
    and its error against ref) and a per-kernel breakdown."""
    row = {"shape": label, "m": m, "best": cfg, "fused_graph_s": results[json.dumps(cfg)],
           "default_graph_s": results.get(json.dumps(default_cfg)),
           "fused_eager_s": eager_seconds(lambda: run(cfg)),
           "reference_s": eager_seconds(reference) if reference is not None else None,
           "error": relative_error(run(cfg), ref)}
    if vllm_call is not None:
        try:
            row["vllm_error"] = relative_error(vllm_call(), ref)
            row["vllm_graph_s"] = graph_seconds(vllm_call)
        except Exception as e:  # noqa: BLE001 - report, keep the sweep going
            print(f"  vLLM fused_experts failed at M={m}: {type(e).__name__}: {e}")
    try:
        row["kernels_s"] = kernel_breakdown(lambda: run(cfg))
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
        run = lambda cfg, p=problem: fm.fused_moe(*p, config=cfg)   # noqa: E731
        results = sweep_configs(f"{label} M={m}", run, candidates(m, num_experts, top_k, dtype), ref, deadline)
        if not results:
            print(f"  {label} M={m}: no config ran")
            continue
        tuned[m] = cfg = json.loads(min(results, key=results.get))
        ids32 = ids.to(torch.int32)                                   # vLLM's routing dtype
        vllm_call = None if vllm is None else (lambda p=problem, i=ids32: vllm(*p[:4], i))
        row = best_row(label, m, run, cfg, results, ref, fm.default_config(m, num_experts, top_k, dtype),
                       lambda p=problem: fm.moe_reference(*p), vllm_call)
        rows.append(row)
        print_row(row, len(results))
        print("    kernels: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row["kernels_s"].items()))
    del w13, w2
    torch.cuda.empty_cache()


FP8_M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FP8_BLOCK = (128, 128)      # the Hub's block-wise FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3)


def fp8_candidates(m: int, num_experts: int, top_k: int, hidden: int, inter: int,
                   block_size: tuple[int, int] | None) -> list[dict[str, int]]:
    """FP8 configs worth timing at m tokens: the fallback (today's rule) first, then tiles by tokens per expert;
    the K step is the weight block's columns, gate/up tiles stay within MAX_BLOCKWISE_TILE (larger ones spill
    on sm_90) and the pipeline within shared memory; the down launch's BLOCK_N is swept beside gate/up's, and
    with block scales a gate/up BLOCK_N of the blocks' columns also with the activation quantized in its
    epilogue (QUANT_IN_GATE_UP)."""
    from kvfit.kernels import fp8_fused_experts as fe
    from kvfit.kernels.fused_moe import SMEM_BYTES, make_config
    block_k = block_size[1] if block_size else 128
    rows = m * top_k / num_experts
    # (gate/up BLOCK_N per half, down BLOCK_N) pairs; decode adds narrow tiles (more programs reading weights)
    widths = ((64, 64), (64, 128), (128, 128)) + (((32, 64), (32, 128)) if rows <= 2 else ())
    if rows <= 2:          # decode: bound by reading the weights
        block_ms, warps, stages, group = (16,), (4,), (3, 4), 1
    elif rows <= 16:
        block_ms, warps, stages, group = (16, 32), (4,), (3, 4), 1
    elif rows <= 64:
        block_ms, warps, stages, group = (32, 64), (4, 8), (3,), 8
    else:                  # compute bound: wide tiles, grouped so weight tiles stay in L2
        block_ms, warps, stages, group = (64, 128), (4, 8), (3, 4), 8
    configs = [fe.fallback_fp8_config(m, num_experts, hidden, inter, top_k, block_size)]
    for bm, (bn, down_n), w, st in itertools.product(block_ms, widths, warps, stages):
        if bm * bn > fe.MAX_BLOCKWISE_TILE or st * (bm + 2 * bn) * block_k > SMEM_BYTES:
            continue
        if (w == 4 and bm * bn >= fe.MAX_BLOCKWISE_TILE) or (w == 8 and bm < 64):   # spills / idle warps
            continue
        cfg = make_config(bm, bn, block_k, group, w, st)
        if down_n != bn:
            cfg[fe.DOWN_BLOCK_N_KEY] = down_n
        # a gate/up tile row that is one activation group may also write act in fp8 (no quantize launch)
        fused = [{**cfg, fe.QUANT_IN_GATE_UP_KEY: 1}] if block_size is not None and bn == block_size[1] else []
        for candidate in [cfg] + fused:
            if candidate not in configs:
                configs.append(candidate)
    return configs


def fp8_experts(num_experts, hidden, inter, block_size, gen):
    """Random experts quantized as Fp8Experts holds them: (w13 [E, 2I, H], its scale, w2 [E, H, I], its scale),
    fp8 weights with per-row ([E, rows, 1]) or per-block fp32 scales."""
    from kvfit.kernels.fp8 import quantize_weight_blocks, quantize_weight_per_channel
    quantize = quantize_weight_per_channel if block_size is None else \
        (lambda w: quantize_weight_blocks(w, block_size))
    stacked = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        parts = [quantize(torch.randn(rows, cols, device=DEVICE, generator=gen) / cols ** 0.5)
                 for _ in range(num_experts)]
        stacked += [torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])]
    return tuple(stacked)


def fp8_reference(x, experts, block_size, weights, ids):
    """Fp8Experts' reference loop: per expert, x quantized as the kernels do, fp32 products of the dequantized
    operands (fp8.fp8_linear_reference), the routing weights and the sum over k in fp32."""
    import torch.nn.functional as F
    from kvfit.kernels.fp8 import Fp8Weight, fp8_linear_reference
    from kvfit.kernels.fused_moe import experts_by_group
    w13, s13, w2, s2 = experts

    def expert_mlp(e, rows):
        gate, up = fp8_linear_reference(rows, Fp8Weight(w13[e], s13[e], block_size)).chunk(2, dim=-1)
        return fp8_linear_reference(F.silu(gate) * up, Fp8Weight(w2[e], s2[e], block_size))
    return experts_by_group(x, weights, ids, w13.shape[0], expert_mlp)


def vllm_fp8_caller(fused_experts, experts, block_size):
    """(x, weights, ids) -> vLLM's fused_experts on the same FP8 experts (its Triton path, activations quantized
    per token and group as kvfit's): the quant_config API where vLLM has it, else the older keywords."""
    import inspect
    w13, s13, w2, s2 = experts
    flags = dict(block_shape=None if block_size is None else list(block_size),
                 per_act_token_quant=block_size is None, per_out_ch_quant=block_size is None)
    try:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    except ImportError:
        old = dict(use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2, **flags)
        return lambda x, weights, ids: fused_experts(x, w13, w2, weights, ids, **old)
    accepted = inspect.signature(fp8_w8a8_moe_quant_config).parameters
    quant_config = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2,
                                             **{k: v for k, v in flags.items() if k in accepted})
    return lambda x, weights, ids: fused_experts(x, w13, w2, weights, ids, quant_config=quant_config)


def sweep_fp8_shape(label, shape, m_values, dtype, block_size, deadline, vllm, rows, best):
    """Every M for one layer shape with FP8 experts: fused_fp8_experts' configs against Fp8Experts' reference
    loop, beside vLLM's fused_experts on the same weights; appends rows, records the best config per M."""
    from kvfit.kernels import fp8_fused_experts as fe
    from kvfit.kernels import fused_moe as fm
    num_experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    experts = fp8_experts(num_experts, hidden, inter, block_size, gen)
    vllm_run = None if vllm is None else vllm_fp8_caller(vllm, experts, block_size)
    tuned = best.setdefault((num_experts, hidden, inter, top_k, fe.fp8_scales_name(block_size)), {})
    for m in m_values:
        x = torch.randn(m, hidden, device=DEVICE, generator=gen).to(dtype)
        weights, ids = fm.select_experts(torch.randn(m, num_experts, device=DEVICE, generator=gen), top_k, True)
        ref = fp8_reference(x, experts, block_size, weights, ids)
        run = lambda cfg, x=x, w=weights, i=ids: fe.fused_fp8_experts(   # noqa: E731
            x, experts[0], experts[1], experts[2], experts[3], block_size, w, i, cfg)
        configs = fp8_candidates(m, num_experts, top_k, hidden, inter, block_size)
        results = sweep_configs(f"{label} M={m}", run, configs, ref, deadline)
        if not results:
            print(f"  {label} M={m}: no config ran")
            continue
        tuned[m] = cfg = json.loads(min(results, key=results.get))
        vllm_call = None if vllm_run is None else (lambda x=x, w=weights, i=ids.to(torch.int32): vllm_run(x, w, i))
        row = best_row(label, m, run, cfg, results, ref, configs[0], None, vllm_call)
        rows.append(row)
        print_row(row, len(results))
        print("    kernels: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row["kernels_s"].items()))
    del experts
    torch.cuda.empty_cache()


def triton_resource_errors() -> tuple[type[BaseException], ...]:
    from triton.runtime.errors import OutOfResources
    return (OutOfResources,)


def print_row(row, num_timed: int) -> None:
    us = lambda s: f"{s * 1e6:9.1f}" if s else "        -"   # noqa: E731
    over = lambda a, b: f"{a / b:5.2f}x" if a and b else "    -"   # noqa: E731
    vllm_err = f" (err {row['vllm_error']:.1e})" if "vllm_error" in row else ""
    print(f"{row['shape']:14s} M={row['m']:5d} fused(graph) {us(row['fused_graph_s'])} us"
          f"  default {us(row['default_graph_s'])} us (default/best {over(row['default_graph_s'], row['fused_graph_s'])})"
          f"  eager {us(row['fused_eager_s'])} us  reference {us(row['reference_s'])} us"
          f"  ref/fused {over(row['reference_s'], row['fused_graph_s'])}  vLLM {us(row.get('vllm_graph_s'))} us"
          f"{vllm_err} (vLLM/fused {over(row.get('vllm_graph_s'), row['fused_graph_s'])})"
          f"  err {row['error']:.1e}  [{num_timed} configs] best {row['best']}", flush=True)


def tuned_table(name: str, best: dict) -> str:
    """best ({key: {M: config}}) as the dict literal to paste over `name` in the kernel module."""
    lines = [f"{name}: dict[tuple[int, int, int, int, str], dict[int, dict[str, int]]] = {{"]
    for key, per_m in best.items():
        lines.append(f"    {key!r}: {{")
        lines += [f"        {m}: {cfg!r}," for m, cfg in sorted(per_m.items())]
        lines.append("    },")
    return "\n".join(lines + ["}"])


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
    ap.add_argument("--fp8", choices=["block", "channel"], default=None,
                    help="sweep fused_fp8_experts instead: [128, 128] block scales or per-channel ones "
                         f"(default M {FP8_M_VALUES}); prints TUNED_FP8_CONFIGS")
    args = ap.parse_args()
    if not gpu_only("bench_fused_moe"):
        return 0
    if args.align:
        rows = time_align(args.shapes, args.m or ALIGN_M_VALUES, getattr(torch, args.dtype), args.tp)
        print("RESULT " + json.dumps({"device": torch.cuda.get_device_name(), "align": rows}))
        return 0
    args.m = args.m or list(FP8_M_VALUES if args.fp8 else M_VALUES)
    start = time.monotonic()
    deadline = start + args.budget_s
    dtype = getattr(torch, args.dtype)
    vllm = vllm_function("vllm.model_executor.layers.fused_moe", "fused_experts")
    block_size = FP8_BLOCK if args.fp8 == "block" else None
    rows, best = [], {}
    for name in args.shapes:
        num_experts, top_k, hidden, inter = SHAPES[name]
        if inter % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide {name}'s intermediate size {inter}")
        shape = (num_experts, top_k, hidden, inter // args.tp)
        label = name if args.tp == 1 else f"{name}/tp{args.tp}"
        if args.fp8:
            sweep_fp8_shape(label, shape, args.m, dtype, block_size, deadline, vllm, rows, best)
        else:
            sweep_shape(label, shape, args.m, dtype, deadline, vllm, rows, best)
    table, module = ("TUNED_FP8_CONFIGS", "fp8_fused_experts") if args.fp8 else ("TUNED_CONFIGS", "fused_moe")
    print(f"swept in {time.monotonic() - start:.0f} s; paste into kvfit/kernels/{module}.py's {table} (device "
          f"{torch.cuda.get_device_name()}):")
    print(tuned_table(table, best))
    print("RESULT " + json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "fp8": args.fp8,
                                  "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
