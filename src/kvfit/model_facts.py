"""Model facts read from a Hugging Face config.json: what capacity planning and the models need.

No torch here: `kvfit plan` must run anywhere. Parameter counts are computed from the config
(the same tensors the checkpoint holds), so the weight-size estimate needs no checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from kvfit.errors import ConfigError
from kvfit.quant_scheme import Fp8Scheme, parse_quantization_config, resolve_scheme

# architecture name in config.json -> family used by planning and the models
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


@dataclass(frozen=True)
class FamilyRules:
    """What a family's layers have beyond the shared decoder, as transformers builds them."""

    qkv_bias: bool = False               # q/k/v biases whatever config.json says (Qwen2)
    reads_attention_bias: bool = False   # config.json's attention_bias puts biases on q, k, v and o_proj
    reads_mlp_bias: bool = False         # config.json's mlp_bias puts biases on gate, up and down
    qk_norm: bool = False                # per-head RMSNorm of q and k before RoPE
    reads_sliding_window: bool = False   # config.json's sliding_window limits attention


# family -> its rules; the parameter count and the models read them through ModelFacts
FAMILY_RULES = {
    "llama": FamilyRules(reads_attention_bias=True, reads_mlp_bias=True),
    "mistral": FamilyRules(reads_sliding_window=True),
    "qwen2": FamilyRules(qkv_bias=True),
    "qwen3": FamilyRules(reads_attention_bias=True, qk_norm=True),
    "qwen2_moe": FamilyRules(qkv_bias=True),
    "qwen3_moe": FamilyRules(reads_attention_bias=True, qk_norm=True),
    "mixtral": FamilyRules(reads_sliding_window=True),
    "deepseek_v2": FamilyRules(),
    "deepseek_v3": FamilyRules(),
}

DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelFacts:
    """The numbers of one model that sizing and building it depend on."""

    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    tie_word_embeddings: bool
    intermediate_size: int
    num_params: int
    weight_dtype_bytes: int          # bytes per parameter of the linear layers (fp8: 1)
    # the layers' structure, from the family's rules and config.json (FAMILY_RULES)
    qkv_bias: bool = False           # biases on the q, k and v projections
    o_bias: bool = False             # a bias on o_proj
    mlp_bias: bool = False           # biases on the gate, up and down projections
    qk_norm: bool = False            # per-head RMSNorm of q and k before RoPE
    sliding_window: int | None = None   # tokens a position attends back over (None: the whole context)
    # MLA (DeepSeek): one latent of kv_lora_rank + qk_rope_head_dim per token per layer
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    # RoPE settings, validated here so every command refuses the same configs (None for MLA, whose
    # rotary embedding kvfit plans but does not run)
    rope: RopeConfig | None = None
    # FP8 weights (the checkpoint's quantization_config, or --quantization fp8); None: 16-bit weights
    quantization: Fp8Scheme | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def kv_head_dim(self) -> int:
        """Elements per token per KV head in the cache (MLA: the latent width)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.head_dim

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight: with FP8, the layers' linear weights at one byte and their fp32 scales, the
        embedding, lm_head, norms and routers in the model dtype (as the checkpoints keep them)."""
        if self.quantization is None:
            return self.num_params * self.weight_dtype_bytes
        kept = self.num_params - self.quantized_params
        return self.quantized_params * self.weight_dtype_bytes + kept * DTYPE_BYTES[self.torch_dtype] + \
            self.weight_scale_bytes

    @property
    def quantized_params(self) -> int:
        """Parameters held in FP8: everything but the embedding, lm_head, norms and routers."""
        if self.quantization is None:
            return 0
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        routers = self.num_layers * self.hidden_size * int(self.raw.get("num_experts") or
                                                           self.raw.get("num_local_experts") or
                                                           self.raw.get("n_routed_experts") or 0)
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return max(self.num_params - embed - routers - norms, 0)

    @property
    def weight_scale_bytes(self) -> int:
        """fp32 scales of the FP8 weights: one per block of block_size, else (at most) one per output row."""
        scheme = self.quantization
        if scheme is None:
            return 0
        if scheme.block_size is not None:
            return self.quantized_params // (scheme.block_size[0] * scheme.block_size[1]) * 4
        return self.quantized_params // self.hidden_size * 4       # rows ~ params / input width


