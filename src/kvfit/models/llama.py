"""One decoder for Llama, Mistral, Qwen2 and Qwen3, in plain torch, with HF tensor names.

The families differ only in structure flags that ModelFacts carries (the FamilyRules of each
architecture's entry in model_facts/architectures.py applied to config.json): Qwen2 has a bias on q/k/v;
Qwen3 RMS-normalises each q and k head before RoPE and may have head_dim != hidden / heads; Llama and
Qwen3 read attention_bias, Llama mlp_bias. GQA and MQA follow from num_key_value_heads. The four
architectures' entries name CausalLM as their model class.
Attention goes through an AttentionBackend: each layer hands it x and its fused q/k/v projection, the
backend writes this step's K/V into its cache slots (fusing what it can), then attends over the block
tables. q/k/v and gate/up are fused at construction (models/linear.py); every other module name equals the
checkpoint's, and the loader maps each checkpoint tensor to (parameter, part) via checkpoint_targets().
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from kvfit.attention.base import AttentionBackend, AttentionHeads, AttentionMetadata
from kvfit.errors import ConfigError
from kvfit.kernels.gemv import linear
from kvfit.model_facts import ModelFacts, get_architecture
from kvfit.models.kv_scales import KVScales, is_fp8_cache, kv_scale_targets
from kvfit.models.layers import RMSNorm, SwiGLU
from kvfit.models.linear import make_column, make_row
from kvfit.models.parallel import (OutputPart, Shard, VocabEmbedding, gather_vocab, kv_head_range, load_part,
                                   make_param, split_evenly)
from kvfit.models.quant.linear import check_unloaded_tensor
from kvfit.models.rope import RopeConfig, RotaryStep, inv_freq, rope_config_from_raw

SILU_NAMES = ("silu", "swish")     # transformers' ACT2FN: both are SiLU
logger = logging.getLogger("kvfit")


@dataclass(frozen=True)
class DecoderConfig:
    """What the decoder's structure depends on, derived once from ModelFacts (and facts.raw)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope: RopeConfig


def decoder_config(facts: ModelFacts) -> DecoderConfig:
    """The structure flags of facts (which biases, q/k norm) plus eps and RoPE from config.json."""
    raw, entry = facts.raw, get_architecture(facts.architecture)
    act = raw.get("hidden_act") or "silu"
    if act not in SILU_NAMES:
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported; the {facts.family} decoder needs 'silu'")
    window = facts.sliding_window
    if window is not None and window < facts.max_position_embeddings:
        logger.warning("%s has sliding_window %d; kvfit attends to the whole context, so outputs past %d tokens "
                       "would differ from the reference: --max-model-len is at most %d",
                       facts.architecture, window, window, window)
    return DecoderConfig(
        num_layers=facts.num_layers, hidden_size=facts.hidden_size, num_heads=facts.num_attention_heads,
        num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim, intermediate_size=facts.intermediate_size,
        vocab_size=facts.vocab_size, rms_norm_eps=float(raw.get("rms_norm_eps") or entry.default_rms_norm_eps),
        qkv_bias=facts.qkv_bias, o_bias=facts.o_bias, mlp_bias=facts.mlp_bias, qk_norm=facts.qk_norm,
        tie_word_embeddings=facts.tie_word_embeddings,
        rope=rope_config_from_raw(raw, facts.head_dim, default_theta=entry.default_rope_theta,
                                  default_max_position=entry.default_max_position_embeddings))


