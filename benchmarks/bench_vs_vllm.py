"""kvfit against vLLM on the same seeded workloads, each engine in its own subprocess, in one device call.

python3 benchmarks/bench_vs_vllm.py --models qwen3-30b-a3b mixtral-8x7b [--groups base] [--reps 3]
        [--engines kvfit vllm] [--out benchmarks/results/x.json]

vLLM must be importable (on the lent H200: ../shared/peers/vllm/stage.sh, then PYTHONPATH as its README
says). Both engines get the same settings: dummy bf16 weights (`--load-format dummy`), token-id prompts,
greedy, ignore_eos, gpu_memory_utilization 0.9, the same max_model_len / max_num_seqs / prefix-caching
setting; each engine's own defaults otherwise (vLLM: torch.compile, FlashAttention-3, CUDA graphs).
One process per (model, engine, group): start-up is timed (engine created, graphs captured), then a
warm-up (8 requests, then one untimed run of each throughput-style workload: the first full run on a fresh
process is slower for both engines), then every workload of the group `--reps` times; with prefix caching
on, the cache is reset before every repetition (vLLM's LLM.reset_prefix_cache on both engines), so a
repetition never hits the previous one's prompts. Groups (one engine configuration each):
  base:   max_model_len 2048, max_num_seqs 256, no prefix caching
          throughput: 256 requests, 128-1024 in, 128-512 out (benchmarks/common.request_set, seed 0)
          latency:    batch-1 decode, 128-token prompt: (t(16 + 256 tokens) - t(16)) / 256 per token
  long:   max_model_len 8448, max_num_seqs 256, prefix caching on
          shared-prefix: 256 requests sharing a 2,000-token system prompt + 128-512 own tokens, 128 out
          long-context:  32 requests of 8,000 in / 256 out
KVFIT_BENCH_ARGS='{"async_scheduling": false}' (JSON) adds arguments to kvfit's LLM(...) for an experiment;
VLLM_BENCH_ARGS='{"kv_cache_dtype": "fp8"}' (JSON) adds arguments to vLLM's LLM(...);
KVFIT_BENCH_PREFILL='[128, 64, 8, 2]' sets kvfit's prefill attention tiles (kvfit.kernels.attention_prefill.PREFILL_CONFIG).
KVFIT_BENCH_FP8_DECODE='[128, 4, 2, "fp16"]' sets an fp8 cache's decode launch (attention_decode.FP8_DECODE_CONFIG).
KVFIT_BENCH_FP8_PREFILL=pairs|query sets an fp8 cache's prefill dots (attention_prefill.FP8_PREFILL_DOTS).
KVFIT_BENCH_FP8=channel|block runs both engines on the model's FP8 checkpoint shape (dummy FP8 weights): its
config.json with a compressed-tensors per-channel quantization_config (dynamic per-token activations, the
"-FP8-dynamic" releases) or the block-wise fp8 one (weight_block_size [128, 128], Qwen3-*-FP8). On FP8 runs vLLM's
dummy weights are redrawn as kvfit draws its own (redraw_like_kvfit: vLLM's draw makes about 98% of FP8 weights 0);
KVFIT_BENCH_VLLM_DUMMY=vllm keeps vLLM's draw; KVFIT_BENCH_DUMMY=vllm gives kvfit vLLM's draw (draw_like_vllm).
Prints, per model and workload, each engine's median and spread ((max - min) / median) and the ratio
kvfit / vLLM in throughput (for latency: vLLM's ms/token over kvfit's); the row kv_tokens is each engine's KV
cache in tokens at start-up (same gpu_memory_utilization; > 1: kvfit plans more); JSON rows go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))      # this checkout's kvfit, as worker() runs it
from kvfit.models.loader import DUMMY_STD  # noqa: E402  (kvfit's dummy weights: normal(0, DUMMY_STD), norms 1)
from kvfit.quant_scheme import DUMMY_INPUT_SCALE  # noqa: E402
GROUPS = {
    "base": dict(max_model_len=2048, max_num_seqs=256, prefix_caching=False,
                 workloads=("throughput", "latency")),
    "long": dict(max_model_len=8448, max_num_seqs=256, prefix_caching=True,
                 workloads=("shared-prefix", "long-context")),
    # start-up and KV tokens alone (base's settings): #32's "KV tokens >= vLLM's at the same utilization"
    "capacity": dict(max_model_len=2048, max_num_seqs=256, prefix_caching=False, workloads=()),
}
UTILIZATION = 0.9


def workload(name: str, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of a throughput-style workload; the same on both engines."""
    sys.path.insert(0, HERE)
    from common import request_set
    if name == "throughput":
        return request_set(256, vocab=vocab, seed=0)
    rng = random.Random(1)
    if name == "shared-prefix":
        system = [rng.randrange(10, vocab - 10) for _ in range(2000)]
        prompts = [system + [rng.randrange(10, vocab - 10) for _ in range(rng.randint(128, 512))] for _ in range(256)]
        return prompts, [128] * 256
    if name == "long-context":
        return [[rng.randrange(10, vocab - 10) for _ in range(8000)] for _ in range(32)], [256] * 32
    raise ValueError(name)