def _show(value) -> str:
    """repr of a config value, cut short so an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite_float(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:   # an integer past float's range
        return None
    return number if math.isfinite(number) else None


# kind -> (check, what the error says is allowed)
_KINDS = {
    "bool": (lambda v: isinstance(v, bool), "true or false (a JSON boolean)"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: _finite_float(v) is not None, "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a JSON list"),
}


def read_field(cfg: dict, name: str, kind: str, source: str = "config.json", default=None, required: bool = False,
               minimum=None, above=None):
    """cfg[name] checked against kind (bool, int, number, str, object, list) and the bounds (value >= minimum,
    value > above); absent or null gives default, as transformers does. Anything else is a one-line
    ConfigError naming source, the field, the value and what is allowed. A "number" comes back as a float.
    """
    value = cfg.get(name)
    if value is None:
        if required and default is None:
            raise ConfigError(f"{source}: missing '{name}'; a Hugging Face config for this architecture needs it")
        return default
    check, allowed = _KINDS[kind]
    in_range = check(value) and (minimum is None or value >= minimum) and (above is None or value > above)
    if not in_range:
        raise ConfigError(f"{source}: '{name}' must be {_allowed(kind, allowed, minimum, above)}, got {_show(value)}")
    return float(value) if kind == "number" else value


def _allowed(kind: str, allowed: str, minimum, above) -> str:
    if kind == "int" and minimum == 1 and above is None:
        return "a positive integer"
    if kind == "number" and above == 0 and minimum is None:
        return "a positive finite number"
    return allowed + "".join(f" {op} {bound}" for op, bound in ((">=", minimum), (">", above)) if bound is not None)


def _positive_int(cfg: dict, key: str, source: str, default=None) -> int:
    return read_field(cfg, key, "int", source, default=default, required=True, minimum=1)


def _architecture(cfg: dict, source: str) -> str:
    archs = read_field(cfg, "architectures", "list", source, default=[])
    model_type = read_field(cfg, "model_type", "str", source)
    if archs:
        arch = archs[0]
        if not isinstance(arch, str):
            raise ConfigError(f"{source}: 'architectures' must list architecture names, got {_show(archs)}")
    else:
        arch = _MODEL_TYPE_TO_ARCH.get(model_type, model_type or "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _dtype(cfg: dict, source: str) -> str:
    name = read_field(cfg, "torch_dtype", "str", source) or read_field(cfg, "dtype", "str", source) or "bfloat16"
    name = name.replace("torch.", "")
    if name not in DTYPE_ALIASES:
        raise ConfigError(f"{source}: torch_dtype {name!r} is not one of float32, bfloat16, float16")
    return DTYPE_ALIASES[name]


def _structure(family: str, cfg: dict, source: str) -> dict:
    """The structure fields of ModelFacts: the family's rules applied to config.json."""
    rules = FAMILY_RULES[family]
    attention_bias = rules.reads_attention_bias and read_field(cfg, "attention_bias", "bool", source, default=False)
    window = None
    if rules.reads_sliding_window and cfg.get("sliding_window") is not None:
        window = _positive_int(cfg, "sliding_window", source)
    return dict(qkv_bias=rules.qkv_bias or attention_bias, o_bias=attention_bias,
                mlp_bias=rules.reads_mlp_bias and read_field(cfg, "mlp_bias", "bool", source, default=False),
                qk_norm=rules.qk_norm,
                sliding_window=window)


# RoPE: both config styles are read, transformers 5 (`rope_parameters: {rope_type, rope_theta, ...}`) and
# transformers 4 (`rope_theta` + `rope_scaling: {rope_type | type, ...}`); models/rope.py applies them.
ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """The RoPE settings of one model (all layers share them)."""

    head_dim: int
    theta: float = DEFAULT_ROPE_THETA
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def _rope_dict(raw: dict, source: str) -> dict:
    params = read_field(raw, "rope_parameters", "object", source, default={})
    if "full_attention" in params:   # per-layer-type form
        params = read_field(params, "full_attention", "object", f"{source} rope_parameters", default={})
    merged = dict(read_field(raw, "rope_scaling", "object", source, default={}))
    merged.update(params)
    if "rope_theta" not in merged and raw.get("rope_theta") is not None:
        merged["rope_theta"] = raw["rope_theta"]
    return merged


