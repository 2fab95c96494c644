"""The engine before a change against this checkout, on the GPU, in one run: no regression.

python benchmarks/bench_before_after.py --before-src .before/src --rows small,8b,latency --reps 2
(.before/src from `git archive REV src | tar -x -C .before`). Each measurement is its own process
(bench_throughput.py --skip-hf or bench_decode_latency.py with PYTHONPATH set to one side's src);
the sides alternate, after a first warm-up process that is not counted (the first process on a fresh
machine ran slower, docs/benchmarks-history.md). Prints medians, spreads and the ratio after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = {
    "small": (["bench_throughput.py", "--model", "qwen3-0.6b", "--skip-hf"], "kvfit_tok_s", "tok/s"),
    "8b": (["bench_throughput.py", "--model", "llama-3.1-8b", "--skip-hf"], "kvfit_tok_s", "tok/s"),
    "latency": (["bench_decode_latency.py", "--model", "llama-3.1-8b"], "decode_s_per_token", "s/token"),
}


def run_one(src: Path, args: list[str], timeout_s: int) -> dict | None:
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], cwd=HERE, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout_s} s", flush=True)
        return None
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  failed (rc {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}", flush=True)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before-src", required=True)
    ap.add_argument("--after-src", default=str(HERE.parent / "src"))
    ap.add_argument("--rows", default="small,8b,latency")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout-s", type=int, default=240)
    ap.add_argument("--out", default=None, help="append every result as a JSON line")
    args = ap.parse_args()
    sides = {"before": Path(args.before_src).resolve(), "after": Path(args.after_src).resolve()}
    rows = args.rows.split(",")
    print("warm-up process (not counted)", flush=True)
    run_one(sides["after"], ROWS[rows[0]][0], args.timeout_s)
    results: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        cmd, key, unit = ROWS[row]
        for rep in range(args.reps):
            order = ("after", "before") if rep % 2 == 0 else ("before", "after")
            for side in order:
                res = run_one(sides[side], cmd, args.timeout_s)
                if res is None:
                    continue
                results.setdefault((row, side), []).append(res[key])
                print(f"{row:8s} {side:6s} rep {rep}: {res[key]:.6g} {unit}", flush=True)
                if args.out:
                    with open(args.out, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps({"row": row, "side": side, "rep": rep, **res}) + "\n")
    print(f"\n{'row':8s} {'before median':>14s} {'spread':>7s} {'after median':>14s} {'spread':>7s} {'after/before':>12s}")
    for row in rows:
        before, after = results.get((row, "before"), []), results.get((row, "after"), [])
        if not before or not after:
            print(f"{row:8s} missing results")
            continue
        mb, ma = statistics.median(before), statistics.median(after)
        sb, sa = (max(before) - min(before)) / mb, (max(after) - min(after)) / ma
        unit = ROWS[row][2]
        ratio = ma / mb if unit == "tok/s" else mb / ma      # > 1: after is better
        print(f"{row:8s} {mb:14.6g} {sb:7.1%} {ma:14.6g} {sa:7.1%} {ratio:11.3f}x  ({unit}; > 1 = after better)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
