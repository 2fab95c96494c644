"""Paged decode attention bandwidth against device-to-device copy bandwidth (the ratio; aim >= 0.75).

Bytes counted: K and V of every context token once (what decode must read). Copy bandwidth counts
bytes read plus bytes written of a large torch copy, measured in the same run. Times are medians of
triton.testing.do_bench (which flushes L2 between runs).

python benchmarks/bench_decode_attention.py                      # default grid, the backend's choices
python benchmarks/bench_decode_attention.py --sweep              # also try splits / tile / warps
python benchmarks/bench_decode_attention.py --batch 64 --context 32768 --block-size 16
python benchmarks/bench_decode_attention.py --batch 256 --context 2448 --shared-prefix 2000 --cascade   # shared-prefix
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}


def build_step(batch, context, page, args, gen):
    """Caches with random contents and shuffled (non-contiguous) block tables; query; metadata."""
    from kvfit.attention.base import AttentionMetadata
    blocks_per_seq = -(-context // page)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, page, args.kv_heads, args.head_dim)
    cache_dtype = DTYPES[args.kv_cache_dtype]
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[:batch * blocks_per_seq]
    table = table.view(batch, blocks_per_seq).to(torch.int32).cuda()
    shared = min(args.shared_prefix // page, blocks_per_seq)
    table[:, :shared] = table[0, :shared].clone()          # prefix-cache hits: the same physical blocks
    seq_lens = [context] * batch
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables=table,
        max_query_len=1, max_seq_len=context, query_start_loc_host=list(range(batch + 1)), seq_lens_host=seq_lens)
    query = torch.randn(batch, args.q_heads, args.head_dim, device="cuda").to(torch.bfloat16)
    return query, k_cache, v_cache, meta


def spot_check(backend, query, k_cache, v_cache, meta, scale):
    """The timed kernel's output for the first two sequences against the torch reference."""
    from kvfit.attention.base import AttentionMetadata
    from kvfit.attention.torch_ref import TorchReferenceBackend
    n = min(2, len(meta.seq_lens_host))
    sub = AttentionMetadata(meta.slot_mapping[:n], meta.query_start_loc[:n + 1], meta.seq_lens[:n],
                            meta.block_tables[:n], 1, meta.max_seq_len, list(range(n + 1)), meta.seq_lens_host[:n])
    got = backend.attend(query, k_cache, v_cache, meta, scale)[:n].float()
    expected = TorchReferenceBackend().attend(query[:n], k_cache, v_cache, sub, scale).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def sweep(query, k_cache, v_cache, meta, scale, do_bench):
    """Best (seconds, config) over split counts, K/V tile tokens and warps, calling the kernel directly, and
    the best seconds for each split count."""
    from kvfit.kernels.attention_decode import paged_decode_attention
    best = (float("inf"), None)
    by_splits: dict[int, float] = {}
    out = torch.empty_like(query)
    for splits, block_n, warps in itertools.product((1, 2, 4, 8, 16, 32), (32, 64, 128), (4, 8)):
        def run():
            paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   scale, num_splits=splits, block_n=block_n, num_warps=warps, out=out)
        try:
            t = do_bench(run, warmup=10, rep=50, return_mode="median") / 1e3
        except Exception as exc:   # a config out of shared memory or registers: skip it
            print(f"    splits={splits} block_n={block_n} warps={warps}: {type(exc).__name__}")
            continue
        best = min(best, (t, f"splits={splits} block_n={block_n} warps={warps}"), key=lambda x: x[0])
        by_splits[splits] = min(by_splits.get(splits, t), t)
    return (*best, by_splits)


def cascade(query, k_cache, v_cache, meta, scale, prefix_tokens, do_bench) -> tuple[float, str]:
    """Best (seconds, config) of cascade decode (the shared prefix attended once for all sequences) over
    prefix and suffix split counts; its output checked against the plain kernel's."""
    from kvfit.kernels.attention_decode import paged_decode_attention
    prefix_len = torch.tensor([prefix_tokens], dtype=torch.int32, device=query.device)
    args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    plain = paged_decode_attention(*args, num_splits=1)
    best = (float("inf"), None)
    for prefix_splits, splits in itertools.product((2, 4, 8, 16), (1, 2)):
        got = paged_decode_attention(*args, num_splits=splits, prefix_len=prefix_len, prefix_splits=prefix_splits)
        torch.testing.assert_close(got.float(), plain.float(), atol=2e-2, rtol=2e-2)
        t = do_bench(lambda: paged_decode_attention(*args, num_splits=splits, prefix_len=prefix_len,
                                                    prefix_splits=prefix_splits), warmup=10, rep=50,
                     return_mode="median") / 1e3
        best = min(best, (t, f"prefix_splits={prefix_splits} splits={splits}"), key=lambda x: x[0])
    return best


