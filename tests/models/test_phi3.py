"""Phi-3 (Phi3ForCausalLM) against transformers' own Phi3 on tiny random models: prefill and decode logits, greedy
generation through LLM, each tensor-parallel rank's slices of the fused qkv_proj / gate_up_proj tensors, transformers'
config defaults, LongRoPE within its original context, and one-line refusals of what kvfit does not implement
(partial rotary)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from paged_batch import PagedCache, hf_logits, random_tokens, step_logits
from safetensors.torch import load_file

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import facts_from_config, load_model_facts
from kvfit.models import loader
from kvfit.models.llama import decoder_config
from kvfit.planning import resolve_max_model_len
from tiny_models import _randomize, _tokenizer_config, train_tokenizer
from tp_ranks import spy_safetensors_reads

ATOL = 1e-4          # the config sweep's
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)


def make_tiny_phi3(tmp_path, num_kv_heads: int = 2, tie_word_embeddings: bool = False,
                   sliding_window: int | None = None, seed: int = 0) -> str:
    """A tiny Phi-3 folder written by transformers' own Phi3Config and Phi3ForCausalLM (fused qkv_proj and
    gate_up_proj tensors), with a tokenizer for LLM."""
    import transformers
    folder = os.path.join(str(tmp_path), f"tiny-phi3-kv{num_kv_heads}-tie{int(tie_word_embeddings)}-"
                                         f"w{sliding_window}")
    os.makedirs(folder, exist_ok=True)
    tok = train_tokenizer(320, add_bos=True)
    config = transformers.Phi3Config(vocab_size=tok.get_vocab_size(), num_key_value_heads=num_kv_heads,
                                     tie_word_embeddings=tie_word_embeddings, sliding_window=sliding_window,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0, **SIZES)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config).to(torch.float32)
    _randomize(model, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(_tokenizer_config("llama", with_chat_template=False), fh)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, fh)
    return folder


def _hf(folder: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("num_kv_heads, tie, window", [(2, False, None), (1, True, None), (4, False, 24)],
                         ids=["gqa", "mqa-tied", "mha-window"])
def test_prefill_and_decode_give_transformers_logits(tmp_path, num_kv_heads, tie, window):
    folder = make_tiny_phi3(tmp_path, num_kv_heads, tie, window)
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_file(f"{folder}/model.safetensors")
    facts = load_model_facts(folder)
    assert (facts.architecture, facts.tie_word_embeddings, facts.sliding_window) == ("Phi3ForCausalLM", tie, window)
    ours = loader.load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    tokens, other = random_tokens(facts.vocab_size, 24, seed=7), random_tokens(facts.vocab_size, 9, seed=8)
    hf = _hf(folder)
    expected, expected_other = hf_logits(hf, tokens), hf_logits(hf, other)
    cache = PagedCache(facts, block_size=4, num_blocks=32)
    got, got_other = step_logits(ours, cache, [("s", 0, tokens[:20]), ("t", 0, other)])
    assert torch.allclose(got, expected[:20], atol=ATOL), (got - expected[:20]).abs().max()
    assert torch.allclose(got_other, expected_other, atol=ATOL)
    for pos in range(20, 24):       # decode over the cache
        (got,) = step_logits(ours, cache, [("s", pos, tokens[pos:pos + 1])])
        assert torch.allclose(got, expected[pos:pos + 1], atol=ATOL), f"at {pos}: {(got - expected[pos]).abs().max()}"


def test_llm_greedy_generation_equals_transformers_generate(tmp_path):
    from kvfit import LLM, SamplingParams
    folder = make_tiny_phi3(tmp_path)
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    prompts = [[5, 9, 33, 77, 100], [7, 8, 200, 31, 12, 64, 90]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    hf = _hf(folder)
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == expected


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_each_rank_reads_its_slices_of_q_k_v_and_gate_up(tmp_path, monkeypatch, num_kv_heads):
    """Two ranks in-process: each holds its slice of q, of k and of v (and of gate and of up) of the fused checkpoint
    tensors, the same numbers one rank holds; the fused tensors are never read whole, only each part's slice."""
    folder = make_tiny_phi3(tmp_path, num_kv_heads)
    facts = load_model_facts(folder)
    one = loader.load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    full = load_file(f"{folder}/model.safetensors")
    d, inter = facts.head_dim, facts.intermediate_size
    q_rows, kv_rows = facts.num_attention_heads * d, num_kv_heads * d
    for i, layer in enumerate(one.model.layers):         # one rank: the fused tensors as they are
        assert torch.equal(layer.self_attn.qkv_proj.weight, full[f"model.layers.{i}.self_attn.qkv_proj.weight"])
        assert torch.equal(layer.mlp.gate_up_proj.weight, full[f"model.layers.{i}.mlp.gate_up_proj.weight"])
    reads = spy_safetensors_reads(monkeypatch)
    for rank in range(2):
        reads.clear()
        model = loader.load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=rank,
                                  tp_size=2)
        q = slice(rank * q_rows // 2, (rank + 1) * q_rows // 2)
        kv = slice(rank * kv_rows // 2, (rank + 1) * kv_rows // 2) if num_kv_heads % 2 == 0 else slice(0, kv_rows)
        g = slice(rank * inter // 2, (rank + 1) * inter // 2)
        for i, layer in enumerate(model.model.layers):
            qkv = one.model.layers[i].self_attn.qkv_proj.weight                       # [q; k; v] rows
            q_w, k_w, v_w = qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:]
            assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q_w[q], k_w[kv], v_w[kv]]))
            gate, up = one.model.layers[i].mlp.gate_up_proj.weight.split(inter)
            assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[g], up[g]]))
            assert torch.equal(layer.self_attn.o_proj.weight, one.model.layers[i].self_attn.o_proj.weight[:, q])
            assert torch.equal(layer.mlp.down_proj.weight, one.model.layers[i].mlp.down_proj.weight[:, g])
            fused = [shape for name, shape in reads if name == f"model.layers.{i}.self_attn.qkv_proj.weight"]
            hidden = facts.hidden_size
            assert fused == [(q.stop - q.start, hidden), (kv.stop - kv.start, hidden), (kv.stop - kv.start, hidden)]
            assert [shape for name, shape in reads if name == f"model.layers.{i}.mlp.gate_up_proj.weight"] == \
                [(inter // 2, hidden)] * 2


def test_dummy_weights_run_and_the_parameter_count_is_the_models(tmp_path):
    facts = facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, "torch_dtype": "float32",
                               **SIZES})
    model = loader.load_model("", facts, torch.float32, "cpu", TorchReferenceBackend(), load_format="dummy")
    assert sum(p.numel() for p in model.parameters()) == facts.num_params
    cache = PagedCache(facts, block_size=4, num_blocks=8)
    (logits,) = step_logits(model, cache, [("s", 0, [1, 2, 3, 4, 5])])
    assert logits.shape == (5, 128) and torch.isfinite(logits).all()


