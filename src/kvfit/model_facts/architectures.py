"""The architecture registry: one entry per config.json architecture holds all kvfit knows of it.

An entry names the model class that runs it ("module:Class", imported only when a model is built, so
this module needs no torch and never imports models/), its model_type, its family rules (the layers'
structure beyond the shared decoder) and how its parameters and experts are read from config.json. Code
reads fields of the entry; nothing asks which family a model is. A new architecture is one model file
under models/ (none if an existing class runs it) plus one entry in ARCHITECTURES (as vLLM's model
registry and SGLang's EntryClass).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Callable, Mapping

from kvfit.errors import ConfigError
from kvfit.model_facts.experts import (MoEConfig, deepseek_mlp_params, dense_mlp_params, mixtral_experts,
                                       mixtral_mlp_params, qwen_moe_experts, qwen_moe_mlp_params)
from kvfit.model_facts.facts import ModelFacts
from kvfit.model_facts.fields import read_field, show
from kvfit.model_facts.rope import check_phi3_rope
from kvfit.model_facts.windows import every_layer, mistral_layers, qwen2_moe_layers, qwen_layers, when_used


@dataclass(frozen=True)
class FamilyRules:
    """What a family's layers have beyond the shared decoder, as transformers builds them."""

    qkv_bias: bool = False               # q/k/v biases whatever config.json says (Qwen2)
    reads_qkv_bias: bool = False         # config.json's qkv_bias (default: qkv_bias above) decides them (Qwen2-MoE)
    reads_attention_bias: bool = False   # config.json's attention_bias puts biases on q, k, v and o_proj
    reads_mlp_bias: bool = False         # config.json's mlp_bias puts biases on gate, up and down
    qk_norm: bool = False                # per-head RMSNorm of q and k before RoPE
    # the window some layer attends over ((config.json, num_layers, source) -> tokens; windows.py), or None
    sliding_window: Callable[[dict, int, str], int | None] | None = None


@dataclass(frozen=True)
class Architecture:
    """Everything kvfit knows of one architecture; ModelFacts, the parameter count, the capacity estimate
    and the models read it."""

    name: str                        # config.json's "architectures"[0]
    model_type: str                  # config.json's "model_type" (enough without "architectures"); facts.family
    model_class: str | None = None   # "module:Class" that runs it; None: kvfit plans it but cannot run it
    rules: FamilyRules = FamilyRules()
    mla: bool = False                # multi-head latent attention: kv_lora_rank + qk_rope_head_dim per token
    # every layer's MLP parameters together: (facts, config.json, source) -> count (experts.py)
    mlp_params: Callable[[ModelFacts, dict, str], int] = dense_mlp_params
    # routing and expert layout of a mixture-of-experts model kvfit runs (experts.py); None: none
    moe: Callable[[ModelFacts], MoEConfig] | None = None
    # config.json's width of one routed expert when it is not intermediate_size: the capacity estimate's
    # MLP peak is num_experts_per_tok experts of that width
    expert_width_key: str | None = None
    # transformers' defaults for what config.json may leave out
    default_rms_norm_eps: float = 1e-6
    default_rope_theta: float = 10000.0
    default_max_position_embeddings: int = 2048
    # (config.json, source) -> None: a ConfigError for settings the family's transformers class reads its own way,
    # checked before the shared readers (rope.py's check_phi3_rope); None: none
    check_config: Callable[[dict, str], None] | None = None


_DECODER = "kvfit.models.llama:CausalLM"
_MOE_DECODER = "kvfit.models.moe:MoECausalLM"


def _table(*entries: Architecture) -> Mapping[str, Architecture]:
    return MappingProxyType({entry.name: entry for entry in entries})


