"""Rotary position embeddings: inverse frequencies from config.json, applied at arbitrary positions.

Both config styles are read: transformers 5 (`rope_parameters: {rope_type, rope_theta, ...}`) and
transformers 4 (`rope_theta` + `rope_scaling: {rope_type | type, ...}`). cos/sin are computed per step
from the positions (no table sized by max_position_embeddings), exactly as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfit.errors import ConfigError
from kvfit.model_facts import read_field

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


def inv_freq(cfg: RopeConfig, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32 (the same formulas as transformers)."""
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    if cfg.rope_type == "linear":
        return freqs / cfg.factor
    if cfg.rope_type == "llama3":
        return _llama3_scale(freqs, cfg)
    return freqs


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