def rope_config_from_raw(raw: dict, head_dim: int, source: str = "config.json") -> RopeConfig:
    """Read RoPE settings from a config.json dict; unsupported or out-of-range settings are a ConfigError."""
    d = _rope_dict(raw, source)
    where = f"{source} (rope_theta / rope_scaling / rope_parameters)"
    # a top-level rope_theta shadowed by rope_parameters' is still checked: a malformed one is a corrupt file
    read_field(raw, "rope_theta", "number", source, above=0)
    rope_type = read_field(d, "rope_type", "str", where) or read_field(d, "type", "str", where) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if read_field(d, "partial_rotary_factor", "number", where, default=1.0) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1.0 is not supported; use a model with full RoPE")
    # null means the default (as transformers reads it); 0 or a negative theta is an error, not the default
    theta = read_field(d, "rope_theta", "number", where, default=DEFAULT_ROPE_THETA, above=0)
    if rope_type == "default":
        return RopeConfig(head_dim=head_dim, theta=theta)
    factor = read_field(d, "factor", "number", where, required=True, above=0)
    if rope_type == "linear":
        return RopeConfig(head_dim=head_dim, theta=theta, rope_type="linear", factor=factor)
    low, high = (read_field(d, key, "number", where, required=True, above=0)
                 for key in ("low_freq_factor", "high_freq_factor"))
    if not high > low:   # the llama3 smoothing divides by high - low
        raise ConfigError(f"{where}: high_freq_factor must be greater than low_freq_factor, got {high} <= {low}")
    original = read_field(d, "original_max_position_embeddings", "int", where, required=True,
                          minimum=1)
    return RopeConfig(head_dim=head_dim, theta=theta, rope_type="llama3", factor=factor, low_freq_factor=low,
                      high_freq_factor=high, original_max_position_embeddings=original)


def facts_from_config(cfg: dict, source: str = "config.json") -> ModelFacts:
    """Read ModelFacts from a parsed config.json; raise ConfigError on anything missing or malformed."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    arch = _architecture(cfg, source)
    family = SUPPORTED_ARCHITECTURES[arch]
    layers = _positive_int(cfg, "num_hidden_layers", source)
    hidden = _positive_int(cfg, "hidden_size", source)
    heads = _positive_int(cfg, "num_attention_heads", source)
    kv_heads = _positive_int(cfg, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = read_field(cfg, "head_dim", "int", source, minimum=1)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
        head_dim = hidden // heads
    vocab = _positive_int(cfg, "vocab_size", source)
    max_pos = _positive_int(cfg, "max_position_embeddings", source, default=2048)
    inter = _positive_int(cfg, "intermediate_size", source)
    tie = read_field(cfg, "tie_word_embeddings", "bool", source, default=False)
    # the models read these from raw; checked here so every command (plan included) rejects them
    read_field(cfg, "rms_norm_eps", "number", source, above=0)
    read_field(cfg, "hidden_act", "str", source)
    kv_lora = rope_dim = None
    if family.startswith("deepseek"):
        kv_lora = _positive_int(cfg, "kv_lora_rank", source)
        rope_dim = _positive_int(cfg, "qk_rope_head_dim", source)
    rope = rope_config_from_raw(cfg, head_dim, source) if kv_lora is None else None
    quant = read_field(cfg, "quantization_config", "object", source, default={})
    scheme = parse_quantization_config(quant, source)
    weight_bytes = 1 if scheme is not None else DTYPE_BYTES[_dtype(cfg, source)]
    facts = ModelFacts(
        architecture=arch, family=family, num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        max_position_embeddings=max_pos, torch_dtype=_dtype(cfg, source), tie_word_embeddings=tie,
        intermediate_size=inter, num_params=0, weight_dtype_bytes=weight_bytes,
        kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim, rope=rope, quantization=scheme, raw=dict(cfg),
        **_structure(family, cfg, source))
    return _with_params(facts, cfg, source)


def with_quantization(facts: ModelFacts, quantization: str | None) -> ModelFacts:
    """facts with --quantization applied: fp8 on a 16-bit checkpoint quantizes its weights at load; on an
    FP8 checkpoint it must name the checkpoint's method (ConfigError otherwise)."""
    from dataclasses import replace
    scheme = resolve_scheme(facts.quantization, quantization)
    if scheme is facts.quantization:
        return facts
    return replace(facts, quantization=scheme, weight_dtype_bytes=1)


def _with_params(facts: ModelFacts, cfg: dict, source: str) -> ModelFacts:
    from dataclasses import replace
    return replace(facts, num_params=count_parameters(facts, cfg, source))


