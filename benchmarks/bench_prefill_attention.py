"""Paged prefill attention against torch's SDPA (flash) on the same causal prompts, and a tile sweep.

Long prompts are where prefill attention dominates (the long-context row of bench_vs_vllm.py: 32 prompts
of 8,000 tokens). Each case is one step as the engine runs it: the query tokens of one or more sequences
over their paged context (page 16, shuffled block tables, the keys already written). The limit measured
in the same run is torch.nn.functional.scaled_dot_product_attention with the flash backend (FlashAttention-2)
on contiguous [B, H, S, D] tensors of a fresh prompt (no paging; GQA by repeating K/V heads, not timed); its
cuDNN backend is timed beside it where this torch build has it (on Hopper the cuDNN kernels are the nearest
thing to FA3 in torch: a candidate for fresh prompts, whose K/V are contiguous in the step's projections).

FLOPs counted: 4 * D * (visible keys) per query head and query token (QK^T and PV), causal.
Times are medians of triton.testing.do_bench, three repetitions (median and spread reported).

python benchmarks/bench_prefill_attention.py                   # the backend's choice per case
python benchmarks/bench_prefill_attention.py --sweep [--out x.json]  # also the candidate tile configs
python benchmarks/bench_prefill_attention.py --q-heads 32 --kv-heads 8
python benchmarks/bench_prefill_attention.py --q-heads 32 --kv-cache-dtype fp8_e4m3   # an fp8 cache: each dots,
    and the same case over a bf16 cache (the limit an fp8 cache's prefill should reach)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

# (BLOCK_M, BLOCK_N, num_warps, num_stages): candidates that compile for sm_90 without spills (16-bit)
CANDIDATES = [(64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2),
              (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]
# (name, [(new tokens, prefix tokens) per sequence])
CASES = [("one fresh 8000-token prompt", [(8000, 0)]),
         ("two 4096-token chunks over 3904 cached", [(4096, 3904), (4096, 3904)]),
         ("eight fresh 1024-token prompts", [(1024, 0)] * 8),
         # a mixed step of the shared-prefix row: 25 prompts' own 128-512 tokens over a cached 2,000-token prefix
         ("25 prompts of 128-512 new tokens over 2000 cached", [(128 + i * 97 % 385, 2000) for i in range(25)])]


def build_case(seqs, args, gen):
    """Query, paged caches holding every sequence's keys, and the step's metadata tensors."""
    page = args.page
    blocks = [-(-(q + p) // page) for q, p in seqs]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, page, args.kv_heads, args.head_dim)
    cache_dtype = getattr(torch, args.kv_cache_dtype.replace("fp8_e4m3", "float8_e4m3fn"))
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    q_lens = [q for q, _ in seqs]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], args.q_heads, args.head_dim, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor([q + p for q, p in seqs], dtype=torch.int32, device="cuda")
    starts = torch.tensor(starts, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, table.cuda(), seq_lens, starts, max(q_lens)


def flops(seqs, args) -> float:
    """4 * D * visible keys, summed over query tokens and query heads."""
    total = sum(sum(p + j + 1 for j in range(q)) for q, p in seqs)
    return 4.0 * args.head_dim * args.q_heads * total


def time_fn(fn, do_bench, reps=3) -> tuple[float, float]:
    """Median seconds over `reps` do_bench medians, and the spread (max - min) / median."""
    values = [do_bench(fn, warmup=25, rep=100) / 1e3 for _ in range(reps)]
    med = statistics.median(values)
    return med, (max(values) - min(values)) / med


def sdpa_reference(seqs, args, do_bench, backend: str = "FLASH_ATTENTION"):
    """Seconds of torch SDPA (the named backend, causal) on the fresh prompts of a case, or None (a case
    with cached tokens, or a backend this build or device does not run)."""
    if any(p for _, p in seqs):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q_len, batch = seqs[0][0], len(seqs)
    q = torch.randn(batch, args.q_heads, q_len, args.head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, args.q_heads, q_len, args.head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    chosen = getattr(SDPBackend, backend, None)
    if chosen is None:
        return None
    with sdpa_kernel(chosen):
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        try:
            fn()
        except RuntimeError as exc:        # "No available kernel": not in this build / for these shapes
            print(f"  torch SDPA {backend}: not run ({str(exc).splitlines()[0]})", flush=True)
            return None
        return time_fn(fn, do_bench)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--sweep", action="store_true", help="also time CANDIDATES and the unsplit default")
    ap.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3"],
                    help="fp8_e4m3: time each of an fp8 cache's dots (FP8_PREFILL_DOTS's choices) and the bf16 cache")
    ap.add_argument("--out", default=None, help="JSON rows (and the best config) to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefill_attention needs a CUDA device", file=sys.stderr)
        return 2
    import triton.testing
    from kvfit.kernels.attention_prefill import PREFILL_CONFIG, paged_prefill_attention
    do_bench = triton.testing.do_bench
    gen = torch.Generator().manual_seed(0)
    scale = args.head_dim ** -0.5
    configs = [("default", {})]
    if args.kv_cache_dtype == "fp8_e4m3":
        configs += [("fp8 dots=query", {"dots": "query"}), ("fp8 dots=pairs", {"dots": "pairs"}),
                    ("bf16 cache (limit)", {"bf16_cache": True})]
    if args.sweep:
        configs.append(("default, unsplit", {"split": False}))
        configs += [(f"m{m} n{n} w{w} s{s}", dict(block_m=m, block_n=n, num_warps=w, num_stages=s))
                    for m, n, w, s in CANDIDATES]
    from kvfit.kernels.attention_prefill import FP8_PREFILL_DOTS
    print(f"heads {args.q_heads}/{args.kv_heads} x {args.head_dim}, page {args.page}, cache {args.kv_cache_dtype}, "
          f"PREFILL_CONFIG {PREFILL_CONFIG}, FP8_PREFILL_DOTS {FP8_PREFILL_DOTS}", flush=True)
    rows, totals, limits = [], {}, {}
    configs_kwargs = dict(configs)
    for case, seqs in CASES:
        query, k_cache, v_cache, table, seq_lens, starts, max_q = build_case(seqs, args, gen)
        work = flops(seqs, args)
        ref = sdpa_reference(seqs, args, do_bench)
        if ref is not None:
            print(f"{case}: torch SDPA flash {ref[0] * 1e3:.3f} ms ({work / ref[0] / 1e12:.0f} TFLOP/s, "
                  f"spread {ref[1]:.1%})", flush=True)
        cudnn = sdpa_reference(seqs, args, do_bench, "CUDNN_ATTENTION")
        if cudnn is not None:
            print(f"{case}: torch SDPA cuDNN {cudnn[0] * 1e3:.3f} ms ({work / cudnn[0] / 1e12:.0f} TFLOP/s, "
                  f"spread {cudnn[1]:.1%})", flush=True)
        expected = None
        for name, kwargs in configs:
            kwargs = dict(kwargs)
            caches = (k_cache, v_cache)
            if kwargs.pop("bf16_cache", False):      # the same keys in bf16: the bytes an fp8 cache halves
                caches = (k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16))

            def run(kwargs=kwargs, caches=caches):
                return paged_prefill_attention(query, *caches, table, seq_lens, starts, max_q, scale, **kwargs)
            got = run().float()
            if expected is None:
                expected = got
            err = (got - expected).abs().max().item()
            seconds, spread = time_fn(run, do_bench)
            ratio = f", {ref[0] / seconds:.2f}x SDPA" if ref is not None else ""
            print(f"  {case} | {name}: {seconds * 1e3:.3f} ms ({work / seconds / 1e12:.0f} TFLOP/s, spread "
                  f"{spread:.1%}{ratio}), max |diff| vs default {err:.2e}", flush=True)
            rows.append(dict(case=case, config=name, kwargs=kwargs, seconds=seconds, spread=spread,
                             tflops=work / seconds / 1e12, sdpa_seconds=ref[0] if ref else None,
                             sdpa_cudnn_seconds=cudnn[0] if cudnn else None, max_diff=err))
            if "bf16_cache" in configs_kwargs[name]:
                limits[name] = limits.get(name, 0.0) + seconds      # a reference, never the config to take
            elif err < 3e-2:
                totals[name] = totals.get(name, 0.0) + seconds
            else:
                totals[name] = float("inf")          # a config whose output differs never wins
    best = min(totals, key=totals.get)
    print("summed over the cases: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in sorted(totals.items(),
                                                                                          key=lambda x: x[1])))
    print(f"best: {best}" + "".join(f"; {n}: {t * 1e3:.2f} ms" for n, t in limits.items()))
    if args.out:
        chosen = next(kw for n, kw in configs if n == best)
        with open(args.out, "w") as fh:
            json.dump(dict(rows=rows, totals=totals, best=best, best_kwargs=chosen,
                           heads=[args.q_heads, args.kv_heads]), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
