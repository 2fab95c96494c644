"""ModelFacts read from a Hugging Face config.json (a folder, a file or a catalog name), through the
model's Architecture entry: its family rules give the layers' structure, its mlp_params the MLP's share
of the parameter count. Parameters are counted from the config (the same tensors the checkpoint holds),
so the weight-size estimate needs no checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import replace

from kvfit.errors import ConfigError
from kvfit.model_facts.architectures import FamilyRules, architecture_of_config, get_architecture
from kvfit.model_facts.facts import DTYPE_ALIASES, DTYPE_BYTES, ModelFacts
from kvfit.model_facts.fields import read_config_json, read_field, read_positive_int
from kvfit.model_facts.rope import rope_config_from_raw
from kvfit.quant_scheme import (MODELOPT_FILE, declares_kv_cache_scales, fp8_kv_cache_by_default,
                                parse_quantization_config, resolve_scheme)

# Bounds far past any published model (widest hidden size about 25,600, intermediate about 53,248, vocabularies about
# 1M, depth about 200): a config past one is corrupt, and planning it would report millions of GiB of weights as if
# more devices could hold them
MAX_HIDDEN_SIZE = 2**20
MAX_INTERMEDIATE_SIZE = 2**22
MAX_VOCAB_SIZE = 2**26
MAX_NUM_LAYERS = 2**14
MAX_NUM_PARAMS = 10**14        # 50x the largest published model (about 2e12): any field, experts included, past reason


def _dtype(cfg: dict, source: str) -> str:
    # transformers >= 4.56 writes "dtype"; where both are present it wins, as transformers reads them
    name = read_field(cfg, "dtype", "str", source) or read_field(cfg, "torch_dtype", "str", source) or "bfloat16"
    name = name.replace("torch.", "")
    if name not in DTYPE_ALIASES:
        raise ConfigError(f"{source}: torch_dtype {name!r} is not one of float32, bfloat16, float16")
    return DTYPE_ALIASES[name]


def _structure(rules: FamilyRules, cfg: dict, num_layers: int, source: str) -> dict:
    """The structure fields of ModelFacts: the family's rules applied to config.json."""
    attention_bias = rules.reads_attention_bias and read_field(cfg, "attention_bias", "bool", source, default=False)
    window = rules.sliding_window(cfg, num_layers, source) if rules.sliding_window is not None else None
    qkv_bias = rules.qkv_bias
    if rules.reads_qkv_bias:
        qkv_bias = read_field(cfg, "qkv_bias", "bool", source, default=rules.qkv_bias)
    return dict(qkv_bias=qkv_bias or attention_bias, o_bias=attention_bias,
                mlp_bias=rules.reads_mlp_bias and read_field(cfg, "mlp_bias", "bool", source, default=False),
                qk_norm=rules.qk_norm,
                sliding_window=window)


