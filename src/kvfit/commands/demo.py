"""`kvfit demo`: a tiny random-weight model on CPU, a cache small enough to force preemption."""

from __future__ import annotations

import json
import os
import random
import tempfile
import time

MAX_TOKENS = 48
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


def register(sub) -> None:
    p = sub.add_parser("demo", help="run a tiny random model on CPU and show capacity and preemption")
    p.add_argument("--num-requests", type=int, default=24, help="random prompts to generate for")
    p.add_argument("--num-gpu-blocks-override", type=int, default=48, help="KV blocks (small: forces preemption)")
    p.set_defaults(run=run)


def run(args) -> int:
    from kvfit.commands.common import setup_logging
    from kvfit.engine.llm import LLM
    from kvfit.sampling_params import SamplingParams
    from kvfit.errors import ConfigError
    from kvfit.kv.report import plan_table
    if args.num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {args.num_requests}")
    setup_logging()
    with tempfile.TemporaryDirectory(prefix="kvfit-demo-") as folder:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(TINY_CONFIG, fh)
        print("kvfit demo: a tiny Llama-shaped model with RANDOM weights (2 layers, hidden 128), on CPU; "
              "its text is noise, its batching is real")
        llm = LLM(folder, device="cpu", load_format="dummy", max_model_len=256, block_size=16,
                  num_gpu_blocks_override=args.num_gpu_blocks_override, max_num_seqs=16,
                  max_num_batched_tokens=512, enable_prefix_caching=True)
        print(plan_table(llm.capacity, "capacity report"))
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(24, 120))] for _ in range(args.num_requests)]
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats()
    print(f"requests: {len(outputs)} finished of {args.num_requests}; prompt tokens "
          f"{sum(map(len, prompts))}, output tokens {num_out} in {elapsed:.2f} s = {num_out / elapsed:.1f} tok/s")
    print(f"preemptions: {stats['preemptions']} (the cache holds {llm.capacity.token_capacity} tokens; "
          f"the batch needed up to {sum(len(p) + MAX_TOKENS for p in prompts)})")
    print(f"KV blocks after the run: {stats['kv_blocks_free']} free + {stats['kv_blocks_cached']} cached + "
          f"{stats['kv_blocks_used']} used = {stats['kv_blocks_total']}")
    return 0