FP8_CONFIGS = {
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                          "symmetric": True}}}},
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}
FP8_DUMMY_SCALE = 4 * DUMMY_STD / 448  # a block's scale when its largest weight is 4 std: e4m3's 448 at 4 std


def redraw_like_kvfit(model) -> dict:
    """Runs inside vLLM's worker (LLM.apply_model): draws every weight as kvfit's dummy loader does.

    vLLM's dummy loader draws every parameter uniform in +-1e-3, FP8 ones through float16 and then cast: e4m3's
    smallest step is 2^-9 (0.00195), so about 98% of the FP8 weights become 0 and the FP8 layers compute (almost)
    zeros. That is not the work a real model does (a router quantized to FP8 would score every expert 0 and send
    every token to the same top-k; GEMMs on zeros draw less power). On an H100 (2026-12-07) kvfit ran
    qwen3-30b-a3b block FP8 as fast on this draw as on its own (its router is never quantized, and vLLM's
    Qwen3-MoE router is not either), so the draw may not explain a ratio; it is still not a real model's
    work, and on FP8 runs both engines get weights of the same distribution: normal(0, 0.02) (FP8 weights
    quantized with one scale, FP8_DUMMY_SCALE, clamped at 448: kvfit's per-block scales give the same values,
    within e4m3's step),
    norm weights 1, FP8 scales FP8_DUMMY_SCALE, static input scales kvfit's DUMMY_INPUT_SCALE. The
    fills are in place, so captured CUDA graphs and compiled code keep their pointers; a constant scale and
    i.i.d. weights are the same distribution whatever layout vLLM gave a tensor after loading.
    """
    import torch
    gens: dict = {}
    counts = {"fp8": 0, "scales": 0, "norms": 0, "other": 0}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            data = param.data
            gen = gens.setdefault(data.device, torch.Generator(device=data.device).manual_seed(0))
            if name.endswith(("weight_scale_inv", "weight_scale")):
                data.fill_(FP8_DUMMY_SCALE)
                counts["scales"] += 1
            elif name.endswith("input_scale"):
                data.fill_(DUMMY_INPUT_SCALE)
                counts["scales"] += 1
            elif "norm" in name:
                data.fill_(1.0)
                counts["norms"] += 1
            elif data.dtype == torch.float8_e4m3fn:
                # slices of dim 0 are views whatever the layout (a reshape of a transposed tensor is a copy)
                step = max(1, (1 << 26) // max(1, data[0].numel()))      # at most 2^26 fp32 values at a time
                for start in range(0, data.shape[0], step):
                    part = data[start:start + step]
                    drawn = torch.empty(part.shape, dtype=torch.float32, device=data.device)
                    drawn.normal_(0.0, DUMMY_STD, generator=gen)
                    part.copy_((drawn / FP8_DUMMY_SCALE).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn))
                counts["fp8"] += 1
            elif data.element_size() >= 2:
                data.normal_(0.0, DUMMY_STD, generator=gen)
                counts["other"] += 1
            else:
                raise RuntimeError(f"{name}: dtype {data.dtype} has no kvfit-like dummy draw")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return counts


