"""Scales of an fp8 KV cache, per attention layer: k ~= k_cache * k_scale, v ~= v_cache * v_scale.

Where they come from, as in vLLM: the checkpoint (compressed-tensors' kv_cache_scheme writes
`self_attn.k_scale` and `v_scale`; older checkpoints `k_proj.output_scale` / `v_proj.output_scale`, or one
`kv_scale` for both; ModelOpt `k_proj.k_scale` / `v_proj.v_scale`; `qkv_proj.k_scale` and `attn.k_scale` too;
a scale per layer or one per KV head), else the first batch (--calculate-kv-scales: the layer's amax / 200 for k and / 100 for v, vLLM's constants), else 1.0. A 16-bit cache holds k and v exactly,
so with one the scales are read and not used.

How they apply (prefill, decode, split-K, cascade and mixed steps all honour them): k and v are divided by their
scales before the cache write; the query is multiplied by k_scale (q . (s K) = (s q) . K) and the attention
output by v_scale (softmax weights sum to one: P (s V) = s (P V)), per KV head and the query heads that read it;
the attention kernels apply the output's scale themselves (AttentionBackend.attend's out_scale). The attention
layer hands them to its backend's project_write_kv and attend_step; the Triton backend's one-launch norm + RoPE +
cache write (attention/fused_write.py) divides and multiplies by them itself, except on the step that calculates them (the
one-token GEMV write is not taken while scales apply). The scales are device tensors changed in place,
so CUDA graphs captured before a calculation replay with its values.
"""

from __future__ import annotations

import torch

from kvfit.errors import ConfigError
from kvfit.models.quant.linear import scale_values

K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0      # vLLM's Q/K and V scale constants
MIN_SCALE = 1e-8                                       # an all-zero first batch must not give a zero scale
# checkpoint name suffix -> the scales it sets (relative to the attention module)
# (the longer suffixes first): ModelOpt writes them under k_proj / v_proj, llm-compressor's fused-qkv models under
# qkv_proj, and some exports under an inner `attn` module
CHECKPOINT_NAMES = ((".k_proj.output_scale", ("k_scale",)), (".v_proj.output_scale", ("v_scale",)),
                    (".k_proj.k_scale", ("k_scale",)), (".v_proj.v_scale", ("v_scale",)),
                    (".qkv_proj.k_scale", ("k_scale",)), (".qkv_proj.v_scale", ("v_scale",)),
                    (".attn.k_scale", ("k_scale",)), (".attn.v_scale", ("v_scale",)),
                    (".kv_scale", ("k_scale", "v_scale")), (".k_scale", ("k_scale",)), (".v_scale", ("v_scale",)))


def kv_scale_targets(name: str) -> list[tuple[str, str]]:
    """(attention module name, "k_scale" or "v_scale") for each scale a checkpoint tensor sets; [] for others."""
    for suffix, scales in CHECKPOINT_NAMES:
        if name.endswith(suffix):
            return [(name[:-len(suffix)], scale) for scale in scales]
    return []


class KVScales(torch.nn.Module):
    """One attention layer's k/v cache scales: one per KV head of this rank (fp32 buffers)."""

    def __init__(self, total_kv_heads: int, first_kv_head: int, num_kv_heads: int, num_q_heads: int, device):
        super().__init__()
        self.total_kv_heads, self.first_kv_head, self.num_kv_heads = total_kv_heads, first_kv_head, num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device),
                             persistent=False)
        self.applies = False            # with an fp8 cache: scales other than 1.0 loaded, or a calculation set up
        self.calculate_next = False     # the next forward with a cache sets the scales from its k and v
        self.loaded = False             # a checkpoint tensor set a scale of this layer
        self.read: set[str] = set()     # which of "k_scale", "v_scale" it set

    @torch.no_grad()
    def load(self, which: str, name: str, source) -> None:
        """Read checkpoint tensor `name` into the k or v scale: one value for the layer, or one per KV head."""
        value = scale_values(source, name, None).reshape(-1)
        if value.numel() not in (1, self.total_kv_heads):
            raise ConfigError(f"checkpoint tensor {name} holds {value.numel()} values; a KV cache scale is one "
                              f"per layer or one per KV head ({self.total_kv_heads}): the checkpoint does not match "
                              "config.json")
        if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            raise ConfigError(f"checkpoint tensor {name} holds a KV cache scale that is not a positive number; "
                              "the checkpoint is damaged (re-download it)")
        mine = value.expand(self.total_kv_heads)[self.first_kv_head:self.first_kv_head + self.num_kv_heads]
        getattr(self, which).copy_(mine)
        self.loaded = True
        self.read.add(which)
        self.applies = self.applies or bool((value != 1).any())

    @torch.no_grad()
    def share_the_one_read(self) -> None:
        """A layer whose checkpoint gave k_scale or v_scale alone: the other takes it (vLLM's fp8 and ModelOpt KV
        cache methods do so: BaseKVCacheMethod.process_weights_after_loading, the larger of the two where the
        other was never set)."""
        (which,) = self.read
        other = "v_scale" if which == "k_scale" else "k_scale"
        getattr(self, other).copy_(getattr(self, which))

    def enable_calculation(self) -> None:
        """--calculate-kv-scales: the scaled path from now on (graphs captured next include it), scales 1.0
        until start_calculation() and the next forward."""
        self.applies = True

    def for_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, Hkv, D] as the cache stores them (divided by their scales); the first batch after
        start of a calculation sets the scales first."""
        if self.calculate_next:
            self.k_scale.copy_((k.abs().amax().float() / K_SCALE_CONSTANT).clamp(min=MIN_SCALE))
            self.v_scale.copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp(min=MIN_SCALE))
            self.calculate_next = False
        return ((k / self.k_scale[None, :, None]).to(k.dtype), (v / self.v_scale[None, :, None]).to(v.dtype))

    def scale_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] times the k scale of the KV head each query head reads."""
        return (q * self.k_scale.repeat_interleave(self.group)[None, :, None]).to(q.dtype)


def kv_scale_layers(model: torch.nn.Module) -> list[KVScales]:
    """Every attention layer's scales in a model."""
    return [m for m in model.modules() if isinstance(m, KVScales)]


def is_fp8_cache(kv_cache) -> bool:
    return kv_cache is not None and kv_cache[0].element_size() == 1
