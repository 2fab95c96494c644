"""Block-wise FP8 linears ([128, 128] weight scales, per-token-group activations): kvfit's Triton GEMM
(kernels/fp8_block_gemm.py) in each candidate config, against bf16 cuBLAS on the same shape, cuBLASLt's
blockwise-scaled FP8 _scaled_mm, and vLLM's w8a8_block_fp8_matmul where vLLM is importable; the activation
quantize kernel timed apart.

python benchmarks/bench_fp8_block_gemm.py [--model qwen3-30b-a3b] [--m 1 16 64 256 1024 4096 8192]
Shapes: the model's dense linears (q/k/v, o; gate/up and down for a dense MLP). Times are medians of CUDA
graph replays (common.graph_time: L2 flushed before each), in microseconds; the best config per (shape, M)
and the one config_for(M) picks are marked, and the step's dense linears are summed for each.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from common import gpu_only, graph_time

# (BLOCK_M, BLOCK_N, warps, stages[, SPLIT_K]): BLOCK_K is the weight block's columns. The split-K ones are for few
# rows: qkv and o of qwen3-30b-a3b at M=64 make 40 and 16 tiles of 128 columns for 132 SMs (0.6 TB/s of weights
# in a decode step, H100, 2026-12-07)
CANDIDATES = [(16, 64, 4, 4), (16, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3),
              (64, 128, 4, 4), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 256, 8, 3),
              (64, 256, 8, 3), (16, 64, 4, 4, 2), (16, 64, 4, 4, 4), (16, 128, 4, 4, 4), (16, 128, 4, 4, 8),
              (32, 64, 4, 4, 4), (64, 64, 4, 4, 2), (64, 64, 4, 4, 4), (64, 128, 4, 4, 4)]


def dense_shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, per layer) for the model's dense linears (MoE experts are bench_fused_moe.py's)."""
    from kvfit.errors import ConfigError
    from kvfit.model_facts import load_model_facts, moe_config
    f = load_model_facts(model)
    try:
        sparse = len(moe_config(f).sparse_layers)
    except ConfigError:                  # a dense model
        sparse = 0
    h, d = f.hidden_size, f.head_dim
    out = {"qkv": ((f.num_attention_heads + 2 * f.num_kv_heads) * d, h, f.num_layers),
           "o_proj": (h, f.num_attention_heads * d, f.num_layers)}
    dense_layers = f.num_layers - sparse
    if dense_layers:
        out["gate_up"] = (2 * f.intermediate_size, h, dense_layers)
        out["down"] = (h, f.intermediate_size, dense_layers)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096, 8192])
    args = ap.parse_args()
    if not gpu_only("bench_fp8_block_gemm"):
        return 0
    from kvfit.kernels import fp8_block_gemm as bg
    from kvfit.kernels.fp8 import Fp8Weight, quantize_weight_blocks
    from kvfit.kernels.fp8_quantize import quantize_rows
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import w8a8_block_fp8_matmul
    except Exception as exc:             # vLLM not staged, or its layout moved
        w8a8_block_fp8_matmul = None
        print(f"vLLM's w8a8_block_fp8_matmul not importable ({type(exc).__name__}): kvfit and cuBLAS bf16 only")
    torch.manual_seed(0)
    block = (128, 128)
    totals: dict[str, float] = {}
    for (name, (n, k, per_layer)), m in itertools.product(dense_shapes(args.model).items(), args.m):
        w16 = torch.randn(n, k, device="cuda", dtype=torch.float32) * 0.02
        wq, ws = quantize_weight_blocks(w16, block)
        w = Fp8Weight(wq, ws, block)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_rows(x, block[1])
        ref = (x.float() @ w16.t())
        w_bf16 = w16.to(torch.bfloat16)
        row = {"cublas bf16": graph_time(lambda: torch.nn.functional.linear(x, w_bf16)),
               "quantize": graph_time(lambda: quantize_rows(x, block[1]))}
        picked = bg.config_for(m, n, -(-k // block[1]))
        for config in CANDIDATES:
            try:
                y = bg.block_fp8_gemm(xq, xs, w, None, torch.bfloat16, config)
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                if err > 0.1:
                    raise RuntimeError(f"relative error {err:.3f}")
                row[str(config)] = graph_time(lambda c=config: bg.block_fp8_gemm(xq, xs, w, None, torch.bfloat16, c))
            except Exception as exc:     # a config that does not compile or fit (shared memory) is skipped
                print(f"  {name} M={m} {config}: skipped ({type(exc).__name__}: {str(exc)[:80]})")
        try:        # cuBLASLt's blockwise-scaled FP8 GEMM (what fp8_linear runs from BLOCK_SCALED_MM_MIN_ROWS rows)
            xs_cols = xs.t().contiguous().t()
            y = torch._scaled_mm(xq, wq.t(), scale_a=xs_cols, scale_b=ws.t(), out_dtype=torch.bfloat16)
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            if err > 0.1:
                raise RuntimeError(f"relative error {err:.3f}")
            row["cublas fp8"] = graph_time(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs_cols, scale_b=ws.t(),
                                                                    out_dtype=torch.bfloat16))
        except Exception as exc:
            print(f"  cuBLAS blockwise {name} M={m}: {type(exc).__name__}: {str(exc)[:120]}")
        if w8a8_block_fp8_matmul is not None:
            try:
                row["vllm"] = graph_time(lambda: w8a8_block_fp8_matmul(xq, wq, xs, ws, list(block), torch.bfloat16))
            except Exception as exc:
                print(f"  vllm {name} M={m}: {type(exc).__name__}: {str(exc)[:120]}")
        kvfit_rows = {c: t for c, t in row.items() if c.startswith("(")}
        best = min(kvfit_rows, key=kvfit_rows.get)
        now = kvfit_rows.get(str(picked), float("nan"))
        line = (f"{name:8s} N={n:5d} K={k:5d} M={m:5d}: quantize {row['quantize'] * 1e6:7.1f} us, "
                f"picked {picked} {now * 1e6:7.1f} us, best {best} {kvfit_rows[best] * 1e6:7.1f} us, "
                f"cuBLAS bf16 {row['cublas bf16'] * 1e6:7.1f} us")
        if "cublas fp8" in row:
            line += f", cuBLAS fp8 blockwise {row['cublas fp8'] * 1e6:7.1f} us"
        if "vllm" in row:
            line += f", vLLM {row['vllm'] * 1e6:7.1f} us (vLLM/kvfit-picked {row['vllm'] / now:.2f}x)"
        print(line, flush=True)
        for key, t in (("picked", now), ("best", kvfit_rows[best]), ("bf16", row["cublas bf16"]),
                       ("quantize", row["quantize"]), ("vllm", row.get("vllm", float("nan"))),
                       ("cublas fp8", row.get("cublas fp8", float("nan")))):
            totals[f"M={m} {key}"] = totals.get(f"M={m} {key}", 0.0) + t * per_layer
    print("the step's dense linears (all layers), ms: picked config + quantize / best + quantize / bf16 / vLLM / "
          "cuBLAS fp8 blockwise + quantize")
    for m in args.m:
        t = {key: totals[f"M={m} {key}"] * 1e3 for key in ("picked", "best", "bf16", "quantize", "vllm", "cublas fp8")}
        print(f"  M={m:5d}: {t['picked'] + t['quantize']:7.3f} / {t['best'] + t['quantize']:7.3f} / "
              f"{t['bf16']:7.3f} / {t['vllm'] + t['quantize']:7.3f} / {t['cublas fp8'] + t['quantize']:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
