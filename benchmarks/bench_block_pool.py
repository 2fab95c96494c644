"""BlockPool cost does not grow with the pool: allocate + free of 1,000 blocks at 10^4, 10^6, 10^7 blocks.

python benchmarks/bench_block_pool.py [--reps 1000] [--sizes 10000 1000000 10000000]

Two patterns, each timed as one repetition = 1,000 blocks out and back:
  single: allocate(1) x 1000, then free([b]) x 1000 (per-call overhead, a decode step's pattern)
  batch:  allocate(1000), then free(table)          (a long prompt's pattern)
Two pool states:
  fresh:  a new pool per repetition, so blocks come from the never-used counter
  warm:   the whole pool was allocated and freed once, so the free list holds every block
Prints the median of --reps repetitions (time.perf_counter), the ratio of the largest pool to the
smallest (aim <= 1.2x), and the median construction time of the largest pool (aim well under 1 s).
Pure Python, no device: the numbers are the CPU's this runs on.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time

from kvfit.kv.pool import BlockPool

NUM_BLOCKS_PER_REP = 1000


def rep_single(pool: BlockPool) -> float:
    start = time.perf_counter()
    got = [pool.allocate(1)[0] for _ in range(NUM_BLOCKS_PER_REP)]
    for block in got:
        pool.free([block])
    return time.perf_counter() - start


def rep_batch(pool: BlockPool) -> float:
    start = time.perf_counter()
    table = pool.allocate(NUM_BLOCKS_PER_REP)
    pool.free(table)
    return time.perf_counter() - start


PATTERNS = {"single": rep_single, "batch": rep_batch}


def warm_pool(num_blocks: int) -> tuple[BlockPool, float]:
    """A pool whose every block was handed out and returned once (the free list holds all of them)."""
    pool = BlockPool(num_blocks)
    start = time.perf_counter()
    pool.free(pool.allocate(num_blocks))
    seconds = time.perf_counter() - start
    assert pool.num_free_blocks == num_blocks and len(pool._free) == num_blocks
    return pool, seconds


def construction_seconds(num_blocks: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        BlockPool(num_blocks, enable_prefix_caching=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**6, 10**7])
    args = ap.parse_args()
    sizes = sorted(args.sizes)
    gc.disable()    # a collection landing in one repetition says nothing about the pool
    print(f"bench_block_pool: python {platform.python_version()} on {platform.processor() or platform.machine()}, "
          f"{args.reps} repetitions of {NUM_BLOCKS_PER_REP} blocks, median")
    warm_seconds: dict[int, float] = {}
    warm: dict[int, BlockPool] = {}
    for n in sizes:
        warm[n], warm_seconds[n] = warm_pool(n)
    # Round-robin over every (size, state, pattern) in each repetition, so drift in the machine's
    # speed (a shared VM, frequency changes) lands on every column alike instead of on one size.
    times: dict[tuple[str, str, int], list[float]] = {}
    for rep in range(args.reps + 1):               # repetition 0 is a warm-up, not recorded
        for n in sizes:
            for name, pattern in PATTERNS.items():
                for state in ("fresh", "warm"):
                    pool = BlockPool(n) if state == "fresh" else warm[n]
                    seconds = pattern(pool)
                    assert pool.num_used_blocks == 0
                    if rep:
                        times.setdefault((state, name, n), []).append(seconds)
    for n in sizes:
        assert len(warm[n]._free) == n      # still warm: the free list holds every block
    results = {key: statistics.median(ts) * 1e6 for key, ts in times.items()}
    header = f"{'state':<6} {'pattern':<7} " + " ".join(f"{n:>14,}" for n in sizes) + \
        f" {'ratio ' + f'{sizes[-1]:.0e}/{sizes[0]:.0e}':>16}"
    print()
    print("us per 1,000 blocks (allocate + free); columns: pool size in blocks")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for state in ("fresh", "warm"):
        for name in PATTERNS:
            row = [results[(state, name, n)] for n in sizes]
            ratio = row[-1] / row[0]
            worst = max(worst, ratio)
            print(f"{state:<6} {name:<7} " + " ".join(f"{t:>14.1f}" for t in row) + f" {ratio:>15.2f}x")
    print()
    for n in sizes:
        print(f"warming a {n:,}-block pool (allocate all, free all once): {warm_seconds[n]:.2f} s")
    build = construction_seconds(sizes[-1], reps=max(args.reps, 100))
    print(f"construction of a {sizes[-1]:,}-block pool: {build * 1e6:.1f} us median")
    print()
    print(f"ratio {sizes[-1]:.0e}/{sizes[0]:.0e} (worst row): {worst:.2f}x (aim <= 1.2x); "
          f"construction {build * 1e6:.1f} us (aim well under 1 s)")
    return 0 if worst <= 1.2 and build < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