def test_what_config_json_leaves_out_takes_phi3_config_defaults():
    import transformers
    reference = transformers.Phi3Config()
    facts = facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES,
                               "max_position_embeddings": None})
    cfg = decoder_config(facts)
    assert facts.max_position_embeddings == reference.max_position_embeddings == 4096
    assert cfg.rms_norm_eps == reference.rms_norm_eps == 1e-5
    assert cfg.rope.theta == reference.rope_parameters["rope_theta"] == 10000.0
    assert cfg.rope.rope_type == "default" and facts.sliding_window is reference.sliding_window is None
    assert facts.tie_word_embeddings is reference.tie_word_embeddings is False
    assert not (facts.qkv_bias or facts.o_bias or facts.mlp_bias or facts.qk_norm)
    # dropouts are training-only (transformers' eval): read and ignored
    facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES, "resid_pdrop": 0.1,
                       "embd_pdrop": 0.1, "attention_dropout": 0.1})


def test_phi3_mini_4k_sliding_window_limits_the_context_to_it():
    """transformers applies Phi-3's sliding_window in attention (a sliding-window mask): kvfit's window rule."""
    facts = facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES,
                               "max_position_embeddings": 4096, "sliding_window": 2047})
    assert facts.sliding_window == 2047 and resolve_max_model_len(facts, None) == 2047
    with pytest.raises(ConfigError, match="sliding_window 2047") as err:
        resolve_max_model_len(facts, 2048)
    assert "\n" not in str(err.value)


LONGROPE = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 128}
REFUSED = [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),     # Phi3Config: longrope too
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),                      # Phi-4-mini's top level
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
]


@pytest.mark.parametrize("fields, named", REFUSED)
def test_what_kvfit_does_not_implement_is_refused_in_one_line(fields, named):
    with pytest.raises(ConfigError) as err:
        facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES, **fields})
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields", [{"rope_scaling": {"type": "longrope", **LONGROPE}},
                                    {"rope_scaling": {"type": "su", **LONGROPE}},       # Phi-3-*-128k's older name
                                    {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, **LONGROPE}}])
def test_longrope_runs_within_the_original_context(fields):
    """LongRoPE's short factors within original_max_position_embeddings (transformers' frequencies there); the
    context stops at it, one line naming it past it (tests/models/test_model_review.py compares the outputs)."""
    facts = facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES,
                               "max_position_embeddings": 512, **fields})
    assert facts.rope.rope_type == "longrope" and facts.context_len == 128
    assert resolve_max_model_len(facts, None) == 128
    with pytest.raises(ConfigError, match="longrope context 128") as err:
        resolve_max_model_len(facts, 256)
    assert "\n" not in str(err.value)


def test_a_full_rotary_factor_runs():
    facts = facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES,
                               "partial_rotary_factor": 1.0, "rope_scaling": None})
    assert decoder_config(facts).rope.rope_type == "default"


def test_fp8_dummy_weights_and_online_fp8_load_the_split_parts(tmp_path):
    """FP8 checkpoints' splitting is tested in tests/models/test_fp8.py; here a block-wise FP8 config runs with
    dummy weights, and --quantization fp8 reads every part of the fused 16-bit tensors."""
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    facts = facts_from_config({"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, **SIZES,
                               "quantization_config": fp8})
    model = loader.load_model("", facts, torch.float32, "cpu", TorchReferenceBackend(), load_format="dummy")
    cache = PagedCache(facts, block_size=4, num_blocks=8)
    (logits,) = step_logits(model, cache, [("s", 0, [1, 2, 3, 4, 5])])
    assert logits.shape == (5, 128) and torch.isfinite(logits).all()
    folder = make_tiny_phi3(tmp_path)
    model = loader.load_model(folder, load_model_facts(folder, quantization="fp8"), torch.bfloat16, "cpu",
                              TorchReferenceBackend())           # every part of the fused tensors found and read
    assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "Fp8Linear"
