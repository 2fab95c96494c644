"""Why an fp8 KV cache's decode attention reads at half the bandwidth a bf16 cache's does: the decode kernel over
an fp8 cache timed per tile size, warps and pipeline stages, with its dots in bf16 ("query"), fp16 (e4m3 converts
to fp16 in one instruction, to bf16 through fp16), fp8 (no conversion; the query rows and the probabilities
quantized to e4m3, FlashAttention-3's scheme) and "pairs" (fp16 dots over K/V read as 16-bit words of two e4m3,
so V's transposed operand loads by ldmatrix, not a byte a load), each with its largest difference from the torch reference,
against the bf16 cache's own launch. --write FILE
saves the config with the lowest total time over the shapes (attention_decode.FP8_DECODE_CONFIG's form, JSON),
for KVFIT_BENCH_FP8_DECODE. The fastest is not always the one to take: fp8 dots trade accuracy (see max diff).

python benchmarks/probe_fp8_decode.py --batch 256 64 --context 647 2048 --write /root/fp8_decode.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def main() -> int:
    import triton.testing
    from bench_decode_attention import build_step
    from common import copy_bandwidth

    from kvfit.attention.torch_ref import TorchReferenceBackend
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.kernels import attention_decode
    from kvfit.kernels.attention_decode import decode_read_bytes, paged_decode_attention
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[647, 2048])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--write", default=None, help="save the best config here (JSON)")
    ap.add_argument("--dots", default="fp16,pairs",
                    help="the dots swept (of attention_decode.DOTS; fp8 dots compile to fp16 mma on sm_90 at 16 rows)")
    ap.add_argument("--stages", default="None,2,3", help="pipeline stages swept (None: Triton's default)")
    ap.add_argument("--write-dots", default="query,fp16,pairs",
                    help="the dots --write may pick (fp8 dots are less exact: add fp8 to allow them)")
    args = ap.parse_args()
    totals: dict[tuple, float] = {}
    args.shared_prefix = 0
    backend = TritonBackend()
    copy_bps = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bps / 1e9:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    for batch, context in itertools.product(args.batch, args.context):
        scale = args.head_dim ** -0.5
        rows = []
        for cache in ("bfloat16", "fp8_e4m3"):
            args.kv_cache_dtype = cache
            query, k_cache, v_cache, meta = build_step(batch, context, 16, args, gen)
            read = decode_read_bytes(meta.seq_lens_host, args.kv_heads, args.head_dim, k_cache.dtype)
            splits = backend.decode_num_splits(meta, query, args.kv_heads)
            t = triton.testing.do_bench(lambda: backend.attend(query, k_cache, v_cache, meta, scale),
                                        warmup=25, rep=100, return_mode="median") / 1e3
            rows.append((t, f"{cache} cache, the backend's launch (splits {splits})", read))
            if cache == "bfloat16":
                continue
            want = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale).float()
            stage_list = [None if x == "None" else int(x) for x in args.stages.split(",")]
            for dots, block_n, warps, stages in itertools.product(args.dots.split(","), (64, 128), (4, 8),
                                                                  stage_list):
                def run():
                    return paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                  meta.query_start_loc, scale, splits, block_n=block_n,
                                                  num_warps=warps, num_stages=stages, dots=dots)
                try:
                    err = (run().float() - want).abs().max().item()
                    t = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") / 1e3
                except Exception as exc:     # a config that does not compile (shared memory) is reported
                    print(f"  dots {dots} block_n={block_n} warps={warps} stages={stages}: {type(exc).__name__}")
                    totals[(block_n, warps, stages, dots)] = float("inf")
                    continue
                key = (block_n, warps, stages, dots)
                totals[key] = totals.get(key, 0.0) + t
                rows.append((t, f"fp8 cache, block_n={block_n} warps={warps} stages={stages} dots {dots} "
                                f"(max diff {err:.1e})", read))
        print(f"== batch {batch}, context {context}")
        for t, what, read in sorted(rows)[:12] + [r for r in rows if "backend" in r[1]]:
            print(f"  {t * 1e6:8.1f} us  {read / t / copy_bps:5.2f} of copy  {what}")
    allowed = args.write_dots.split(",")
    best = min((key for key in totals if key[3] in allowed), key=totals.get)
    fastest = min(totals, key=totals.get)
    print(f"fastest of all: {fastest} ({totals[fastest] * 1e6:.1f} us in all)")
    default = attention_decode.FP8_DECODE_CONFIG
    print(f"best over the shapes with dots in {allowed}: {best} ({totals[best] * 1e6:.1f} us in all; "
          f"the current default {default}: "
          f"{totals.get(default, float('nan')) * 1e6:.1f} us)")
    if args.write:
        with open(args.write, "w") as fh:
            json.dump(list(best), fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
