"""The greedy token and the finite-logits check on a CPU: torch's ops the sampler used against the ones it uses.

python benchmarks/bench_greedy_cpu.py [--rows 256] [--vocab 32000 151936] [--reps 5] [--threads 1]

For each logits shape and dtype (fp32, bf16): torch.argmax(x, -1) against runner.sampling_state.row_argmax (the
row max's index), and torch.isfinite(x).all(-1) against runner.sampling_state.finite_rows (the row max and min),
each the median of --reps timed windows of 10 calls (spread = (max - min) / median), and the ratio of the medians.
The results must agree exactly (checked on every shape). CPU only; the numbers are this host's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvfit.runner.sampling_state import finite_rows, row_argmax


def window_ms(fn, x, calls: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e3


def timed(fn, x, reps: int) -> tuple[float, float]:
    fn(x)
    runs = [window_ms(fn, x) for _ in range(reps)]
    med = statistics.median(runs)
    return med, (max(runs) - min(runs)) / med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bench_greedy_cpu: python {platform.python_version()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.rows} rows, {args.reps} windows of 10 calls")
    pairs = {"greedy token": (lambda x: torch.argmax(x, dim=-1), row_argmax),
             "finite check": (lambda x: torch.isfinite(x).all(dim=-1), finite_rows)}
    for vocab in args.vocab:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
            for name, (before, after) in pairs.items():
                if not torch.equal(before(x), after(x)):
                    raise SystemExit(f"{name}: the two disagree at [{args.rows}, {vocab}] {dtype}")
                (b, bs), (a, as_) = timed(before, x, args.reps), timed(after, x, args.reps)
                print(f"  [{args.rows}, {vocab}] {str(dtype)[6:]:9} {name}: {b:8.2f} ms ({bs:.0%}) -> "
                      f"{a:7.2f} ms ({as_:.0%}): {b / a:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
