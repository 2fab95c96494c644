"""Batch-1 linear layers: cuBLAS (F.linear) against kvfit's Triton GEMV, against copy bandwidth.

python benchmarks/bench_gemv.py [--model llama-3.1-8b] [--fp8]
For each weight shape of the model (q/k/v, o, gate/up, down, lm_head) at one token: the time of a
CUDA graph replaying the product over enough weight copies that nothing stays in L2, as bytes of
weight read per second, for cuBLAS and each Triton config; then the whole decode step's linears.
--fp8: per-channel FP8 weights: cuBLASLt's _scaled_mm (with the activation's quantize kernel, the W8A8 path)
against the FP8 GEMV (kernels/fp8_gemv.py) in each of FP8_CONFIGS.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import gpu_only

# (BLOCK_N, BLOCK_K, warps, stages); the loop's loads are plain (not software-pipelined), so stages do not
# matter. The 2026-12-03 sweep's losers (wide BLOCK_N, short BLOCK_K) are gone; one-row programs added.
CONFIGS = [(2, 2048, 4, 3), (1, 4096, 4, 1), (2, 4096, 4, 1), (2, 4096, 8, 1), (1, 2048, 4, 1), (4, 2048, 8, 1),
           (2, 1024, 4, 1), (1, 4096, 8, 1), (4, 4096, 8, 1), (1, 8192, 8, 1), (1, 1024, 2, 1), (2, 2048, 2, 1)]

FP8_CONFIGS = [(4, 1024, 4), (1, 4096, 4), (4, 2048, 8), (2, 2048, 4), (2, 4096, 8), (1, 8192, 8), (8, 1024, 8),
               (2, 1024, 4), (4, 512, 4), (1, 2048, 2)]


def shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, times per decode step)."""
    from kvfit.model_facts import load_model_facts
    f = load_model_facts(model)
    h, d, layers = f.hidden_size, f.head_dim, f.num_layers
    return {"qkv": ((f.num_attention_heads + 2 * f.num_kv_heads) * d, h, layers),
            "o_proj": (h, f.num_attention_heads * d, layers),
            "gate_up": (2 * f.intermediate_size, h, layers),
            "down": (h, f.intermediate_size, layers),
            "lm_head": (f.vocab_size, h, 1)}


def graph_time(fn, x, weights, reps: int = 20) -> float:
    """Seconds per product: a graph of one product per weight copy, replayed `reps` times."""
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--fp8", action="store_true", help="per-channel FP8 weights: _scaled_mm against the FP8 GEMV")
    args = ap.parse_args()
    if not gpu_only("bench_gemv"):
        return 0
    from common import copy_bandwidth
    if args.fp8:
        return run_fp8(args.model)
    from kvfit.kernels.gemv import gemv
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    totals, best, rows = sweep(
        args.model, lambda n, k, gen: torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16), 2,
        lambda x, w: torch.nn.functional.linear(x.float(), w.float()),
        ("cublas", lambda a, w: torch.nn.functional.linear(a, w)), gemv, CONFIGS, "triton best")
    print("per decode step (all linears): " + ", ".join(f"{c} {t * 1e3:.3f} ms" for c, t in totals.items()))
    print(f"best config per shape: {best}")
    print("RESULT " + json.dumps({"model": args.model, "copy_bandwidth_Bps": bandwidth, "rows": rows,
                                  "step_totals_s": totals}))
    return 0


def run_fp8(model: str) -> int:
    """The --fp8 sweep: bytes of FP8 weight read per second, _scaled_mm (W8A8) against each GEMV config."""
    from kvfit.kernels.fp8 import Fp8Weight, quantize_weight_per_channel
    from kvfit.kernels.fp8_gemm import _cublas_linear
    from kvfit.kernels.fp8_gemv import fp8_gemv

    def make_weight(n: int, k: int, gen) -> Fp8Weight:
        weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        return Fp8Weight(*quantize_weight_per_channel(weight), None)
    totals, best, rows = sweep(model, make_weight, 1, lambda x, w: x.float() @ w.dequantize().t(),
                               ("scaled_mm", lambda a, w: _cublas_linear(a, w, None, None, blockwise=False)),
                               fp8_gemv, FP8_CONFIGS, "gemv best")
    print("per decode step (all linears, FP8): " + ", ".join(f"{c} {t * 1e3:.3f} ms" for c, t in totals.items()))
    print(f"best config per shape: {best}")
    print("RESULT " + json.dumps({"model": model, "fp8": True, "rows": rows, "step_totals_s": totals}))
    return 0


def sweep(model: str, make_weight, weight_bytes: int, reference, baseline, kernel, configs, best_name: str):
    """Per weight shape of `model` at one token: the seconds of `baseline` (name, fn) and of `kernel` in each of
    `configs` (each checked against `reference` first), as bytes of weight read per second; -> (per decode step
    totals, the best config per shape, rows)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base_name, base_fn = baseline
    totals, best, rows = {base_name: 0.0}, {}, []
    for name, (n, k, per_step) in shapes(model).items():
        nbytes = n * k * weight_bytes
        copies = max(2, -(-(512 << 20) // nbytes))           # >= 512 MiB of weights: L2 never holds them
        weights = [make_weight(n, k, gen) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        ref = reference(x, weights[0])
        results = {base_name: graph_time(base_fn, x, weights)}
        for cfg in configs:
            got = kernel(x, weights[0], config=cfg).float()
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, cfg, err)
            results[str(cfg)] = graph_time(lambda a, w, c=cfg: kernel(a, w, config=c), x, weights)
        winner = min((c for c in results if c != base_name), key=results.get)
        best[name] = winner
        for c, t in results.items():
            totals[c] = totals.get(c, 0.0) + per_step * t
        totals[best_name] = totals.get(best_name, 0.0) + per_step * results[winner]
        print(f"{name:8s} N={n:6d} K={k:5d} TB/s read  "
              + " ".join(f"{c}:{nbytes / t / 1e12:.2f}" for c, t in results.items()), flush=True)
        rows.append({"name": name, "n": n, "k": k, "seconds": results, "best": winner})
        del weights
        torch.cuda.empty_cache()
    return totals, best, rows


if __name__ == "__main__":
    raise SystemExit(main())