def measure(backend, batch, context, page, args, gen, copy_bps) -> tuple[float, str]:
    """One shape: the backend's own launch (and, with --sweep, the best swept config); ratio and table row."""
    import triton.testing
    from kvfit.kernels.attention_decode import decode_read_bytes
    query, k_cache, v_cache, meta = build_step(batch, context, page, args, gen)
    scale = args.head_dim ** -0.5
    spot_check(backend, query, k_cache, v_cache, meta, scale)
    splits = backend.decode_num_splits(meta, query, args.kv_heads)
    t = triton.testing.do_bench(lambda: backend.attend(query, k_cache, v_cache, meta, scale),
                                warmup=25, rep=100, return_mode="median") / 1e3
    read_bytes = decode_read_bytes(meta.seq_lens_host, args.kv_heads, args.head_dim, k_cache.dtype)
    ratio = read_bytes / t / copy_bps
    line = f"{batch:>5} {context:>7} {page:>4} {splits:>6} {t * 1e6:>9.1f} {read_bytes / t / 1e9:>7.0f} {ratio:>6.2f}"
    if args.sweep:
        best_t, config, by_splits = sweep(query, k_cache, v_cache, meta, scale, triton.testing.do_bench)
        line += f"   {config} ({read_bytes / best_t / copy_bps:.2f}); best by splits " + " ".join(
            f"{n}:{read_bytes / t / copy_bps:.2f}" for n, t in sorted(by_splits.items()))
    if args.cascade and args.shared_prefix >= page:
        prefix_tokens = min(args.shared_prefix // page * page, (context - 1) // page * page)
        # the backend's cascade with its own split counts (what the engine runs where its rule takes the prefix)
        cmeta = dataclasses.replace(meta, prefix_len=torch.tensor([prefix_tokens], dtype=torch.int32, device="cuda"))
        own = triton.testing.do_bench(lambda: backend.attend(query, k_cache, v_cache, cmeta, scale),
                                      warmup=25, rep=100, return_mode="median") / 1e3
        rule = "taken" if backend.cascade_tokens(prefix_tokens, batch) else "not taken"
        line += f"   cascade: {own * 1e6:.1f} us ({t / own:.2f}x; rule: {rule})"
        if args.graphs:     # both in CUDA graphs, L2 flushed before each call: what the engine's decode sees
            from common import graph_time
            plain_g = graph_time(lambda: backend.attend(query, k_cache, v_cache, meta, scale))
            own_g = graph_time(lambda: backend.attend(query, k_cache, v_cache, cmeta, scale))
            line += f"   graphs: {plain_g * 1e6:.1f} vs {own_g * 1e6:.1f} us ({plain_g / own_g:.2f}x)"
        if not args.no_search:
            best_t, config = cascade(query, k_cache, v_cache, meta, scale, prefix_tokens, triton.testing.do_bench)
            line += f"   best {config}: {best_t * 1e6:.1f} us ({read_bytes / best_t / copy_bps:.2f}, {t / best_t:.2f}x)"
    return ratio, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--block-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--sweep", action="store_true", help="also search splits, tile size and warps per shape")
    ap.add_argument("--cascade", action="store_true",
                    help="with --shared-prefix: also time cascade decode (the prefix attended once for all sequences)")
    ap.add_argument("--no-search", action="store_true", help="with --cascade: time only the engine's choice")
    ap.add_argument("--graphs", action="store_true",
                    help="with --cascade: also time plain and cascade replayed in CUDA graphs (no launch cost)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens at the start of every context in the same blocks (a cached system prompt); bytes "
                         "are still counted once per sequence, so a ratio above the unshared one is L2 reuse")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_attention: no CUDA device; this benchmark runs on a GPU only")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import copy_bandwidth
    from kvfit.attention.triton_backend import TritonBackend

    copy_bps = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth (read + write): {copy_bps / 1e9:.0f} GB/s")
    print(f"heads {args.q_heads}/{args.kv_heads}, head_dim {args.head_dim}, cache {args.kv_cache_dtype}, query bf16, "
          f"shared prefix {args.shared_prefix} tokens")
    header = f"{'batch':>5} {'context':>7} {'page':>4} {'splits':>6} {'us':>9} {'GB/s':>7} {'ratio':>6}"
    print(header + ("   best swept config (ratio)" if args.sweep else ""))
    backend, gen, ratios = TritonBackend(), torch.Generator().manual_seed(0), []
    for batch, context, page in itertools.product(args.batch, args.context, args.block_size):
        ratio, line = measure(backend, batch, context, page, args, gen, copy_bps)
        ratios.append(ratio)
        print(line, flush=True)
        torch.cuda.empty_cache()
    print(f"ratio to copy bandwidth: min {min(ratios):.2f}, median {statistics.median(ratios):.2f} (aim >= 0.75)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
