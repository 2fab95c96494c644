"""How evenly each engine's router spreads the same prompts over the experts, on dummy weights.

python3 benchmarks/probe_moe_routing.py --model qwen3-30b-a3b [--fp8-checkpoint block] [--engines kvfit vllm]

A grouped-GEMM MoE's speed depends on how tokens are spread: many tokens on few experts read few weights
in few large tiles, an even spread reads every expert. Dummy weights route as they happen to route, and
the two engines draw dummy weights differently (kvfit normal(0, 0.02) with norms at 1, vLLM uniform in
+-1e-3 everywhere), so a throughput ratio on dummy weights may compare different MoE work. This prints, per
engine and layer (vllm-redrawn: vLLM with weights drawn as kvfit's, as bench_vs_vllm does on FP8 runs), for one
prefill forward of 256 prompts x 16 tokens (4,096 tokens, eager): the experts
used and the largest expert load over the mean. Each engine runs in its own subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_PROMPTS, PROMPT_LEN = 256, 16
MIN_TOKENS = 1024          # forwards with fewer tokens (warm-up, profiling runs) are not counted


def prompts(vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(10, vocab - 10) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS)]


def summary(counts_per_layer: list[list[int]]) -> list[tuple[int, float]]:
    out = []
    for counts in counts_per_layer:
        mean = sum(counts) / len(counts)
        out.append((sum(c > 0 for c in counts), max(counts) / mean if mean else 0.0))
    return out


def run_kvfit(model: str, fp8: str | None) -> list[list[int]]:
    import torch

    from kvfit import LLM, SamplingParams
    from kvfit.model_facts import load_model_facts
    from kvfit.models import moe
    vocab = load_model_facts(model).vocab_size
    if fp8:
        sys.path.insert(0, HERE)
        from bench_vs_vllm import model_folder
        model = model_folder(model, "kvfit", fp8)
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False)
    layers: list[list[int]] = []
    original = moe.select_experts

    def recording(logits, top_k, renormalize, **kwargs):
        weights, ids = original(logits, top_k, renormalize, **kwargs)
        if ids.shape[0] >= MIN_TOKENS:
            layers.append(torch.bincount(ids.reshape(-1), minlength=logits.shape[-1]).tolist())
        return weights, ids
    moe.select_experts = recording
    llm.generate(prompts(vocab), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    moe.select_experts = original
    llm.shutdown()
    return layers


def run_vllm(model: str, fp8: str | None, redraw: bool = False) -> list[list[int]]:
    sys.path.insert(0, HERE)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from bench_vs_vllm import model_folder, redraw_like_kvfit
    from vllm import LLM, SamplingParams

    from kvfit.model_facts import load_model_facts
    vocab = load_model_facts(model).vocab_size
    folder = model_folder(model, "vllm", fp8)
    llm = LLM(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, compilation_config=0, gpu_memory_utilization=0.9, enable_prefix_caching=False,
              seed=0)
    if redraw:
        print("vllm weights redrawn as kvfit's:", llm.apply_model(redraw_like_kvfit))

    def install(module):
        import torch
        counts = []

        def hook(gate, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            if logits.shape[0] >= MIN_TOKENS:
                top_k = module.config_top_k
                ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices
                counts.append(torch.bincount(ids.reshape(-1), minlength=logits.shape[-1]).tolist())
        module.routing_counts = counts
        for name, sub in module.named_modules():
            if name.endswith("mlp.gate"):
                sub.register_forward_hook(hook)
        return sum(name.endswith("mlp.gate") for name, _ in module.named_modules())

    with open(os.path.join(folder, "config.json")) as f:
        top_k = json.load(f)["num_experts_per_tok"]

    def set_top_k(module):
        module.config_top_k = top_k
        return install(module)
    print("vllm gates hooked:", llm.apply_model(set_top_k))
    llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
    return llm.apply_model(lambda module: module.routing_counts)[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--fp8-checkpoint", choices=("channel", "block"), default=None)
    ap.add_argument("--engines", nargs="+", default=["kvfit", "vllm"], choices=["kvfit", "vllm", "vllm-redrawn"],
                    help="vllm-redrawn: vLLM with its weights redrawn as kvfit's (bench_vs_vllm.redraw_like_kvfit)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child == "kvfit":
            layers = run_kvfit(args.model, args.fp8_checkpoint)
        else:
            layers = run_vllm(args.model, args.fp8_checkpoint, redraw=args.child == "vllm-redrawn")
        print("ROUTING " + json.dumps(layers))
        return 0
    for engine in args.engines:
        command = [sys.executable, __file__, "--model", args.model, "--child", engine]
        if args.fp8_checkpoint:
            command += ["--fp8-checkpoint", args.fp8_checkpoint]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("ROUTING ")]
        if proc.returncode or not lines:
            print(f"== {engine}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        layers = json.loads(lines[-1][len("ROUTING "):])
        rows = summary(layers)
        print(f"== {engine}: {len(rows)} layer forwards of >= {MIN_TOKENS} tokens; experts used / max load over mean")
        print("  " + " ".join(f"{n}/{r:.1f}" for n, r in rows))
        if rows:
            print(f"  mean experts used {sum(n for n, _ in rows) / len(rows):.1f}, "
                  f"mean max/mean {sum(r for _, r in rows) / len(rows):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
