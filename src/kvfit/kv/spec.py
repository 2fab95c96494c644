"""KVSpec: the one definition of bytes per block and of the cache layout. No torch.

Per layer the cache holds K and V, each ``[num_blocks, block_size, kv_heads_per_rank, head_dim]``
(MLA: one latent tensor ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``).
Token slot ``s`` lives at ``block = s // block_size, offset = s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.errors import ConfigError
from kvfit.model_facts import DTYPE_ALIASES, DTYPE_BYTES, ModelFacts

# Slot id for a token whose K/V must not be written (padding in CUDA-graph batches); kernels skip it.
PADDING_SLOT_ID = -1

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")
# fp8 caches store e4m3 values with per-layer k/v scales (models/kv_scales.py): no per-block scale bytes.
_KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8_e4m3": 1}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """Canonical cache dtype: 'auto' means the model's dtype; 'fp8' means e4m3."""
    name = str(kv_cache_dtype).lower()
    if name == "auto":
        return DTYPE_ALIASES[model_dtype]
    if name in ("fp8", "fp8_e4m3"):
        return "fp8_e4m3"
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each rank holds: split when divisible, replicated (1) when tp is a multiple of them."""
    if tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if num_kv_heads % tensor_parallel_size == 0:
        return num_kv_heads // tensor_parallel_size
    if tensor_parallel_size > num_kv_heads and tensor_parallel_size % num_kv_heads == 0:
        return 1
    raise ConfigError(
        f"--tensor-parallel-size {tensor_parallel_size} does not fit the model's {num_kv_heads} KV heads: "
        f"use a divisor of {num_kv_heads} or a multiple of it")


def num_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens, the last one possibly part full: ceil(num_tokens / block_size).
    The one tokens -> blocks rule: the manager, admission, the planner, the runner and the server use it."""
    return -(-num_tokens // block_size)


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
            or block_size & (block_size - 1):
        raise ConfigError(f"--block-size must be a positive power of two (e.g. 16), got {block_size!r}")
    return block_size


@dataclass(frozen=True)
class KVSpec:
    """Per model, per rank: cache layout and bytes per block (all layers, K and V)."""

    num_layers: int
    block_size: int
    kv_heads_per_rank: int
    head_dim: int
    dtype: str                     # canonical: float32, bfloat16, float16, fp8_e4m3
    mla: bool = False              # one latent tensor per layer instead of K and V

    def __post_init__(self):
        check_block_size(self.block_size)
        assert self.num_layers > 0 and self.kv_heads_per_rank > 0 and self.head_dim > 0
        assert self.dtype in _KV_DTYPE_BYTES, self.dtype

    @classmethod
    def from_model(cls, facts: ModelFacts, block_size: int = 16, kv_cache_dtype: str = "auto",
                   tensor_parallel_size: int = 1, model_dtype: str | None = None) -> "KVSpec":
        """model_dtype: the dtype the model runs in (--dtype); 'auto' caches use it, or fp8 where the checkpoint
        declares an fp8 KV cache (facts.fp8_kv_cache_by_default, as vLLM resolves auto)."""
        if str(kv_cache_dtype).lower() == "auto" and facts.fp8_kv_cache_by_default:
            kv_cache_dtype = "fp8"
        dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype or facts.torch_dtype)
        if facts.is_mla:
            # The latent is shared by all heads, so every rank keeps all of it.
            kv_heads_per_rank(facts.num_attention_heads, tensor_parallel_size)
            return cls(facts.num_layers, check_block_size(block_size), 1, facts.kv_head_dim, dtype, mla=True)
        heads = kv_heads_per_rank(facts.num_kv_heads, tensor_parallel_size)
        return cls(facts.num_layers, check_block_size(block_size), heads, facts.head_dim, dtype)

    @property
    def dtype_bytes(self) -> int:
        return _KV_DTYPE_BYTES[self.dtype]

    @property
    def tensors_per_layer(self) -> int:
        return 1 if self.mla else 2

    @property
    def elements_per_block(self) -> int:
        """Elements of one block in one per-layer cache tensor."""
        return self.block_size * self.kv_heads_per_rank * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """2 x layers x block_size x kv_heads_per_rank x head_dim x dtype_bytes (MLA: no factor 2)."""
        return self.tensors_per_layer * self.num_layers * self.elements_per_block * self.dtype_bytes

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one per-layer cache tensor (K, V, or the MLA latent)."""
        return (num_blocks, self.block_size, self.kv_heads_per_rank, self.head_dim)

    def max_addressable_blocks(self, max_element_offset: int) -> int:
        """Largest block count whose per-layer tensor has every element offset <= max_element_offset."""
        return (max_element_offset + 1) // self.elements_per_block

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return num_blocks_for_tokens(num_tokens, self.block_size)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "block_size": self.block_size,
                "kv_heads_per_rank": self.kv_heads_per_rank, "head_dim": self.head_dim,
                "kv_cache_dtype": self.dtype, "mla": self.mla, "bytes_per_block": self.bytes_per_block}