def facts_from_config(cfg: dict, source: str = "config.json") -> ModelFacts:
    """Read ModelFacts from a parsed config.json; raise ConfigError on anything missing or malformed."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    arch = architecture_of_config(cfg, source)
    if arch.check_config is not None:
        arch.check_config(cfg, source)
    layers = read_positive_int(cfg, "num_hidden_layers", source, maximum=MAX_NUM_LAYERS)
    hidden = read_positive_int(cfg, "hidden_size", source, maximum=MAX_HIDDEN_SIZE)
    heads = read_positive_int(cfg, "num_attention_heads", source)
    kv_heads = read_positive_int(cfg, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = read_field(cfg, "head_dim", "int", source, minimum=1)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
        head_dim = hidden // heads
    vocab = read_positive_int(cfg, "vocab_size", source, maximum=MAX_VOCAB_SIZE)
    max_pos = read_positive_int(cfg, "max_position_embeddings", source, default=arch.default_max_position_embeddings)
    inter = read_positive_int(cfg, "intermediate_size", source, maximum=MAX_INTERMEDIATE_SIZE)
    tie = read_field(cfg, "tie_word_embeddings", "bool", source, default=False)
    # the models read these from raw; checked here so every command (plan included) rejects them
    read_field(cfg, "rms_norm_eps", "number", source, above=0)
    read_field(cfg, "hidden_act", "str", source)
    kv_lora = rope_dim = None
    if arch.mla:
        kv_lora = read_positive_int(cfg, "kv_lora_rank", source)
        rope_dim = read_positive_int(cfg, "qk_rope_head_dim", source)
    rope = rope_config_from_raw(cfg, head_dim, source, arch.default_rope_theta,
                                arch.default_max_position_embeddings) if kv_lora is None else None
    quant_key = "quantization_config"
    quant = read_field(cfg, quant_key, "object", source, default={})
    if not quant:       # older llm-compressor releases wrote the scheme under compression_config (vLLM reads both)
        quant_key = "compression_config"
        quant = read_field(cfg, quant_key, "object", source, default={})
    scheme = parse_quantization_config(quant, source, quant_key)      # its errors name the key the file has
    kv_cache_scales = declares_kv_cache_scales(quant, source, quant_key)
    fp8_kv_default = fp8_kv_cache_by_default(quant)
    weight_bytes = 1 if scheme is not None else DTYPE_BYTES[_dtype(cfg, source)]
    facts = ModelFacts(
        architecture=arch.name, family=arch.model_type, num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        max_position_embeddings=max_pos, torch_dtype=_dtype(cfg, source), tie_word_embeddings=tie,
        intermediate_size=inter, num_params=0, weight_dtype_bytes=weight_bytes,
        kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim, rope=rope, quantization=scheme,
        kv_cache_scales=kv_cache_scales, fp8_kv_cache_by_default=fp8_kv_default, rope_context=_rope_context(rope, max_pos), raw=dict(cfg),
        **_structure(arch.rules, cfg, layers, source))
    num_params = count_parameters(facts, cfg, source)
    if num_params > MAX_NUM_PARAMS:
        raise ConfigError(f"{source} describes {num_params:.3g} parameters, far more than any published model (about "
                          f"2e12 at most); check its sizes (hidden_size, intermediate_size, num_hidden_layers, "
                          "vocab_size, the expert counts and widths)")
    return replace(facts, num_params=num_params, moe_layout=arch.moe)


def _rope_context(rope, max_pos: int) -> int | None:
    """The context a yarn or linear rope scaling extends the model to, as vLLM derives it (a longer one than
    max_position_embeddings only); None for other rope types (llama3's config already says its length; kvfit
    runs dynamic within max_position_embeddings, where its frequencies are exact)."""
    if rope is None or rope.rope_type not in ("yarn", "linear"):
        return None
    base = rope.original_max_position_embeddings if rope.rope_type == "yarn" else max_pos
    context = int(base * rope.factor)
    return context if context > max_pos else None


def with_quantization(facts: ModelFacts, quantization: str | None) -> ModelFacts:
    """facts with --quantization applied: fp8 on a 16-bit checkpoint quantizes its weights at load; on an
    FP8 checkpoint (or one that quantizes only the KV cache) it must name the checkpoint's method (ConfigError
    otherwise)."""
    quant = facts.raw.get("quantization_config") or facts.raw.get("compression_config")
    kv_only = (str(quant["quant_method"]).lower() if facts.quantization is None and isinstance(quant, dict)
               and quant.get("quant_method") else None)      # a config that quantizes only the KV cache
    scheme = resolve_scheme(facts.quantization, quantization, kv_cache_only=kv_only)
    if scheme is facts.quantization:
        return facts
    return replace(facts, quantization=scheme, weight_dtype_bytes=1)


def _attention_params(f: ModelFacts, cfg: dict, source: str) -> int:
    h, hd = f.hidden_size, f.head_dim
    if f.is_mla:
        nope, rope, v_dim = (read_positive_int(cfg, key, source) for key in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                                            "v_head_dim"))
        q_lora = read_field(cfg, "q_lora_rank", "int", source, minimum=1)
        qk = f.num_attention_heads * (nope + rope)
        q = h * qk if not q_lora else h * q_lora + q_lora + q_lora * qk
        kv = h * (f.kv_lora_rank + rope) + f.kv_lora_rank + f.kv_lora_rank * f.num_attention_heads * (nope + v_dim)
        return q + kv + f.num_attention_heads * v_dim * h
    q_out, kv_out = f.num_attention_heads * hd, f.num_kv_heads * hd
    params = h * q_out + 2 * h * kv_out + q_out * h
    if f.qkv_bias:
        params += q_out + 2 * kv_out
    if f.o_bias:
        params += h
    if f.qk_norm:
        params += 2 * hd  # q_norm and k_norm
    return params


def count_parameters(f: ModelFacts, cfg: dict, source: str = "config.json") -> int:
    """Parameters in the checkpoint's tensors, computed from the config (embeddings included); the MLPs'
    share is the architecture entry's mlp_params."""
    per_layer_fixed = _attention_params(f, cfg, source) + 2 * f.hidden_size  # + two RMSNorms
    embed = f.vocab_size * f.hidden_size
    head = 0 if f.tie_word_embeddings else embed
    mlp = get_architecture(f.architecture, source).mlp_params(f, cfg, source)
    return embed + head + f.num_layers * per_layer_fixed + mlp + f.hidden_size


def load_model_facts(model: str, quantization: str | None = None) -> ModelFacts:
    """Facts for a model folder, a config.json path, or a catalog name (see kvfit.catalog), with
    --quantization applied (with_quantization)."""
    return with_quantization(_load_model_facts(model), quantization)


def _with_modelopt_file(cfg: dict, folder: str) -> dict:
    """cfg with the quantization NVIDIA's older ModelOpt exports declare in hf_quant_config.json (as vLLM reads
    it) where config.json declares none."""
    path = os.path.join(folder, MODELOPT_FILE)
    if not isinstance(cfg, dict) or cfg.get("quantization_config") or cfg.get("compression_config") \
            or not os.path.isfile(path):
        return cfg
    declared = read_config_json(path)
    if not isinstance(declared.get("quantization"), dict):
        return cfg                       # not ModelOpt's form: the loader names it if the weights need it
    quant = {"quant_method": "modelopt", "quantization": declared["quantization"]}
    parse_quantization_config(quant, path, "quantization")        # its errors name the file that declares it,
    declares_kv_cache_scales(quant, path, "quantization")         # not config.json
    return dict(cfg, quantization_config=quant)


def _load_model_facts(model: str) -> ModelFacts:
    from kvfit import catalog
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        return facts_from_config(_with_modelopt_file(read_config_json(path), model), path)
    if os.path.isfile(model) or model.endswith(".json"):
        return facts_from_config(read_config_json(model), model)
    if os.sep in model or model.startswith("."):
        raise ConfigError(f"no model folder or config.json at {model}: check the path, or use a catalog "
                          f"name ({', '.join(catalog.MODELS)})")
    cfg = catalog.model_config(model)
    return facts_from_config(cfg, f"catalog model {model}")