def model_folder(model: str, engine: str, fp8: str | None = None) -> str:
    """A folder holding the catalog model's config.json (with the quantization_config of fp8, a FP8_CONFIGS
    name; by default KVFIT_BENCH_FP8's, if set)."""
    from kvfit.catalog import model_config
    fp8 = fp8 or os.environ.get("KVFIT_BENCH_FP8")
    folder = f"/tmp/{engine}-cfg/{model}{'-fp8-' + fp8 if fp8 else ''}"
    os.makedirs(folder, exist_ok=True)
    config = {"torch_dtype": "bfloat16", **model_config(model)}
    if fp8:
        config["quantization_config"] = FP8_CONFIGS[fp8]
    with open(f"{folder}/config.json", "w") as fh:
        json.dump(config, fh)
    return folder


class _Engine:
    """What both engines' wrappers share: self.llm has vLLM's LLM.reset_prefix_cache."""

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset (requests still hold blocks)")


def draw_like_vllm(model, *args, **kwargs) -> None:
    """kvfit's dummy weights drawn as vLLM's dummy loader draws its own: every floating parameter (FP8 weights and
    scales too) uniform in +-1e-3 in float16, then cast to its dtype. For an experiment (KVFIT_BENCH_DUMMY=vllm):
    how fast kvfit runs the model vLLM's FP8 dummy draw makes (nearly every FP8 weight 0), beside its own draw."""
    import torch
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                drawn = torch.empty(param.shape, dtype=torch.float16, device=param.device).uniform_(-1e-3, 1e-3)
                param.data.copy_(drawn.to(param.dtype))


class KvfitEngine(_Engine):
    def __init__(self, model: str, group: dict):
        from kvfit import LLM
        if os.environ.get("KVFIT_BENCH_DUMMY") == "vllm":
            from kvfit.models import loader
            loader.init_dummy_weights = draw_like_vllm
            print("NOTE kvfit weights drawn as vLLM's dummy loader draws them (KVFIT_BENCH_DUMMY=vllm)", flush=True)
        # KVFIT_BENCH_ARGS: JSON of extra LLM(...) arguments for an experiment (e.g. max_num_batched_tokens)
        extra = json.loads(os.environ.get("KVFIT_BENCH_ARGS", "{}"))
        if os.environ.get("KVFIT_BENCH_FP8_DECODE"):      # e.g. [128, 4, 2, "fp16"] (probe_fp8_decode.py --write)
            from kvfit.kernels import attention_decode
            attention_decode.FP8_DECODE_CONFIG = tuple(json.loads(os.environ["KVFIT_BENCH_FP8_DECODE"]))
            print(f"NOTE fp8 decode config {attention_decode.FP8_DECODE_CONFIG}", flush=True)
        if os.environ.get("KVFIT_BENCH_FP8_PREFILL"):
            from kvfit.kernels import attention_prefill
            attention_prefill.FP8_PREFILL_DOTS = os.environ["KVFIT_BENCH_FP8_PREFILL"]
            print(f"NOTE fp8 prefill dots {attention_prefill.FP8_PREFILL_DOTS}", flush=True)
        if os.environ.get("KVFIT_BENCH_PREFILL"):
            # JSON [BLOCK_M, BLOCK_N, num_warps, num_stages]: the prefill attention tiles, for an experiment
            from kvfit.kernels import attention_prefill
            attention_prefill.PREFILL_CONFIG = tuple(json.loads(os.environ["KVFIT_BENCH_PREFILL"]))
        model = model_folder(model, "kvfit") if os.environ.get("KVFIT_BENCH_FP8") else model
        self.llm = LLM(model, load_format="dummy", dtype="bfloat16", device="cuda",
                       max_model_len=group["max_model_len"], max_num_seqs=group["max_num_seqs"],
                       enable_prefix_caching=group["prefix_caching"], gpu_memory_utilization=UTILIZATION, **extra)

    def kv_tokens(self) -> int:
        return self.llm.capacity.token_capacity

    def generate(self, prompts, outs) -> int:
        from kvfit import SamplingParams
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in outs]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in results)


