"""Batch-1 decode latency against the memory roofline (weight bytes / measured copy bandwidth).

python benchmarks/bench_decode_latency.py --model llama-3.1-8b
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import gpu_only


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-scheduler-steps", type=int, default=None, help="default: the engine's")
    args = ap.parse_args()
    if not gpu_only("bench_decode_latency"):
        return 0
    from common import copy_bandwidth
    from kvfit import LLM, SamplingParams
    bandwidth = copy_bandwidth()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=4096,
              max_num_seqs=8, enable_prefix_caching=False, num_scheduler_steps=args.num_scheduler_steps)
    weight_bytes = llm.engine.readings[0].weights_bytes
    prompt = [100 + i % 1000 for i in range(args.prompt_len)]

    def timed(n):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], p, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(8)
    # two lengths: the difference leaves out prefill and start-up, leaving decode steps only
    short, long = timed(16), timed(16 + args.output_len)
    per_token = (long - short) / args.output_len
    roofline = weight_bytes / bandwidth
    row = {"model": args.model, "num_scheduler_steps": llm.engine.num_scheduler_steps, "weight_bytes": weight_bytes, "copy_bandwidth_Bps": bandwidth,
           "decode_s_per_token": per_token, "tok_s": 1 / per_token, "roofline_s_per_token": roofline,
           "fraction_of_roofline": roofline / per_token}
    print(f"batch-1 decode: {per_token * 1e3:.2f} ms/token ({1 / per_token:.1f} tok/s); roofline "
          f"{roofline * 1e3:.2f} ms (weights {weight_bytes / 2**30:.2f} GiB at {bandwidth / 1e12:.2f} TB/s); "
          f"fraction of roofline {roofline / per_token:.2f}")
    print("RESULT " + json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
