"""Unusual but valid config.json settings of Hub checkpoints: kvfit gives transformers' logits, or refuses in one line
naming the field, never a different model.

Each case is a one-layer tiny model whose config.json is make_tiny_model's with some fields set (or removed, DROP) as
the Hub writes them; transformers builds and saves the weights from that file, and the file is written back as it
was (transformers would normalise it), so both read the same config.json.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from paged_batch import PagedCache, hf_logits, random_tokens, step_logits

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import facts_from_config, load_model_facts
from kvfit.models.llama import decoder_config
from kvfit.models.loader import load_model
from kvfit.planning import resolve_max_model_len
from tiny_models import _randomize, make_tiny_model

ATOL = 1e-4
DROP = object()          # an override that removes the field
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def _tiny_folder(tmp_path, arch: str, overrides: dict, transformers4_rope: bool = False, **kwargs) -> str:
    """make_tiny_model's folder with config.json fields overridden, its weights drawn by transformers from that
    config. transformers4_rope: rope_theta at the top level instead of transformers 5's rope_parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = make_tiny_model(tmp_path, arch=arch, num_layers=1, **kwargs)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    if transformers4_rope:
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    for key, value in overrides.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    _randomize(model, 0.1)
    model.save_pretrained(folder)
    with open(path, "w", encoding="utf-8") as fh:      # the file as the Hub has it, not transformers' rewrite
        json.dump(cfg, fh)
    return folder


# name -> (arch, overrides, transformers4_rope)
MATCHING = {
    # YaRN as Qwen2.5 / Qwen3 model cards ask for it (rope_scaling added to a transformers 4 config.json)
    "yarn-qwen2": ("qwen2", {"rope_scaling": {**YARN, "type": "yarn"}}, True),
    "yarn-every-option": ("llama", {"rope_scaling": {**YARN, "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2,
                                                     "truncate": False}}, True),
    "yarn-mscale": ("llama", {"rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}}, True),
    # transformers 5 layout; original_max_position_embeddings absent: max_position_embeddings
    "yarn-rope-parameters": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
                             False),
    "yarn-top-level-original": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                                          "original_max_position_embeddings": 128}, True),
    # transformers rescales dynamic NTK only past max_position_embeddings, where kvfit never runs
    "dynamic": ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, True),
    "llama3-without-original": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, True),
    # a rope_scaling beside rope_parameters replaces it, as transformers reads them
    "rope-scaling-beside-rope-parameters": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, False),
    # Mixtral's defaults differ: rms_norm_eps 1e-5, rope_theta 1e6
    "mixtral-without-rms-norm-eps": ("mixtral", {"rms_norm_eps": DROP}, False),
    "mixtral-without-rope-theta": ("mixtral", {"rope_parameters": DROP}, False),
    "qwen2-moe-qkv-bias-false": ("qwen2_moe", {"qkv_bias": False}, False),
    "hidden-act-swish": ("llama", {"hidden_act": "swish"}, False),
    # biases and widths a Hub config can set beyond the tiny model's defaults
    "llama-mlp-and-attention-bias": ("llama", {"mlp_bias": True, "attention_bias": True}, False),
    "llama-head-dim-wider-than-hidden-over-heads": ("llama", {"head_dim": 32}, False),
    "mistral-head-dim": ("mistral", {"head_dim": 8}, False),
    "qwen3-tied-embeddings": ("qwen3", {"tie_word_embeddings": True}, False),
    "qwen2-tied-embeddings": ("qwen2", {"tie_word_embeddings": True}, False),
    "mixtral-router-jitter-and-aux-loss": ("mixtral", {"router_jitter_noise": 0.1, "output_router_logits": True},
                                           False),
}


@pytest.mark.parametrize("name", MATCHING)
def test_unusual_config_gives_transformers_logits(name, tmp_path):
    from transformers import AutoModelForCausalLM
    arch, overrides, transformers4_rope = MATCHING[name]
    folder = _tiny_folder(tmp_path, arch, overrides, transformers4_rope)
    facts = load_model_facts(folder)
    ours = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = random_tokens(facts.vocab_size, 24, seed=7)
    expected = hf_logits(hf, tokens)
    cache = PagedCache(facts, block_size=4, num_blocks=16)
    got = step_logits(ours, cache, [("s", 0, tokens[:20])])[0]
    assert torch.allclose(got, expected[:20], atol=ATOL), f"{name}: {(got - expected[:20]).abs().max()}"
    for pos in range(20, 24):       # decode over the cache
        got = step_logits(ours, cache, [("s", pos, tokens[pos:pos + 1])])[0]
        assert torch.allclose(got, expected[pos:pos + 1], atol=ATOL), f"{name} at {pos}"


_BASE = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512}
_QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": 64}

