"""Sweep the per-channel FP8 GEMM in Triton (kernels/fp8_block_gemm.channel_fp8_gemm) against cuBLASLt's
rowwise-scaled torch._scaled_mm on a model's dense linears, and write the winners to the tuned-config file
(kernels/fp8_channel_configs.py says how fp8_linear reads it).

python benchmarks/tune_fp8_channel_gemm.py [--model llama-3.1-8b] [--m 2 4 8 ... 1024] [--write FILE] [--margin 0.03]

Per (shape, M): each candidate config checked against the fp32 product of the dequantized operands, then timed as
CUDA graph replays with L2 flushed before each call (common.graph_time: as between layers), in microseconds; an
entry is the best Triton config where it beats _scaled_mm by more than --margin, else null (_scaled_mm). The
activation quantize is the same for both and is not timed. --write merges this device's entries into FILE (the
packaged file by default; other devices' entries stay). Last, the step's dense linears summed over the layers at
each M: _scaled_mm, the tuned choice, and bf16 cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from bench_fp8_block_gemm import dense_shapes
from common import gpu_only, graph_time

# (BLOCK_M, BLOCK_N, warps, stages, SPLIT_K, BLOCK_K). Split-K for few rows where the output tiles alone leave
# SMs idle (o_proj and down of an 8B: N = 4,096, 32 tiles of 128 columns a row block)
CANDIDATES = [(16, 64, 4, 4, 1, 128), (16, 128, 4, 4, 1, 128), (16, 64, 4, 4, 1, 256), (16, 128, 4, 3, 1, 256),
              (16, 64, 4, 4, 2, 128), (16, 64, 4, 4, 4, 128), (16, 128, 4, 4, 4, 128), (32, 64, 4, 4, 1, 128),
              (32, 128, 4, 4, 1, 128), (32, 64, 4, 4, 4, 128), (32, 128, 4, 4, 2, 128), (64, 64, 4, 4, 1, 128),
              (64, 128, 4, 4, 1, 128), (64, 128, 8, 4, 1, 128), (64, 64, 4, 4, 4, 128), (64, 128, 4, 4, 2, 128),
              (64, 128, 4, 3, 1, 256), (64, 256, 8, 3, 1, 128), (128, 64, 4, 4, 1, 128), (128, 128, 8, 3, 1, 128),
              (128, 128, 8, 4, 1, 128), (128, 128, 4, 4, 2, 128), (128, 128, 8, 3, 1, 256)]
DEFAULT_M = [4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--m", type=int, nargs="+", default=DEFAULT_M)
    ap.add_argument("--margin", type=float, default=0.03, help="Triton must beat _scaled_mm by more than this share")
    ap.add_argument("--write", nargs="?", const="", default=None,
                    help="merge the winners into this file (no value: the packaged file)")
    ap.add_argument("--json", default=None, help="also write every timing here")
    args = ap.parse_args()
    if not gpu_only("tune_fp8_channel_gemm"):
        return 0
    from kvfit.kernels import fp8_block_gemm as bg
    from kvfit.kernels import fp8_channel_configs as cc
    from kvfit.kernels.fp8 import Fp8Weight, quantize_weight_per_channel
    from kvfit.kernels.fp8_quantize import quantize_rows
    torch.manual_seed(0)
    device_name = torch.cuda.get_device_name()
    start = time.perf_counter()
    entries: dict[str, list] = {}
    timings: list[dict] = []
    totals: dict[tuple[int, str], float] = {}
    for name, (n, k, per_layer) in dense_shapes(args.model).items():
        w32 = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = quantize_weight_per_channel(w32)
        w = Fp8Weight(wq, ws, None)
        w_deq, w_bf16 = w.dequantize(), w32.to(torch.bfloat16)
        shape_entries = []
        for m in sorted(args.m):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x, None)
            ref = (xq.float() * xs) @ w_deq.t()
            scale_b = ws.view(1, -1)
            cublas = graph_time(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=scale_b,
                                                         out_dtype=torch.bfloat16))
            bf16 = graph_time(lambda: torch.nn.functional.linear(x, w_bf16))
            row = {}
            for config in CANDIDATES:
                if -(-k // config[5]) % config[4]:
                    continue
                try:
                    y = bg.channel_fp8_gemm(xq, xs, w, None, torch.bfloat16, config)
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                    if err > 2e-2:
                        raise RuntimeError(f"relative error {err:.4f}")
                    row[config] = graph_time(lambda c=config: bg.channel_fp8_gemm(xq, xs, w, None, torch.bfloat16, c))
                except Exception as exc:    # a config that does not compile or fit (shared memory) is skipped
                    print(f"  {name} M={m} {config}: skipped ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
            best = min(row, key=row.get) if row else None
            wins = best is not None and row[best] < cublas * (1 - args.margin)
            shape_entries.append([m, list(best) if wins else None])
            chosen = row[best] if wins else cublas
            for key, t in (("scaled_mm", cublas), ("tuned", chosen), ("bf16", bf16)):
                totals[(m, key)] = totals.get((m, key), 0.0) + t * per_layer
            gbps = (n * k + m * k) / chosen / 1e9
            print(f"{name:8s} N={n:5d} K={k:5d} M={m:5d}: _scaled_mm {cublas * 1e6:7.1f} us, best Triton {best} "
                  f"{row[best] * 1e6 if best else float('nan'):7.1f} us -> {'Triton' if wins else '_scaled_mm'} "
                  f"({cublas / chosen:.2f}x, {gbps:.0f} GB/s of FP8 operands), bf16 {bf16 * 1e6:7.1f} us", flush=True)
            timings.append({"shape": name, "n": n, "k": k, "m": m, "scaled_mm_s": cublas, "bf16_s": bf16,
                            "triton_s": {str(c): t for c, t in row.items()}, "chosen": list(best) if wins else None})
        entries[f"{n}x{k}"] = shape_entries
    print(f"\n{device_name}, {args.model}: the step's dense linears (all layers), ms: _scaled_mm / tuned / bf16 cuBLAS")
    for m in sorted(args.m):
        s, t, b = (totals[(m, key)] * 1e3 for key in ("scaled_mm", "tuned", "bf16"))
        print(f"  M={m:5d}: {s:7.3f} / {t:7.3f} ({s / t:.2f}x) / {b:7.3f}")
    print(f"sweep {time.perf_counter() - start:.0f} s")
    if args.write is not None:
        path = args.write or cc.CONFIG_FILE
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data.setdefault(device_name, {}).update(entries)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {device_name}'s entries for {len(entries)} shapes to {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "model": args.model, "timings": timings}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
