"""The greedy token, the finite-logits check and the top-p cut on a CPU: torch's ops the sampler used against the
ones it uses.

python benchmarks/bench_greedy_cpu.py [--rows 256] [--vocab 32000 151936] [--reps 5] [--threads 1]

For each logits shape and dtype (fp32, bf16): torch.argmax(x, -1) against runner.row_ops.row_argmax (the
row max's index), and torch.isfinite(x).all(-1) against runner.row_ops.finite_rows (the row max and min);
for fp32, top-p 0.9 (top-k off) thresholds by the whole sort (_sorted_thresholds) against filter_thresholds (the
cut looked for among the 1,024 largest logits first), on peaky rows (randn x 6: the cut among the candidates) and
flat ones (randn x 1: every row sorted whole after the look). Each the median of --reps timed windows of 10 calls
(spread = (max - min) / median), and the ratio of the medians. The results must agree exactly (checked on every
shape), but for a top-p cut where the row's mass reaches top_p within fp32's rounding (printed: how many). CPU
only; the numbers are this host's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvfit.runner.row_ops import _sorted_thresholds, filter_thresholds, finite_rows, row_argmax


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


def top_p_agreement(scaled: torch.Tensor, before: torch.Tensor, after: torch.Tensor, top_p: float) -> str:
    """Rows whose top-p cut differs must differ at fp32's rounding of the mass: the mass before the first rank
    one kept and the other did not, in float64, within TOP_P_ROUNDING of top_p (both sum ~1e5 fp32 terms in
    different orders). Says how many rows differ."""
    rows = (before != after).nonzero().flatten().tolist()
    worst = 0.0
    for r in rows:
        values = torch.sort(scaled[r].double(), descending=True).values
        probs = torch.softmax(values, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        rank = int(min((values >= before[r].double()).sum(), (values >= after[r].double()).sum()))
        worst = max(worst, abs(float(mass_before[rank]) - top_p))
    if worst > TOP_P_ROUNDING:
        raise SystemExit(f"top-p cut: a row differs by more than rounding (mass {worst:.2e} from top_p)")
    return f"  ({len(rows)} of {len(before)} cuts differ, at masses within {worst:.1e} of top_p)" if rows else ""


TOP_P_ROUNDING = 1e-4


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
            cases = dict(pairs)
            if dtype == torch.float32:
                top_k = torch.zeros(args.rows, dtype=torch.int32)
                top_p = torch.full((args.rows,), 0.9)
                for label, scale in (("top-p cut, peaky", 6.0), ("top-p cut, flat", 1.0)):
                    cases[label] = (lambda x, s=scale: _sorted_thresholds(x * s, top_k, top_p, True, x.shape[-1]),
                                    lambda x, s=scale: filter_thresholds(x * s, top_k, top_p, True))
            for name, (before, after) in cases.items():
                note = ""
                if name.startswith("top-p"):
                    note = top_p_agreement(x * (6.0 if "peaky" in name else 1.0), before(x), after(x), 0.9)
                elif not torch.equal(before(x), after(x)):
                    raise SystemExit(f"{name}: the two disagree at [{args.rows}, {vocab}] {dtype}")
                (b, bs), (a, as_) = timed(before, x, args.reps), timed(after, x, args.reps)
                print(f"  [{args.rows}, {vocab}] {str(dtype)[6:]:9} {name}: {b:8.2f} ms ({bs:.0%}) -> "
                      f"{a:7.2f} ms ({as_:.0%}): {b / a:5.2f}x{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