# config.json architecture -> its entry; the order is the order error messages list them in
ARCHITECTURES = _table(
    Architecture("LlamaForCausalLM", "llama", _DECODER, FamilyRules(reads_attention_bias=True, reads_mlp_bias=True)),
    Architecture("MistralForCausalLM", "mistral", _DECODER, FamilyRules(sliding_window=mistral_layers),
                 default_max_position_embeddings=131072),
    Architecture("Qwen2ForCausalLM", "qwen2", _DECODER, FamilyRules(qkv_bias=True, sliding_window=qwen_layers),
                 default_max_position_embeddings=32768),
    Architecture("Qwen3ForCausalLM", "qwen3", _DECODER, FamilyRules(reads_attention_bias=True, qk_norm=True,
                                                                    sliding_window=qwen_layers),
                 default_max_position_embeddings=32768),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", _MOE_DECODER,
                 FamilyRules(qkv_bias=True, reads_qkv_bias=True, sliding_window=qwen2_moe_layers),
                 mlp_params=partial(qwen_moe_mlp_params, shared_expert=True),
                 moe=partial(qwen_moe_experts, shared_expert=True), expert_width_key="moe_intermediate_size",
                 default_max_position_embeddings=32768),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", _MOE_DECODER,
                 FamilyRules(reads_attention_bias=True, qk_norm=True, sliding_window=when_used),
                 mlp_params=partial(qwen_moe_mlp_params, shared_expert=False),
                 moe=partial(qwen_moe_experts, shared_expert=False), expert_width_key="moe_intermediate_size",
                 default_max_position_embeddings=32768),
    Architecture("MixtralForCausalLM", "mixtral", _MOE_DECODER, FamilyRules(sliding_window=every_layer),
                 mlp_params=mixtral_mlp_params, moe=mixtral_experts, default_rms_norm_eps=1e-5,
                 default_rope_theta=1e6, default_max_position_embeddings=131072),
    # q/k/v and gate/up stored fused (the model splits them into kvfit's fused parameters' parts at load)
    Architecture("Phi3ForCausalLM", "phi3", "kvfit.models.phi3:Phi3CausalLM", FamilyRules(sliding_window=every_layer),
                 default_rms_norm_eps=1e-5, default_max_position_embeddings=4096, check_config=check_phi3_rope),
    Architecture("DeepseekV2ForCausalLM", "deepseek_v2", mla=True,
                 mlp_params=partial(deepseek_mlp_params, router_bias=False), expert_width_key="moe_intermediate_size"),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", mla=True,
                 mlp_params=partial(deepseek_mlp_params, router_bias=True), expert_width_key="moe_intermediate_size"),
)


def all_architectures() -> tuple[Architecture, ...]:
    """Every registered entry, in the registry's order."""
    return tuple(ARCHITECTURES.values())


def find_architecture(name: str) -> Architecture | None:
    """The entry of config.json architecture `name`, or None when kvfit does not know it."""
    return ARCHITECTURES.get(name)


def get_architecture(name: str, source: str = "config.json") -> Architecture:
    """The entry of `name`; an unknown one is a ConfigError listing the supported architectures."""
    entry = find_architecture(name)
    if entry is None:
        raise ConfigError(f"{source}: unsupported architecture {name!r}; supported: "
                          f"{', '.join(ARCHITECTURES)}")
    return entry


def architecture_of_config(cfg: dict, source: str = "config.json") -> Architecture:
    """The entry config.json names: its "architectures"[0], else the entry of its "model_type"."""
    archs = read_field(cfg, "architectures", "list", source, default=[])
    model_type = read_field(cfg, "model_type", "str", source)
    if archs:
        name = archs[0]
        if not isinstance(name, str):
            raise ConfigError(f"{source}: 'architectures' must list architecture names, got {show(archs)}")
        return get_architecture(name, source)
    by_type = next((entry for entry in all_architectures() if entry.model_type == model_type), None)
    return by_type or get_architecture(model_type or "<none>", source)


def moe_config(facts: ModelFacts) -> MoEConfig:
    """The routing and expert layout of a mixture-of-experts model kvfit runs; any other is a ConfigError."""
    entry = find_architecture(facts.architecture)
    if entry is None or entry.moe is None:
        raise ConfigError(f"{facts.architecture} is not a mixture-of-experts model kvfit runs")
    cfg = entry.moe(facts)
    if cfg.sparse_layers and cfg.top_k > cfg.num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok {cfg.top_k} is more than the {cfg.num_experts} experts")
    return cfg
