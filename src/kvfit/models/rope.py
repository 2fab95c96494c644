"""Rotary position embeddings: inverse frequencies from config.json, applied at arbitrary positions.

The settings (RopeConfig) are read and validated in model_facts/rope.py, torch-free, so `kvfit plan` and the
engine refuse the same configs. cos/sin are computed per step from the positions (no table sized by
max_position_embeddings), exactly as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfit.kernels import fused_ops
# reading and validating the settings needs no torch, so `kvfit plan` refuses what this module would
from kvfit.model_facts import DEFAULT_ROPE_THETA, ROPE_TYPES, RopeConfig, rope_config_from_raw

__all__ = ["DEFAULT_ROPE_THETA", "ROPE_TYPES", "RopeConfig", "rope_config_from_raw", "inv_freq", "apply_rope",
           "RotaryStep", "rms_norm"]


def inv_freq(cfg: RopeConfig, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32 (the same formulas as transformers)."""
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    if cfg.rope_type == "linear":
        return freqs / cfg.factor
    if cfg.rope_type == "llama3":
        return _llama3_scale(freqs, cfg)
    if cfg.rope_type == "yarn":
        return _yarn_scale(cfg, device)
    if cfg.rope_type == "longrope":     # within the original context: the short factors
        return freqs / torch.tensor(cfg.short_factor, dtype=torch.float32, device=device)
    return freqs        # default, and dynamic within max_position_embeddings (model_facts/rope.py)


def _llama3_scale(freqs: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    # long wavelengths are divided by factor, short ones kept, the band between interpolated (Llama 3.1)
    old_len = cfg.original_max_position_embeddings
    low_freq_wavelen = old_len / cfg.low_freq_factor
    high_freq_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / cfg.factor, freqs)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_scale(cfg: RopeConfig, device) -> torch.Tensor:
    # dimensions turning fewer than beta_slow times over the original context are divided by factor, those
    # turning more than beta_fast times kept, a linear ramp between (YaRN; transformers' _compute_yarn_parameters)
    dim, base, old_len = cfg.head_dim, cfg.theta, cfg.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001      # the ramp divides by high - low
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)    # [D/2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    extrapolation = 1 - ramp
    return 1.0 / (cfg.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions [T]; freqs: [D // 2] float32."""
    angles = positions[:, None].float() * freqs[None, :]        # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1)                    # [T, D]
    cos = emb.cos().to(q.dtype)[:, None, :]                      # [T, 1, D]
    sin = emb.sin().to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in float32 and cast back before the weight (as transformers does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass(frozen=True)
class RotaryStep:
    """RoPE at one step's positions, after the optional per-head RMSNorm of q and k (Qwen3): what an attention
    backend applies, or folds into its cache write (attention.base.Rotary)."""

    positions: torch.Tensor               # [T] int64
    inv_freq: torch.Tensor                # [D / 2] fp32
    q_norm_weight: torch.Tensor | None    # [D] each, or None (no q/k norm)
    k_norm_weight: torch.Tensor | None
    eps: float = 0.0

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] normed and rotated: in place in one launch on CUDA, in torch elsewhere."""
        if fused_ops.available(q):
            return fused_ops.qk_norm_rope_(q, k, self.positions, self.inv_freq, self.q_norm_weight,
                                           self.k_norm_weight, self.eps)
        if self.q_norm_weight is not None:
            q, k = rms_norm(q, self.q_norm_weight, self.eps), rms_norm(k, self.k_norm_weight, self.eps)
        return apply_rope(q, k, self.positions, self.inv_freq)