class VllmEngine(_Engine):
    def __init__(self, model: str, group: dict):
        from vllm import LLM
        folder = model_folder(model, "vllm")
        # apply_model sends redraw_dummy's function to vLLM's engine-core process, which needs this to take it
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # VLLM_BENCH_ARGS: JSON of extra LLM(...) arguments (e.g. {"kv_cache_dtype": "fp8"}), as KVFIT_BENCH_ARGS
        extra = json.loads(os.environ.get("VLLM_BENCH_ARGS", "{}"))
        self.llm = LLM(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                       max_model_len=group["max_model_len"], max_num_seqs=group["max_num_seqs"],
                       enable_prefix_caching=group["prefix_caching"], gpu_memory_utilization=UTILIZATION, seed=0,
                       **extra)

    def kv_tokens(self) -> int | None:
        """vLLM's KV cache in tokens (its blocks x block size, as the engine core reported them), or None."""
        cache = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        return blocks * cache.block_size if blocks else None

    def redraw_dummy(self) -> None:
        """On FP8 runs: vLLM's weights drawn as kvfit's (redraw_like_kvfit says why), unless
        KVFIT_BENCH_VLLM_DUMMY=vllm keeps vLLM's own draw."""
        if os.environ.get("KVFIT_BENCH_FP8") and os.environ.get("KVFIT_BENCH_VLLM_DUMMY", "kvfit") == "kvfit":
            try:
                counts = self.llm.apply_model(redraw_like_kvfit)
            except Exception as exc:     # the run goes on, on vLLM's own draw, and the log says so
                print(f"NOTE vllm weights NOT redrawn ({type(exc).__name__}: {exc}); vLLM runs on its own dummy draw",
                      flush=True)
                return
            print(f"NOTE vllm weights redrawn as kvfit's dummy weights are drawn: {counts}", flush=True)

    def generate(self, prompts, outs) -> int:
        from vllm import SamplingParams
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in outs]
        results = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in results)


def worker(engine_name: str, model: str, group_name: str, reps: int) -> None:
    """Runs in its own process: prints one RESULT line per measured workload."""
    import torch
    from kvfit.model_facts import load_model_facts
    vocab = load_model_facts(model).vocab_size
    group = GROUPS[group_name]
    start = time.perf_counter()
    engine = (KvfitEngine if engine_name == "kvfit" else VllmEngine)(model, group)
    startup = time.perf_counter() - start
    _emit(engine_name, model, "startup", [startup], "s")
    kv_tokens = engine.kv_tokens()
    if kv_tokens:
        _emit(engine_name, model, "kv_tokens", [kv_tokens], "tokens")
    if hasattr(engine, "redraw_dummy"):
        engine.redraw_dummy()
    warm_prompts, warm_outs = workload("throughput", vocab)
    engine.generate(warm_prompts[:8], warm_outs[:8])
    latency_prompt = [[100 + i % 1000 for i in range(128)]]
    for name in group["workloads"]:
        # one untimed run of the whole workload first (steady state); for latency, of both its runs: a one-time
        # cost in the first short run made the difference too small (1.53 ms/token for the 8B FP8 with an fp8
        # cache on 2026-12-07, under its weights' roofline)
        if name != "latency":
            engine.generate(*workload(name, vocab))
        else:
            engine.generate(latency_prompt, [16])
            engine.generate(latency_prompt, [16 + 256])
        values = []
        for _ in range(reps):
            if group["prefix_caching"]:     # every repetition computes its prompts (no hits on the last run's)
                engine.reset_prefix_cache()
            if name == "latency":
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate(latency_prompt, [16])
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                engine.generate(latency_prompt, [16 + 256])
                torch.cuda.synchronize()
                values.append(((time.perf_counter() - t1) - (t1 - t0)) / 256 * 1e3)
            else:
                prompts, outs = workload(name, vocab)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                n = engine.generate(prompts, outs)
                torch.cuda.synchronize()
                assert n == sum(outs), (n, sum(outs))
                values.append(n / (time.perf_counter() - t0))
        _emit(engine_name, model, name, values, "ms/token" if name == "latency" else "tok/s")


