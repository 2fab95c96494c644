"""Does this torch's torch._scaled_mm take block scales (1 x 128 activation groups, [128, 128] weight blocks) on
this GPU, with which scale layouts, how close to the dequantized product, and how fast against bf16 cuBLAS?

python3 benchmarks/probe_scaled_mm_blockwise.py
Shapes: qwen3-30b-a3b's qkv (N=5120, K=2048) and o_proj (N=2048, K=4096) at 8,192 and 64 rows. Times: the mean
of 20 eager calls after one warm-up (launch cost included), microseconds. This is the probe that chose
fp8_gemm's blockwise path (kernels/fp8_gemm.py); bench_fp8_block_gemm.py times it under CUDA graphs.
"""

from __future__ import annotations

import time

import torch
from common import gpu_only


def mean_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    if not gpu_only("probe_scaled_mm_blockwise"):
        return
    print(torch.__version__, torch.cuda.get_device_name())
    fp8 = torch.float8_e4m3fn
    for m, n, k in [(8192, 5120, 2048), (8192, 2048, 4096), (64, 5120, 2048)]:
        a = torch.randn(m, k, device="cuda").to(fp8)
        b = torch.randn(n, k, device="cuda").to(fp8)
        sa = torch.rand(m, k // 128, device="cuda") + 0.5          # [M, K/128]
        sb = torch.rand(n // 128, k // 128, device="cuda") + 0.5   # [N/128, K/128], the checkpoint's layout
        a16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = mean_us(lambda: a16 @ b16.t())
        ref = (a.float() * sa.repeat_interleave(128, 1)) @ (b.float() * sb.repeat_interleave(128, 0)
                                                             .repeat_interleave(128, 1)).t()
        for name, scales in [("scale_a row-major [M, K/128]", dict(scale_a=sa, scale_b=sb.t())),
                             ("scale_a column-major [M, K/128]", dict(scale_a=sa.t().contiguous().t(), scale_b=sb.t()))]:
            try:
                y = torch._scaled_mm(a, b.t(), out_dtype=torch.bfloat16, **scales)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                us = mean_us(lambda: torch._scaled_mm(a, b.t(), out_dtype=torch.bfloat16, **scales))
                print(f"M={m} N={n} K={k} {name}: ok, relative error {err:.4f}, {us:.1f} us; bf16 {bf16_us:.1f} us")
            except Exception as exc:      # noqa: BLE001 - a refusal is the answer
                print(f"M={m} N={n} K={k} {name}: refused ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")


if __name__ == "__main__":
    main()
