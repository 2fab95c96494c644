"""ModelFacts: the numbers of one model that sizing and building it depend on (no torch).

loading.py reads them from a config.json through the model's Architecture entry (architectures.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvfit.model_facts.rope import RopeConfig
from kvfit.quant_scheme import Fp8Scheme

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
    family: str                      # the architecture's model_type (its Architecture entry)
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
    # the layers' structure: the Architecture entry's FamilyRules applied to config.json
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
    kv_cache_scales: bool = False    # quantization_config's kv_cache_scheme: the checkpoint carries fp8 k/v scales
    # --kv-cache-dtype auto means fp8 for this checkpoint: compressed-tensors' kv_cache_scheme or ModelOpt's FP8 KV
    # cache (vLLM 0.26 resolves auto so: utils/torch_utils.resolve_kv_cache_dtype_string, the attention layer)
    fp8_kv_cache_by_default: bool = False
    # the context a yarn or linear rope scaling extends the model to (vLLM's derived max_model_len: yarn's
    # original_max_position_embeddings x factor, linear's max_position_embeddings x factor); None: not extended
    rope_context: int | None = None
    # a mixture-of-experts model's routing and expert layout, read when asked (its Architecture entry's `moe`,
    # experts.MoEConfig; None: dense)
    moe_layout: Callable[[ModelFacts], Any] | None = field(default=None, compare=False, repr=False)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def context_len(self) -> int:
        """The longest sequence the model takes: its rope scaling's context, else max_position_embeddings."""
        if self.rope is not None and self.rope.rope_type == "longrope":
            return min(self.rope.original_max_position_embeddings, self.max_position_embeddings)
        return self.rope_context or self.max_position_embeddings

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
        routers = self.num_layers * self.hidden_size * self._num_routed_experts
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return max(self.num_params - embed - routers - norms - self._kept_linear_params(), 0)

    @property
    def _num_routed_experts(self) -> int:
        """config.json's expert count (0 for a dense model), in any of the families' names."""
        return int(self.raw.get("num_experts") or self.raw.get("num_local_experts") or
                   self.raw.get("n_routed_experts") or 0)

    def _kept_linear_params(self) -> int:
        """Parameters of the decoder's linear layers that the scheme keeps 16-bit (its ignore list, or a layer its
        targets miss: Fp8Scheme.quantizes on each checkpoint name): attention, dense MLPs, MoE experts and shared
        experts. MLA attention is counted as quantized."""
        scheme = self.quantization
        if scheme is None or not (scheme.ignore or scheme.targets) or self.is_mla:
            return 0
        h, q_out, kv_out = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = {"self_attn.q_proj": h * q_out, "self_attn.k_proj": h * kv_out, "self_attn.v_proj": h * kv_out,
                     "self_attn.o_proj": q_out * h}
        dense = {"mlp.gate_proj": h * self.intermediate_size, "mlp.up_proj": h * self.intermediate_size,
                 "mlp.down_proj": self.intermediate_size * h}
        moe = self.moe_layout(self) if self.moe_layout is not None else None
        kept = 0
        for layer in range(self.num_layers):
            sizes = dict(attention)
            if moe is None or layer not in moe.sparse_layers:
                sizes.update(dense)
            else:
                # a layer's experts are all FP8 or all 16-bit, as its first expert's first projection says (SparseMoE
                # decides so; a checkpoint that mixes them is refused): one name, not num_experts x 3
                if not scheme.quantizes(f"model.layers.{layer}.{moe.block_name}.experts.0.{moe.expert_names[0]}"):
                    kept += moe.num_experts * 3 * h * moe.intermediate_size
                if moe.shared_intermediate_size:
                    sizes.update({f"mlp.shared_expert.{name}": h * moe.shared_intermediate_size
                                  for name in ("gate_proj", "up_proj", "down_proj")})
            kept += sum(size for name, size in sizes.items() if not scheme.quantizes(f"model.layers.{layer}.{name}"))
        return kept

    @property
    def weight_scale_bytes(self) -> int:
        """fp32 scales of the FP8 weights: one per block of block_size, else (at most) one per output row."""
        scheme = self.quantization
        if scheme is None:
            return 0
        if scheme.block_size is not None:
            return self.quantized_params // (scheme.block_size[0] * scheme.block_size[1]) * 4
        return self.quantized_params // self.hidden_size * 4       # rows ~ params / input width


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
