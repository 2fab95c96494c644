"""Accuracy of an fp8 KV cache against a 16-bit one: logprob differences on a fixed prompt set (issue 28 (4)).

python benchmarks/bench_kv_fp8_accuracy.py [--model FOLDER] [--device cpu|cuda] [--dtype bfloat16] [--loud 1,2000]

For each model: the prompt logprobs of every token of 16 fixed prompts (each token scored by attention over the
cache it was just written to), with the cache in the model's dtype, then in fp8 with scale 1.0, and in fp8 with
--calculate-kv-scales; printed: the mean and largest |logprob difference| against the 16-bit cache, and how often
the most likely next token differs. Without --model it builds tiny random-weight llama folders (tests/tiny_models:
transformers' own classes, no download), one per --loud factor: keys and values multiplied by it and queries and
o_proj divided by it, the same model in exact arithmetic, but with keys and values past fp8's range (448) at 2000.
Random weights are not a trained model: the figures show what the scales do, not what a real model loses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello world! How are you today?",
           "Once upon a time there was a", "In the beginning the sky was", "She opened the door and saw",
           "The capital of France is", "Water boils at one hundred degrees", "A list of prime numbers: 2, 3, 5, 7,",
           "def add(a, b): return", "To be or not to be, that is", "The meeting is scheduled for Monday at",
           "My favourite colour is", "They walked along the river until", "One, two, three, four, five,",
           "The recipe needs flour, sugar and", "At night the city lights"]


def loud_folder(root: str, loud: float) -> str:
    """A tiny llama (tests/tiny_models.py) with k/v times `loud`, q and o_proj divided by it."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from tiny_models import make_loud_model
    return make_loud_model(root, loud, num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                           name=f"tiny-llama-loud{loud:g}")


def prompt_logprobs(folder: str, device: str, dtype: str, **kwargs) -> list[dict[int, float]]:
    """Per scored prompt position, {token id: logprob} of the top 5 and the prompt's own token."""
    from kvfit import LLM, SamplingParams
    llm = LLM(folder, device=device, dtype=dtype, max_model_len=256, enable_prefix_caching=False,
              kv_cache_memory="256MiB", **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0), use_tqdm=False)
    llm.shutdown()
    return [{t: lp.logprob for t, lp in step.items()} for out in outs for step in out.prompt_logprobs[1:]]


def compare(ref: list[dict[int, float]], got: list[dict[int, float]]) -> dict:
    diffs = [abs(g[t] - r[t]) for r, g in zip(ref, got) for t in r if t in g]
    flips = sum(max(r, key=r.get) != max(g, key=g.get) for r, g in zip(ref, got))
    return {"mean_abs_diff": statistics.fmean(diffs), "max_abs_diff": max(diffs),
            "top1_changed": flips, "positions": len(ref)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder (default: tiny random llamas)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--loud", default="1,2000", help="k/v scale-ups of the tiny models (comma-separated)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kv-fp8-")
    folders = [args.model] if args.model else [loud_folder(root, float(x)) for x in args.loud.split(",")]
    rows = []
    for folder in folders:
        ref = prompt_logprobs(folder, args.device, args.dtype)
        for name, extra in (("fp8, scale 1.0", {}), ("fp8, --calculate-kv-scales", {"calculate_kv_scales": True})):
            row = {"model": os.path.basename(folder), "cache": name, "device": args.device, "dtype": args.dtype,
                   **compare(ref, prompt_logprobs(folder, args.device, args.dtype, kv_cache_dtype="fp8", **extra))}
            rows.append(row)
            print(f"{row['model']:24s} {name:28s} mean |dlogprob| {row['mean_abs_diff']:.4f}  max "
                  f"{row['max_abs_diff']:.4f}  top-1 changed at {row['top1_changed']} of {row['positions']}",
                  flush=True)
    print("RESULT " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
