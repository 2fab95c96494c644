"""Mixture-of-experts models end to end: kvfit's greedy tokens equal transformers' generate (fp32, CPU).

Tiny random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints (save_pretrained, per-expert tensors) under every
engine setting of test_generate_e2e (prefix caching on and off, chunked prefill, a cache small
enough to force preemption, multi-step decoding), then `kvfit generate` on the command line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_generate_e2e import NUM_NEW, SETTINGS, _hf_greedy, _prompts

from kvfit import LLM, SamplingParams
from kvfit.model_facts import load_model_facts
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-e2e")
    return {"qwen3_moe": make_tiny_model(root, arch="qwen3_moe", seed=11, num_layers=2,
                                         moe={"num_experts": 8, "top_k": 2, "norm_topk_prob": True}),
            "qwen2_moe": make_tiny_model(root, arch="qwen2_moe", seed=13, num_layers=2,
                                         moe={"num_experts": 4, "top_k": 2}),
            "mixtral": make_tiny_model(root, arch="mixtral", seed=12, num_layers=2,
                                       moe={"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32})}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_greedy_matches_transformers(arch, moe_folders):
    folder = moe_folders[arch]
    prompts = _prompts(load_model_facts(folder).vocab_size)
    expected = _hf_greedy(folder, prompts)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    # the others: the settings that exercise the cache differently from Qwen3-MoE's run (suite time)
    names = list(SETTINGS) if arch == "qwen3_moe" else ["chunked_prefill", "preemption"]
    for name in names:
        settings = SETTINGS[name]
        llm = LLM(folder, **{**dict(device="cpu", dtype="float32", block_size=4, max_model_len=128), **settings})
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, f"{arch} with {name}"
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0
        if name == "preemption":
            assert stats["preemptions"] > 0


def test_kvfit_generate_runs_a_moe_folder(moe_folders):
    proc = subprocess.run([sys.executable, "-m", "kvfit.cli", "generate", moe_folders["mixtral"], "--device", "cpu",
                           "--prompt", "Hello world", "--max-tokens", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(row["token_ids"]) <= 4 and row["prompt"] == "Hello world"
