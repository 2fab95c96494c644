"""load_model: single-file and sharded safetensors, clear errors for bad checkpoints, dummy weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from paged_batch import PagedCache, hf_logits, random_tokens
from safetensors.torch import load_file, save_file

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import facts_from_config, load_model_facts
from kvfit.models.loader import load_model
from tiny_models import make_tiny_model

BACKEND = TorchReferenceBackend()


def _load(folder, load_format="auto"):
    return load_model(folder, load_model_facts(folder), torch.float32, "cpu", BACKEND, load_format=load_format)


def _copy_with_tensors(src: str, dst, edit) -> str:
    """A copy of model folder src whose model.safetensors went through edit(dict of tensors)."""
    folder = str(dst / "edited")
    shutil.copytree(src, folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@torch.inference_mode()
def _last_logits(model, facts, tokens):
    input_ids, positions, meta = PagedCache(facts).step([("s", 0, tokens)])
    return model.compute_logits(model(input_ids, positions, None, meta))


def test_sharded_safetensors_with_an_index_load_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    folder = make_tiny_model(tmp_path, arch="qwen2", max_shard_size="40KB")
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    facts = load_model_facts(folder)
    tokens = random_tokens(facts.vocab_size, 11, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.allclose(_last_logits(_load(folder), facts, tokens), hf_logits(hf, tokens), atol=1e-4)


def test_a_missing_tensor_is_named(tiny_llama, tmp_path):
    folder = _copy_with_tensors(tiny_llama, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(folder)


def test_a_misshaped_tensor_is_named_with_both_shapes(tiny_llama, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()
    folder = _copy_with_tensors(tiny_llama, tmp_path, shrink)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 64\] "
                                          r"but config\.json needs \[32, 64\]"):
        _load(folder)


def test_extra_tensors_are_ignored(tiny_llama, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.extra"] = torch.ones(2)
    folder = _copy_with_tensors(tiny_llama, tmp_path, add)
    facts = load_model_facts(folder)
    tokens = random_tokens(facts.vocab_size, 6, seed=2)
    assert torch.equal(_last_logits(_load(folder), facts, tokens), _last_logits(_load(tiny_llama), facts, tokens))


def test_no_weights_suggests_dummy(tiny_llama, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(os.path.join(tiny_llama, "config.json"), folder)
    with pytest.raises(ConfigError, match=r"no model\.safetensors.*--load-format dummy"):
        _load(str(folder))
    with open(folder / "model.safetensors.index.json", "w") as fh:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, fh)
    with pytest.raises(ConfigError, match=r"model-00001-of-00002\.safetensors"):
        _load(str(folder))


def test_dummy_weights_need_no_files_and_are_deterministic(tiny_llama):
    facts = load_model_facts(tiny_llama)
    a = load_model("not-a-folder", facts, torch.float32, "cpu", BACKEND, load_format="dummy")
    b = load_model("not-a-folder", facts, torch.float32, "cpu", BACKEND, load_format="dummy")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1)
        else:
            assert 0.01 < pa.std() < 0.03, name
    tokens = random_tokens(facts.vocab_size, 5, seed=0)
    assert torch.isfinite(_last_logits(a, facts, tokens)).all()


def test_bf16_dummy_model():
    facts = facts_from_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 24, "vocab_size": 50, "torch_dtype": "bfloat16"})
    model = load_model("", facts, torch.bfloat16, "cpu", BACKEND, load_format="dummy")
    cache = PagedCache(facts, dtype=torch.bfloat16)
    input_ids, positions, meta = cache.step([("s", 0, [1, 2, 3])])
    with torch.inference_mode():
        hidden = model(input_ids, positions, cache.caches, meta)
    assert hidden.shape == (3, 32) and hidden.dtype == torch.bfloat16
    assert model.compute_logits(hidden).dtype == torch.float32


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_plannable_but_not_runnable_families_are_refused(arch):
    cfg = {"architectures": [arch], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "vocab_size": 50, "n_routed_experts": 4, "moe_intermediate_size": 16,
           "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
           "v_head_dim": 8}
    with pytest.raises(ConfigError, match=rf"^{arch} can be planned but not run yet; runnable: LlamaForCausalLM, "
                                          r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                          r"Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, "
                                          r"Phi3ForCausalLM$"):
        load_model("", facts_from_config(cfg), torch.float32, "cpu", BACKEND, load_format="dummy")


def test_dummy_moe_models_run(tmp_path):
    """Qwen3-MoE, Qwen2-MoE and Mixtral with --load-format dummy: stacked experts filled, a forward pass runs."""
    for arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"):
        cfg = {"architectures": [arch], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 50, "num_experts": 4,
               "moe_intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
               "shared_expert_intermediate_size": 24}
        facts = facts_from_config(cfg)
        model = load_model("", facts, torch.float32, "cpu", BACKEND, load_format="dummy")
        cache = PagedCache(facts)
        input_ids, positions, meta = cache.step([("s", 0, [1, 2, 3, 4])])
        with torch.inference_mode():
            logits = model.compute_logits(model(input_ids, positions, cache.caches, meta))
        assert logits.shape == (4, 50) and torch.isfinite(logits).all(), arch
