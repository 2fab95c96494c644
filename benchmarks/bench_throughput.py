"""Offline throughput: kvfit against Hugging Face generate on the same GPU, in the same run.

python benchmarks/bench_throughput.py --model qwen3-0.6b --hf-batch 256
python benchmarks/bench_throughput.py --model llama-3.1-8b --hf-batch 64 --hf-requests 64
Prints output tokens/s of each and the ratio kvfit / HF.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import gpu_only


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=None, help="run HF on the first N requests only")
    ap.add_argument("--hf-static", action="store_true", help="also run HF with cache_implementation=static")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not gpu_only("bench_throughput"):
        return 0
    from common import hf_generate_throughput, hf_model, request_set
    from kvfit import LLM, SamplingParams
    from kvfit.model_facts import load_model_facts
    vocab = load_model_facts(args.model).vocab_size
    prompts, outs = request_set(args.num_requests, vocab=vocab, seed=args.seed)
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=2048,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)          # warm-up (Triton compiles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    kv_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert kv_tokens == sum(outs)
    row = {"model": args.model, "requests": args.num_requests, "kvfit_tok_s": kv_tokens / elapsed,
           "kvfit_s": elapsed, "preemptions": llm.engine.stats()["preemptions"],
           "num_blocks": llm.capacity.num_blocks}
    print(f"kvfit: {kv_tokens} output tokens in {elapsed:.1f} s = {kv_tokens / elapsed:.0f} tok/s", flush=True)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    if not args.skip_hf:
        n = args.hf_requests or args.num_requests
        model = hf_model(args.model)
        hf_generate_throughput(model, prompts[:2], [8, 8], 2)       # warm-up
        tok_s, _ = hf_generate_throughput(model, prompts[:n], outs[:n], args.hf_batch)
        row.update(hf_tok_s=tok_s, hf_batch=args.hf_batch, hf_requests=n, ratio_vs_hf=row["kvfit_tok_s"] / tok_s)
        print(f"HF generate (batch {args.hf_batch}, {n} requests): {tok_s:.0f} tok/s; "
              f"ratio kvfit/HF = {row['ratio_vs_hf']:.2f}", flush=True)
        if args.hf_static:
            tok_s, _ = hf_generate_throughput(model, prompts[:n], outs[:n], args.hf_batch, static=True)
            row.update(hf_static_tok_s=tok_s, ratio_vs_hf_static=row["kvfit_tok_s"] / tok_s)
            print(f"HF generate static cache: {tok_s:.0f} tok/s; ratio = {row['ratio_vs_hf_static']:.2f}", flush=True)
    print("RESULT " + json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