# (architecture, fields) -> the window some layer attends over, as transformers builds the layers
WINDOWS = [
    ("MistralForCausalLM", {"sliding_window": 64}, 64),
    ("MixtralForCausalLM", {"sliding_window": 64}, 64),
    ("MistralForCausalLM", {"sliding_window": None}, None),
    ("Qwen2ForCausalLM", {**_QWEN_WINDOW, "max_window_layers": 2}, 64),      # layers 2 and 3 slide
    ("Qwen2ForCausalLM", {**_QWEN_WINDOW, "max_window_layers": 28}, None),   # the Hub's usual: none of 4 layers
    ("Qwen2ForCausalLM", {**_QWEN_WINDOW}, None),                            # max_window_layers 28 by default
    ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 0}, None),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 0}, 4096),   # the default window
    ("Qwen3ForCausalLM", {**_QWEN_WINDOW, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, 64),
    ("Qwen3ForCausalLM", {**_QWEN_WINDOW, "max_window_layers": 0, "layer_types": ["full_attention"] * 4}, None),
    ("Qwen3MoeForCausalLM", {**_QWEN_WINDOW, "max_window_layers": 28}, 64),  # every layer: no max_window_layers
    ("Qwen2MoeForCausalLM", {**_QWEN_WINDOW, "max_window_layers": 1}, 64),   # layer 0 only
    ("Qwen2MoeForCausalLM", {**_QWEN_WINDOW, "max_window_layers": 0}, None),
]


@pytest.mark.parametrize("arch, fields, window", WINDOWS)
def test_a_sliding_window_limits_the_context_to_it(arch, fields, window):
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32} if "Moe" in arch else {}
    facts = facts_from_config({**_BASE, **moe, "architectures": [arch], **fields})
    assert facts.sliding_window == window
    longest = 512 if window is None else min(window, 512)
    assert resolve_max_model_len(facts, None) == longest and resolve_max_model_len(facts, "auto") == longest
    if window is not None and window < 512:
        with pytest.raises(ConfigError) as err:
            resolve_max_model_len(facts, window + 1)
        message = str(err.value)
        assert "\n" not in message and f"sliding_window {window}" in message and f"at most {window}" in message


def test_the_engine_runs_a_sliding_window_model_within_its_window(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvfit import LLM, SamplingParams
    folder = _tiny_folder(tmp_path, "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                                              "layer_types": DROP})
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.config.model.max_model_len is None      # the default, resolved to the window
    prompt = [5, 9, 33, 77, 100]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert list(out[0].outputs[0].token_ids) == expected
    with pytest.raises(ConfigError, match="sliding_window 8"):
        LLM(folder, device="cpu", dtype="float32", kv_cache_memory="4MiB", max_model_len=16)


def test_dtype_wins_over_torch_dtype_as_transformers_reads_them():
    facts = facts_from_config({**_BASE, "dtype": "bfloat16", "torch_dtype": "float16"})
    assert facts.torch_dtype == "bfloat16"
    assert facts_from_config({**_BASE, "torch_dtype": "float16"}).torch_dtype == "float16"


# fields kvfit does not implement: a one-line ConfigError naming the field and its value
REFUSED = [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 8,
                       "original_max_position_embeddings": 128}}, "short_factor must be"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_scaling": {**YARN, "beta_slow": -1.0}}, "beta_slow"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
]


@pytest.mark.parametrize("fields, named", REFUSED)
def test_what_kvfit_does_not_implement_is_refused_in_one_line(fields, named):
    with pytest.raises(ConfigError) as err:
        decoder_config(facts_from_config({**_BASE, "architectures": ["LlamaForCausalLM"], **fields}))
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                                  "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_what_a_config_leaves_out_takes_transformers_defaults_for_its_family(arch):
    """A hand-written config.json without max_position_embeddings or sliding_window gets what transformers' config
    class of that family gives (was 2048 and no window for every family)."""
    import transformers
    moe = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32} if "Mo" in arch or "Mixtral" in arch else {}
    fields = {k: v for k, v in _BASE.items() if k != "max_position_embeddings"}
    facts = facts_from_config({**fields, **moe, "architectures": [arch]})
    reference = getattr(transformers, arch.replace("ForCausalLM", "Config"))()
    assert facts.max_position_embeddings == reference.max_position_embeddings
    assert facts.sliding_window == (reference.sliding_window or None if arch == "MistralForCausalLM" else None)


@pytest.mark.parametrize("rope, context", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),   # Qwen's model cards
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"rope_type": "dynamic", "factor": 2.0}, None),       # kvfit runs dynamic within max_position_embeddings
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 512}, None)])
def test_a_rope_scaling_extends_the_context_as_vllm_derives_it(rope, context):
    """yarn's original_max_position_embeddings x factor, linear's max_position_embeddings x factor (vLLM's derived
    max_model_len): the long context a model card's rope_scaling is added for (--max-model-len past
    max_position_embeddings was refused)."""
    facts = facts_from_config({**_BASE, "rope_scaling": rope})
    assert facts.rope_context == context
    longest = context or 512
    assert resolve_max_model_len(facts, None) == longest and resolve_max_model_len(facts, longest) == longest
    with pytest.raises(ConfigError, match=f"use at most {longest}"):
        resolve_max_model_len(facts, longest + 1)
