"""The dynamic FP8 activation quantize (kernels/fp8_quantize.py): the tiled kernel (a tile of rows x whole groups
read once) against the two-pass kernel (one program per row and group, the row read twice), at the activation
shapes of llama-3.1-8b per channel and qwen3-30b-a3b block-wise, with the bandwidth each reaches.

python benchmarks/bench_fp8_quantize.py [--rows 64 1024 8192] [--reps 2]
Times are medians of CUDA graph replays (common.graph_time: L2 flushed before each) in microseconds; each
(shape, rows) is measured --reps times, alternating the kernels, and the median and spread are printed.
Bytes counted: x read once (bf16) + fp8 written + scales written.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import gpu_only, graph_time

# (what, K, group or None per token): the inputs of the FP8 GEMMs of a layer
SHAPES = [("8b qkv/gate_up in", 4096, None), ("8b down in", 14336, None),
          ("30b qkv/moe in", 2048, 128), ("30b o in", 4096, 128), ("30b down in (x top-8 rows)", 768, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 1024, 8192])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    if not gpu_only("bench_fp8_quantize"):
        return
    from kvfit.kernels import fp8_quantize as qk
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'shape':<28} {'rows':>6} {'tiled us':>9} {'two-pass us':>12} {'ratio':>6} {'spread':>7} {'tiled TB/s':>10}")
    for what, k, group in SHAPES:
        for rows in args.rows:
            rows = rows * 8 if "top-8" in what else rows
            g = k if group is None else group
            if triton_p2(g) > qk.MAX_TILE_GROUP:
                print(f"{what:<28} {rows:>6} (wider than the tiled kernel's {qk.MAX_TILE_GROUP}: two-pass only)")
                continue
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xq = torch.empty(rows, k, device="cuda", dtype=qk.FP8_DTYPE)
            scale = torch.empty(rows, -(-k // g), device="cuda", dtype=torch.float32)
            tiled, two = [], []
            for _ in range(args.reps):
                tiled.append(graph_time(lambda: qk.quantize_tiled(x, g, xq, scale)))
                two.append(graph_time(lambda: qk.quantize_two_pass(x, g, xq, scale)))
            ratios = [b / a for a, b in zip(tiled, two)]
            t, p = statistics.median(tiled), statistics.median(two)
            moved = x.numel() * 3 + scale.numel() * 4
            print(f"{what:<28} {rows:>6} {t * 1e6:>9.1f} {p * 1e6:>12.1f} {p / t:>5.2f}x "
                  f"{max(ratios) - min(ratios):>6.2f}x {moved / t / 1e12:>10.2f}")


def triton_p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
