"""Tensor parallelism on CPU (2 ranks over gloo): sharded q/k/v, MLP and o_proj give transformers' logits.

Covers KV heads split across ranks, one KV head replicated on both (MQA), q/k/v bias (Qwen2) and an
o_proj bias added once after the all-reduce (Llama attention_bias).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from paged_batch import hf_logits, random_tokens
from tp_ranks import rank_main

from kvfit.errors import ConfigError
from kvfit.model_facts import load_model_facts
from kvfit.models.llama import CausalLM
from tiny_models import make_tiny_model


def test_two_ranks_match_transformers(tmp_path, tiny_llama, tiny_qwen2):
    from transformers import AutoModelForCausalLM
    mqa_bias = make_tiny_model(tmp_path, arch="llama", num_kv_heads=1, attention_bias=True, seed=4)
    folders = [tiny_llama, tiny_qwen2, mqa_bias]
    tokens = random_tokens(load_model_facts(tiny_llama).vocab_size, 14, seed=3)
    out_file = str(tmp_path / "logits.pt")
    mp.spawn(rank_main, args=(2, str(tmp_path / "init"), folders, tokens, 10, out_file), nprocs=2, join=True)
    results = torch.load(out_file)
    for folder in folders:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = hf_logits(hf, tokens)
        assert torch.allclose(results[folder], expected, atol=1e-4), folder


def test_heads_that_do_not_split_are_a_config_error(tiny_llama):
    from kvfit.attention.torch_ref import TorchReferenceBackend
    facts = load_model_facts(tiny_llama)          # 4 query heads, 2 kv heads
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3"):
        CausalLM(facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=0, tp_size=3)