def _attention_params(f: ModelFacts, cfg: dict, source: str) -> int:
    h, hd = f.hidden_size, f.head_dim
    if f.is_mla:
        nope, rope, v_dim = (_positive_int(cfg, key, source) for key in ("qk_nope_head_dim", "qk_rope_head_dim",
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


def moe_sparse_layers(f: ModelFacts, cfg: dict, source: str = "config.json") -> tuple[int, frozenset[int]]:
    """(experts, the layers that use them) of a Qwen2-MoE / Qwen3-MoE config: every decoder_sparse_step-th
    layer but mlp_only_layers (none when the config has no experts)."""
    # Hub configs say num_experts; transformers >= 5 saves it as num_local_experts
    experts = read_field(cfg, "num_experts", "int", source, minimum=0)
    if experts is None:
        experts = read_field(cfg, "num_local_experts", "int", source, default=0, minimum=0)
    step = read_field(cfg, "decoder_sparse_step", "int", source, default=1, minimum=1)
    dense_only = read_field(cfg, "mlp_only_layers", "list", source, default=[])
    if experts == 0:
        return 0, frozenset()
    return experts, frozenset(i for i in range(f.num_layers) if i not in dense_only and (i + 1) % step == 0)


def _mlp_params(f: ModelFacts, cfg: dict, source: str) -> int:
    """The MLP parameters of every layer together (dense, or routed and shared experts)."""
    h = f.hidden_size
    dense = 3 * h * f.intermediate_size
    if f.mlp_bias:
        dense += 2 * f.intermediate_size + h  # gate, up and down biases
    if f.family == "mixtral":
        experts = read_field(cfg, "num_local_experts", "int", source, default=8, minimum=1)
        return f.num_layers * (h * experts + experts * dense)
    if f.family in ("qwen2_moe", "qwen3_moe"):
        experts, sparse = moe_sparse_layers(f, cfg, source)
        num_sparse = len(sparse)
        if not num_sparse:
            return f.num_layers * dense
        moe = h * experts + experts * 3 * h * _positive_int(cfg, "moe_intermediate_size", source)
        if f.family == "qwen2_moe":     # a shared expert beside the routed ones, with its own sigmoid gate
            moe += 3 * h * _positive_int(cfg, "shared_expert_intermediate_size", source) + h
        return num_sparse * moe + (f.num_layers - num_sparse) * dense
    if f.family.startswith("deepseek"):
        routed = read_field(cfg, "n_routed_experts", "int", source, minimum=1)
        num_dense_first = read_field(cfg, "first_k_dense_replace", "int", source, default=0, minimum=0)
        if routed is None:
            return f.num_layers * dense
        shared = read_field(cfg, "n_shared_experts", "int", source, default=0, minimum=0)
        gate = h * routed + (routed if f.family == "deepseek_v3" else 0)  # v3: e_score_correction_bias
        moe = gate + (routed + shared) * 3 * h * _positive_int(cfg, "moe_intermediate_size", source)
        num_sparse = max(f.num_layers - num_dense_first, 0)
        return num_sparse * moe + (f.num_layers - num_sparse) * dense
    return f.num_layers * dense


def count_parameters(f: ModelFacts, cfg: dict, source: str = "config.json") -> int:
    """Parameters in the checkpoint's tensors, computed from the config (embeddings included)."""
    per_layer_fixed = _attention_params(f, cfg, source) + 2 * f.hidden_size  # + two RMSNorms
    embed = f.vocab_size * f.hidden_size
    head = 0 if f.tie_word_embeddings else embed
    return embed + head + f.num_layers * per_layer_fixed + _mlp_params(f, cfg, source) + f.hidden_size


def read_json_object(path: str) -> dict:
    """Parse a JSON file that must hold an object; malformed, too deeply nested or with integers past
    Python's 4,300 digits, it is a one-line ConfigError naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to parse; fix or replace the file") from None
    except (ValueError, UnicodeDecodeError) as exc:   # JSONDecodeError, and the int digit limit
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path} is not valid JSON ({reason}); fix or replace the file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}; fix or replace the file")
    return data


def read_config_json(path: str) -> dict:
    """Parse a config.json file; a missing or malformed file is a ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json at {path}: give a Hugging Face model folder, a config.json or a catalog name")
    return read_json_object(path)


def load_model_facts(model: str, quantization: str | None = None) -> ModelFacts:
    """Facts for a model folder, a config.json path, or a catalog name (see kvfit.catalog), with
    --quantization applied (with_quantization)."""
    return with_quantization(_load_model_facts(model), quantization)


def _load_model_facts(model: str) -> ModelFacts:
    from kvfit import catalog
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        return facts_from_config(read_config_json(path), path)
    if os.path.isfile(model) or model.endswith(".json"):
        return facts_from_config(read_config_json(model), model)
    if os.sep in model or model.startswith("."):
        raise ConfigError(f"no model folder or config.json at {model}: check the path, or use a catalog "
                          f"name ({', '.join(catalog.MODELS)})")
    cfg = catalog.model_config(model)
    return facts_from_config(cfg, f"catalog model {model}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelFacts", "facts_from_config", "load_model_facts", "count_parameters", "SUPPORTED_ARCHITECTURES",
           "FAMILY_RULES", "FamilyRules", "DTYPE_ALIASES", "DTYPE_BYTES", "read_config_json", "read_json_object",
           "read_field", "ceil_div", "RopeConfig", "rope_config_from_raw", "ROPE_TYPES", "DEFAULT_ROPE_THETA",
           "moe_sparse_layers", "with_quantization"]
