"""One decoder for Llama, Mistral, Qwen2 and Qwen3, in plain torch, with HF tensor names.

The families differ only in structure flags that ModelFacts carries (the FamilyRules of each
architecture's entry in model_facts/architectures.py applied to config.json): Qwen2 has a bias on q/k/v;
Qwen3 RMS-normalises each q and k head before RoPE and may have head_dim != hidden / heads; Llama and
Qwen3 read attention_bias, Llama mlp_bias. GQA and MQA follow from num_key_value_heads. The four
architectures' entries name CausalLM as their model class.
Attention goes through an AttentionBackend: each layer writes this step's K/V into its cache slots,
then attends over the block tables. Module names equal the checkpoint's, so loading maps 1:1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from kvfit.attention.base import AttentionBackend, AttentionMetadata
from kvfit.errors import ConfigError
from kvfit.kernels import fused_ops
from kvfit.kernels.gemv import gemv_applies, gemv_rope_write_kv, linear
from kvfit.model_facts import ModelFacts
from kvfit.models.kv_scales import KVScales, is_fp8_cache, kv_scale_targets
from kvfit.models.layers import RMSNorm, SwiGLU, causal_attention
from kvfit.models.parallel import (Shard, VocabEmbedding, gather_vocab, kv_head_range, make_param, read_shard,
                                   source_shape, split_evenly)
from kvfit.models.quant.linear import check_unloaded_tensor, fuse_projection, make_linear, project
from kvfit.models.rope import RopeConfig, apply_rope, inv_freq, rope_config_from_raw

DEFAULT_RMS_NORM_EPS = 1e-6
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
    raw = facts.raw
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported; the {facts.family} decoder needs 'silu'")
    window = facts.sliding_window
    if window is not None and window < facts.max_position_embeddings:
        logger.warning("%s has sliding_window %d; kvfit attends to the whole context, so outputs past %d tokens "
                       "differ from the reference (use --max-model-len %d to stay exact)",
                       facts.architecture, window, window, window)
    return DecoderConfig(
        num_layers=facts.num_layers, hidden_size=facts.hidden_size, num_heads=facts.num_attention_heads,
        num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim, intermediate_size=facts.intermediate_size,
        vocab_size=facts.vocab_size, rms_norm_eps=float(raw.get("rms_norm_eps") or DEFAULT_RMS_NORM_EPS),
        qkv_bias=facts.qkv_bias, o_bias=facts.o_bias, mlp_bias=facts.mlp_bias, qk_norm=facts.qk_norm,
        tie_word_embeddings=facts.tie_word_embeddings, rope=rope_config_from_raw(raw, facts.head_dim))


class Attention(torch.nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm, RoPE, paged attention, o_proj."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, dtype, device, tp_rank: int, tp_size: int,
                 scheme=None, prefix: str = "self_attn"):
        super().__init__()
        d = cfg.head_dim
        q_start, self.num_heads = split_evenly(cfg.num_heads, tp_rank, tp_size, "attention heads")
        kv_start, self.num_kv_heads = kv_head_range(cfg.num_kv_heads, tp_rank, tp_size)
        self.head_dim, self.backend, self.scale = d, backend, d ** -0.5
        h = cfg.hidden_size
        self.q_proj = make_linear(h, cfg.num_heads * d, cfg.qkv_bias, dtype, device, scheme, f"{prefix}.q_proj",
                                  q_start * d, self.num_heads * d)
        kv_args = (cfg.qkv_bias, dtype, device, scheme)
        kv_rows = (kv_start * d, self.num_kv_heads * d)
        self.k_proj = make_linear(h, cfg.num_kv_heads * d, *kv_args, f"{prefix}.k_proj", *kv_rows)
        self.v_proj = make_linear(h, cfg.num_kv_heads * d, *kv_args, f"{prefix}.v_proj", *kv_rows)
        self.o_proj = make_linear(cfg.num_heads * d, h, cfg.o_bias, dtype, device, scheme, f"{prefix}.o_proj",
                                  q_start * d, self.num_heads * d, row=True, tp_size=tp_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.kv_scales = KVScales(cfg.num_kv_heads, kv_start, self.num_kv_heads, self.num_heads, device)
        self.qkv_weight = self.qkv_bias = None      # set by fuse_projections() after loading

    def fuse_projections(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_projection([self.q_proj, self.k_proj, self.v_proj])

    def _qkv(self, x: torch.Tensor):
        if self.qkv_weight is None:
            return self._split_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))
        return self._split_heads(project(x, self.qkv_weight, self.qkv_bias))       # [T, (Hq + 2 Hkv) D]

    def _split_heads(self, q, k=None, v=None):
        """[T, Hq, D], [T, Hkv, D], [T, Hkv, D] views of the fused projection's rows (or of q, k, v given)."""
        d = self.head_dim
        if k is None:
            q, k, v = q.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=1)
        num_tokens = q.shape[0]
        return (q.view(num_tokens, self.num_heads, d), k.view(num_tokens, self.num_kv_heads, d),
                v.view(num_tokens, self.num_kv_heads, d))

    def _norm_rope(self, q, k, v, positions, kv_cache, meta: AttentionMetadata, freqs):
        """q/k norms (Qwen3) and RoPE -> (q, k, whether k and v are in the cache already)."""
        if not fused_ops.available(q):
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            return (*apply_rope(q, k, positions, freqs), False)
        # q/k norm and RoPE in one launch, in place on the qkv output, with the cache write when the backend's
        # is a plain one
        norm = self.q_norm is not None
        args = (positions, freqs, self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                self.q_norm.eps if norm else 0.0)
        if kv_cache is not None and self.backend.plain_cache_write:
            if fused_ops.qk_norm_rope_write_kv_(q, k, v, *args, *kv_cache, meta.slot_mapping):
                return q, k, True
        return (*fused_ops.qk_norm_rope_(q, k, *args), False)

    def _one_token_fused(self, x: torch.Tensor, kv_cache, freqs: torch.Tensor) -> bool:
        """The one-token GEMV does the projection, RoPE and the cache write: fused q/k/v weights, no q/k norm
        (a norm needs a whole head in one program), RoPE over the whole head, the backend's plain cache write,
        one token on CUDA."""
        return (kv_cache is not None and isinstance(self.qkv_weight, torch.Tensor) and self.q_norm is None
                and self.backend.plain_cache_write and 2 * freqs.numel() == self.head_dim
                and gemv_applies(x, self.qkv_weight))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                freqs: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; kv_cache: (k_cache, v_cache) each [num_blocks, block_size, Hkv, D], or None
        num_tokens = x.shape[0]
        # an fp8 cache with scales (kv_scales.py): k and v scaled on the way in, q and the output around attend;
        # the fused paths that write the cache themselves are left out
        scaled = self.kv_scales.applies and is_fp8_cache(kv_cache)
        if not scaled and self._one_token_fused(x, kv_cache, freqs):
            # one token (batch-1 decode): projection, RoPE and the cache write in one GEMV launch
            q, k, v = self._split_heads(gemv_rope_write_kv(x, self.qkv_weight, self.qkv_bias, positions, freqs,
                                                           *kv_cache, meta.slot_mapping, self.num_heads,
                                                           self.num_kv_heads))
            written = True                      # this step's k and v in the cache already
        else:
            q, k, v = self._qkv(x)              # [T, Hq, D], [T, Hkv, D], [T, Hkv, D] (views of one matmul)
            q, k, written = self._norm_rope(q, k, v, positions, None if scaled else kv_cache, meta, freqs)
        if kv_cache is None:
            starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
            out = causal_attention(q, k, v, starts, self.scale)
        else:
            k_cache, v_cache = kv_cache
            if scaled:
                (k, v), q = self.kv_scales.for_cache(k, v), self.kv_scales.scale_query(q)
            if not written:
                self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            out = self.backend.attend(q, k_cache, v_cache, meta, self.scale)      # [T, Hq, D]
            if scaled:
                out = self.kv_scales.scale_output(out)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


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
        normed, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(normed, positions, kv_cache, meta, freqs)
        normed, residual = self.post_attention_layernorm.add_forward(x, residual)
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

    def fuse_projections(self) -> None:
        """One matmul for q/k/v and one for gate/up in every layer (call after the weights are in)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32, the full vocabulary on every rank."""
        local = linear(hidden, self.lm_head.weight)                               # [N, vocab rows here]
        # gathered in the model's dtype, then widened: the same numbers as with one rank
        return gather_vocab(local, self.config.vocab_size, self.tp_size).float()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into this rank's parameters; ConfigError on a bad checkpoint.

        Each value is a torch.Tensor or a lazy safetensors slice; only this rank's part of it is read.
        Extra tensors (e.g. rotary inv_freq) are ignored; with tied embeddings lm_head.weight is too.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, source in named_tensors:
            name = self.checkpoint_name(name)
            if self._load_kv_scale(name, source):
                continue
            special = self.load_special(name, source)
            if special is not None:
                loaded.update(special)
                continue
            param = params.get(name)
            if param is None:
                check_unloaded_tensor(name, source, self.scheme)
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is not None:          # FP8 weights and scales check and read their own tensors
                loader(name, source)
                loaded.add(name)
                continue
            check_unloaded_tensor(name, source, self.scheme, into=param)
            shape = source_shape(source)
            if shape != param.full_shape:
                raise ConfigError(f"checkpoint tensor {name} has shape {list(shape)} but config.json "
                                  f"needs {list(param.full_shape)}; the weights do not match this config.json")
            param.copy_(read_shard(param, source))
            loaded.add(name)
        missing = [self.missing_name(name) for name, param in params.items()
                   if name not in loaded and not getattr(param, "derived", False)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(f"checkpoint is missing tensor {missing[0]}{more}; re-download the model or use "
                              "--load-format dummy for random weights")