def add_run_args(ap: argparse.ArgumentParser, worker_fields: tuple[str, str, str]) -> None:
    """The flags every engine-against-engine benchmark takes: engines, a timeout, --out, the worker's."""
    ap.add_argument("--engines", nargs="+", default=["kvfit", "vllm"], choices=["kvfit", "vllm"])
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=3, metavar=worker_fields, help=argparse.SUPPRESS)


def run_worker(cmd: list[str], name: str, timeout: int, env: dict | None = None) -> list[dict]:
    """Run one engine's worker process; return its RESULT rows (a timeout or a failure is printed)."""
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"{name}: timed out after {timeout} s", flush=True)
        return []
    if proc.returncode != 0:
        print(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith("NOTE "):
            print(f"  {name}: {line[5:]}", flush=True)
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _emit(engine: str, model: str, workload_name: str, values: list[float], unit: str) -> None:
    print("RESULT " + json.dumps({"engine": engine, "model": model, "workload": workload_name, "unit": unit,
                                  "values": values}), flush=True)


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    keys = sorted({(r["model"], r["workload"]) for r in rows})
    for model, name in keys:
        by_engine = {r["engine"]: r for r in rows if (r["model"], r["workload"]) == (model, name)}
        line = {"model": model, "workload": name}
        for engine, r in by_engine.items():
            med = statistics.median(r["values"])
            line[f"{engine}_median"] = med
            line[f"{engine}_spread"] = (max(r["values"]) - min(r["values"])) / med if med else 0.0
            line["unit"] = r["unit"]
        if "kvfit_median" in line and "vllm_median" in line and name != "startup":   # kv_tokens: > 1, kvfit more
            k, v = line["kvfit_median"], line["vllm_median"]
            line["ratio"] = v / k if name == "latency" else k / v       # > 1: kvfit is faster
        table.append(line)
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    ap.add_argument("--groups", nargs="+", default=["base"], choices=list(GROUPS))
    ap.add_argument("--reps", type=int, default=3)
    add_run_args(ap, ("ENGINE", "MODEL", "GROUP"))
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, reps=args.reps)
        return 0
    sys.path.insert(0, HERE)
    from common import gpu_only
    if not gpu_only("bench_vs_vllm"):
        return 0
    rows = []
    for model in args.models:
        for group in args.groups:
            for engine in args.engines:
                cmd = [sys.executable, __file__, "--worker", engine, model, group, "--reps", str(args.reps)]
                print(f"=== {engine} {model} {group}", flush=True)
                found = run_worker(cmd, f"{engine} {model} {group}", args.timeout)
                rows += found
                for r in found:
                    print(f"  {r['workload']}: {', '.join(f'{v:.4g}' for v in r['values'])} {r['unit']}", flush=True)
    table = summarize(rows)
    print("\n| model | workload | kvfit (median, spread) | vLLM (median, spread) | ratio (>1: kvfit faster) |")
    print("| --- | --- | --- | --- | --- |")
    for t in table:
        cell = {e: (f"{t[e + '_median']:.4g} {t['unit']} ({t[e + '_spread'] * 100:.1f}%)"
                    if e + "_median" in t else "-") for e in ("kvfit", "vllm")}
        ratio = f"{t['ratio']:.2f}x" if "ratio" in t else "-"
        print(f"| {t['model']} | {t['workload']} | {cell['kvfit']} | {cell['vllm']} | {ratio} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "table": table}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
