"""The MLP of each family, torch-free: its parameter count and, for mixture-of-experts families, the routing
and expert layout (MoEConfig) that models/moe.py builds. An Architecture entry names the functions here
that apply to it (its mlp_params and moe), so no code asks which family a model is.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.model_facts.facts import ModelFacts
from kvfit.model_facts.fields import read_field, read_positive_int


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert shapes from config.json, and which layers are sparse."""

    num_experts: int
    top_k: int
    intermediate_size: int          # per expert
    renormalize: bool               # divide the top-k weights by their sum
    round_weights: bool             # Qwen3-MoE rounds the routing weights to the model dtype before use
    sparse_layers: frozenset[int]
    block_name: str                 # the sparse block's name in the checkpoint ("mlp" or "block_sparse_moe")
    expert_names: tuple[str, str, str]   # gate, up, down projection names of one expert
    shared_intermediate_size: int = 0    # Qwen2-MoE: a shared expert (SwiGLU) with a sigmoid gate, else 0
    # an FP8 checkpoint may quantize the router (vLLM 0.26's Qwen3-MoE builds it with the checkpoint's scheme);
    # kvfit reads it dequantized into its 16-bit router. Elsewhere a quantized router is refused, as vLLM never
    # quantizes one there.
    fp8_router: bool = False


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


# routing and expert layout (an entry's `moe`) -----------------------------------------------------
def mixtral_experts(facts: ModelFacts) -> MoEConfig:
    """Mixtral: every layer sparse, experts as wide as intermediate_size, named w1/w3/w2."""
    raw, source = facts.raw, "config.json"
    experts = read_field(raw, "num_local_experts", "int", source, default=8, minimum=1)
    return MoEConfig(num_experts=experts,
                     top_k=read_field(raw, "num_experts_per_tok", "int", source, default=2, minimum=1),
                     intermediate_size=facts.intermediate_size, renormalize=True, round_weights=False,
                     sparse_layers=frozenset(range(facts.num_layers)), block_name="block_sparse_moe",
                     expert_names=("w1", "w3", "w2"))


def qwen_moe_experts(facts: ModelFacts, shared_expert: bool) -> MoEConfig:
    """Qwen2-MoE (shared_expert) and Qwen3-MoE: sparse layers from moe_sparse_layers, moe_intermediate_size
    wide experts."""
    raw, source = facts.raw, "config.json"
    experts, sparse = moe_sparse_layers(facts, raw, source)
    return MoEConfig(num_experts=experts,
                     top_k=read_field(raw, "num_experts_per_tok", "int", source, default=8, minimum=1),
                     intermediate_size=read_field(raw, "moe_intermediate_size", "int", source, required=True,
                                                  minimum=1),
                     renormalize=read_field(raw, "norm_topk_prob", "bool", source, default=False),
                     round_weights=True, sparse_layers=sparse, block_name="mlp",
                     expert_names=("gate_proj", "up_proj", "down_proj"),
                     shared_intermediate_size=read_field(raw, "shared_expert_intermediate_size", "int", source,
                                                         required=True, minimum=1)
                     if shared_expert else 0, fp8_router=not shared_expert)


# parameter counts (an entry's `mlp_params`): every layer's MLP together ---------------------------
def _dense_mlp(f: ModelFacts) -> int:
    """One layer's gate, up and down projections (and their biases)."""
    h = f.hidden_size
    dense = 3 * h * f.intermediate_size
    if f.mlp_bias:
        dense += 2 * f.intermediate_size + h  # gate, up and down biases
    return dense


def dense_mlp_params(f: ModelFacts, cfg: dict, source: str) -> int:
    """A dense MLP in every layer."""
    return f.num_layers * _dense_mlp(f)


def mixtral_mlp_params(f: ModelFacts, cfg: dict, source: str) -> int:
    """A router and num_local_experts dense-sized experts in every layer."""
    experts = read_field(cfg, "num_local_experts", "int", source, default=8, minimum=1)
    return f.num_layers * (f.hidden_size * experts + experts * _dense_mlp(f))


def qwen_moe_mlp_params(f: ModelFacts, cfg: dict, source: str, shared_expert: bool) -> int:
    """Routed experts in moe_sparse_layers (Qwen2-MoE: a shared expert with its own sigmoid gate beside
    them), dense MLPs elsewhere."""
    h, dense = f.hidden_size, _dense_mlp(f)
    experts, sparse = moe_sparse_layers(f, cfg, source)
    num_sparse = len(sparse)
    if not num_sparse:
        return f.num_layers * dense
    moe = h * experts + experts * 3 * h * read_positive_int(cfg, "moe_intermediate_size", source)
    if shared_expert:
        moe += 3 * h * read_positive_int(cfg, "shared_expert_intermediate_size", source) + h
    return num_sparse * moe + (f.num_layers - num_sparse) * dense


def deepseek_mlp_params(f: ModelFacts, cfg: dict, source: str, router_bias: bool) -> int:
    """DeepSeek: first_k_dense_replace dense layers, then routed and shared experts (V3: a bias per routed
    expert on the router, e_score_correction_bias)."""
    h, dense = f.hidden_size, _dense_mlp(f)
    routed = read_field(cfg, "n_routed_experts", "int", source, minimum=1)
    num_dense_first = read_field(cfg, "first_k_dense_replace", "int", source, default=0, minimum=0)
    if routed is None:
        return f.num_layers * dense
    shared = read_field(cfg, "n_shared_experts", "int", source, default=0, minimum=0)
    gate = h * routed + (routed if router_bias else 0)
    moe = gate + (routed + shared) * 3 * h * read_positive_int(cfg, "moe_intermediate_size", source)
    num_sparse = max(f.num_layers - num_dense_first, 0)
    return num_sparse * moe + (f.num_layers - num_sparse) * dense