class Attention(torch.nn.Module):
    """q/k/v (one fused projection, built so), optional per-head q/k RMSNorm, RoPE, paged attention, o_proj.

    One path: the backend projects, rotates and writes the cache (project_write_kv: it may fuse them), then
    attends (attend_step); KV cache scales, when they apply, go with both calls."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype, device, tp_rank: int, tp_size: int,
                 scheme=None, prefix: str = "self_attn"):
        super().__init__()
        d = cfg.head_dim
        q_start, self.num_heads = split_evenly(cfg.num_heads, tp_rank, tp_size, "attention heads")
        kv_start, self.num_kv_heads = kv_head_range(cfg.num_kv_heads, tp_rank, tp_size)
        # YaRN scales cos and sin (so q and k) by attention_factor: the same as scaling q . k by its square
        self.head_dim, self.backend, self.scale = d, backend, d ** -0.5 * cfg.rope.attention_factor ** 2
        self.heads = AttentionHeads(self.num_heads, self.num_kv_heads, d)
        h = cfg.hidden_size
        parts = [OutputPart(f"{prefix}.q_proj", cfg.num_heads * d, q_start * d, self.num_heads * d),
                 OutputPart(f"{prefix}.k_proj", cfg.num_kv_heads * d, kv_start * d, self.num_kv_heads * d),
                 OutputPart(f"{prefix}.v_proj", cfg.num_kv_heads * d, kv_start * d, self.num_kv_heads * d)]
        self.qkv_proj = make_column(h, parts, cfg.qkv_bias, dtype, device, scheme, f"{prefix}.qkv_proj", tp_size)
        self.o_proj = make_row(cfg.num_heads * d, h, cfg.o_bias, dtype, device, scheme, f"{prefix}.o_proj",
                               q_start * d, self.num_heads * d, tp_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.kv_scales = KVScales(cfg.num_kv_heads, kv_start, self.num_kv_heads, self.num_heads, device)

    def rotary(self, positions: torch.Tensor, freqs: torch.Tensor) -> RotaryStep:
        """This step's RoPE (after the q/k norms, Qwen3)."""
        if self.q_norm is None:
            return RotaryStep(positions, freqs, None, None)
        return RotaryStep(positions, freqs, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                freqs: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] (PreQuantized for an FP8 qkv_proj); kv_cache: (k_cache, v_cache) each
        # [num_blocks, block_size, Hkv, D], or None
        # an fp8 cache with scales (kv_scales.py): k and v scaled on the way in, q and the output around attend
        scales = self.kv_scales if self.kv_scales.applies and is_fp8_cache(kv_cache) else None
        q, k, v = self.backend.project_write_kv(x, self.qkv_proj, self.heads, self.rotary(positions, freqs),
                                                kv_cache, meta.slot_mapping, scales)   # [T, Hq | Hkv | Hkv, D]
        out = self.backend.attend_step(q, k, v, kv_cache, meta, self.scale, scales)    # [T, Hq, D]
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(torch.nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype, device, tp_rank: int, tp_size: int,
                 mlp: torch.nn.Module, scheme=None, prefix: str = "model.layers.0"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, backend, dtype, device, tp_rank, tp_size, scheme, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(self, x, residual, positions, kv_cache, meta, freqs):
        """x: the previous block's output, residual: the stream before it (None at the first layer).

        Returns (this block's MLP output, the stream before it); the caller adds them. Same sums
        in the same order as x + attn(norm(x)), then + mlp(norm(.)), so outputs match transformers.
        """
        # an FP8 qkv_proj or gate_up_proj gets its input quantized by the norm's kernel (add_forward's reader)
        normed, residual = self.input_layernorm.add_forward(x, residual, self.self_attn.qkv_proj)
        x = self.self_attn(normed, positions, kv_cache, meta, freqs)
        normed, residual = self.post_attention_layernorm.add_forward(x, residual,
                                                                     getattr(self.mlp, "input_projection", None))
        return self.mlp(normed), residual


class DecoderModel(torch.nn.Module):
    """The `model.` prefix of the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype, device, tp_rank: int, tp_size: int,
                 make_mlp, scheme=None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device, tp_rank, tp_size)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, backend, dtype, device, tp_rank, tp_size, make_mlp(i), scheme, f"model.layers.{i}")
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class CausalLM(torch.nn.Module):
    """Llama-family causal LM: forward() returns final-norm hidden states, compute_logits() the logits."""

    def __init__(self, facts: ModelFacts, dtype: torch.dtype, device, attention_backend: AttentionBackend,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        assert dtype in (torch.float32, torch.bfloat16, torch.float16), dtype
        assert 0 <= tp_rank < tp_size, (tp_rank, tp_size)
        self.facts, self.config = facts, decoder_config(facts)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        cfg = self.config
        self.scheme = facts.quantization      # FP8 weights (models/quant), or None
        self.model = DecoderModel(cfg, attention_backend, dtype, device, tp_rank, tp_size,
                                  lambda layer: self.make_mlp(layer, dtype, device), self.scheme)
        self.lm_head = torch.nn.Module()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight        # one Parameter, two names
        else:
            # the same vocabulary rows as the embedding on this rank
            embed = self.model.embed_tokens
            shard = None if tp_size == 1 else Shard(0, embed.start, embed.size)
            self.lm_head.weight = make_param((cfg.vocab_size, cfg.hidden_size), shard, dtype, device)
        self.register_buffer("rope_inv_freq", inv_freq(cfg.rope, device), persistent=False)   # [D/2] fp32

    def make_mlp(self, layer: int, dtype, device) -> torch.nn.Module:
        """Layer `layer`'s MLP (a subclass builds mixture-of-experts blocks here)."""
        cfg = self.config
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device, self.tp_rank, self.tp_size,
                      self.scheme, f"model.layers.{layer}.mlp")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata
                ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden] after the final norm.

        kv_caches: one (k_cache, v_cache) per layer. With kv_caches None or empty (a profile run with
        no cache) each sequence of the step attends causally to its own tokens only
        (meta.query_start_loc), i.e. every sequence is treated as a fresh prefill.
        """
        x = self.model.embed_tokens(input_ids)                           # [T, hidden]
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, kv_caches[i] if kv_caches else None, meta,
                                self.rope_inv_freq)
        return self.model.norm.add_forward(x, residual)[0]

    # checkpoint hooks a subclass overrides (mixture-of-experts: per-expert tensors into stacked ones)
    def _load_kv_scale(self, name: str, source) -> bool:
        """A KV cache scale of the checkpoint (kv_scales.py) read into its attention layer; False for others."""
        targets = kv_scale_targets(name)
        for module_name, which in targets:
            try:
                scales = self.get_submodule(module_name).kv_scales
            except AttributeError:
                raise ConfigError(f"checkpoint tensor {name} is a KV cache scale, but {module_name} is no attention "
                                  "layer of this model; the checkpoint does not match config.json") from None
            scales.load(which, name, source)
        return bool(targets)

    def checkpoint_name(self, name: str) -> str:
        """The parameter name a checkpoint tensor's name maps to."""
        return name

    def load_special(self, name: str, source) -> list[str] | None:
        """Load a checkpoint tensor that does not map 1:1 onto a parameter; the parameters it completed.
        None: not special (loaded by name, or ignored when no parameter has its name)."""
        return None

    def missing_name(self, param_name: str) -> str:
        """What to call an unloaded parameter in the error (the checkpoint tensor it lacks)."""
        return param_name

    def hub_name(self, name: str) -> str:
        """The checkpoint's own spelling of a name checkpoint_name rewrote: what an error names."""
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32, the full vocabulary on every rank."""
        local = linear(hidden, self.lm_head.weight)                               # [N, vocab rows here]
        # gathered in the model's dtype, then widened: the same numbers as with one rank
        return gather_vocab(local, self.config.vocab_size, self.tp_size).float()

    def checkpoint_targets(self) -> dict[str, tuple[str, torch.nn.Parameter, int]]:
        """Checkpoint tensor name -> (parameter name, parameter, part index): a fused parameter's parts name
        their checkpoint tensors (model.layers.0.self_attn.k_proj.weight -> qkv_proj.weight, part 1), any other
        parameter is its own name's."""
        targets = {}
        for name, param in self.named_parameters():
            parts = getattr(param, "parts", None)
            names = [part.name for part in parts] if parts is not None else [name]
            for index, checkpoint_name in enumerate(names):
                targets[self.checkpoint_name(checkpoint_name)] = (name, param, index)
        return targets

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into this rank's parameters; ConfigError on a bad checkpoint.

        Each value is a torch.Tensor or a lazy safetensors slice; only this rank's part of it is read.
        Extra tensors (e.g. rotary inv_freq) are ignored; with tied embeddings lm_head.weight is too.
        """
        targets = self.checkpoint_targets()
        loaded: set[tuple[str, int]] = set()
        for name, source in named_tensors:
            name = self.checkpoint_name(name)
            if self._load_kv_scale(name, source):
                continue
            special = self.load_special(name, source)
            if special is not None:
                loaded.update((param_name, 0) for param_name in special)
                continue
            target = targets.get(name)
            if target is None:
                check_unloaded_tensor(self.hub_name(name), source, self.scheme)
                continue
            param_name, param, index = target
            if not getattr(param, "quant_scale", False):
                check_unloaded_tensor(self.hub_name(name), source, self.scheme, into=param)
            # FP8 weights and scales check and read their own tensors
            getattr(param, "weight_loader", load_part)(param, index, name, source)
            loaded.add((param_name, index))
        # distinct names: parts a checkpoint stores as one tensor (Phi-3's qkv_proj) name that tensor once
        missing = list(dict.fromkeys(
            self.missing_name(checkpoint_name) for checkpoint_name, (param_name, param, index) in targets.items()
            if (param_name, index) not in loaded and not getattr(param, "derived", False)))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(f"checkpoint is missing tensor {missing[0]}{more}; re-download the model or use "
                              "--load-format dummy for random weights")
