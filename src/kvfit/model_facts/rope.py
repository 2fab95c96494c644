"""RoPE settings read from config.json and validated, torch-free, so every command refuses the same configs.

Both config styles are read, transformers 5 (`rope_parameters: {rope_type, rope_theta, ...}`) and
transformers 4 (`rope_theta` + `rope_scaling: {rope_type | type, ...}`); models/rope.py applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.errors import ConfigError
from kvfit.model_facts.fields import read_field

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
