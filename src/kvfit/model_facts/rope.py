"""RoPE settings read from config.json and validated, torch-free, so every command refuses the same configs.

Both config styles are read, transformers 5 (`rope_parameters: {rope_type, rope_theta, ...}`) and
transformers 4 (`rope_theta` + `rope_scaling: {rope_type | type, ...}`), with transformers' precedence;
models/rope.py applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfit.errors import ConfigError
from kvfit.model_facts.fields import read_field

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048    # transformers' LlamaConfig default (architectures.py has each family's)


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
    # YaRN: the band of dimensions between beta_fast and beta_slow rotations is interpolated (truncate: the
    # band's ends rounded outwards), and q and k are each scaled by attention_factor (1.0 for other types)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


def _rope_dict(raw: dict, source: str) -> dict:
    params = read_field(raw, "rope_parameters", "object", source, default={})
    if "full_attention" in params:   # per-layer-type form
        params = read_field(params, "full_attention", "object", f"{source} rope_parameters", default={})
    # transformers takes a non-empty rope_scaling whole, in place of rope_parameters (a transformers 5 folder whose
    # config.json gained the rope_scaling a model card asks for runs with it)
    scaling = read_field(raw, "rope_scaling", "object", source, default={})
    merged = dict(scaling or params)
    if "rope_theta" not in merged and raw.get("rope_theta") is not None:
        merged["rope_theta"] = raw["rope_theta"]
    return merged


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_config_from_raw(raw: dict, head_dim: int, source: str = "config.json",
                         default_theta: float = DEFAULT_ROPE_THETA,
                         default_max_position: int = DEFAULT_MAX_POSITION_EMBEDDINGS) -> RopeConfig:
    """Read RoPE settings from a config.json dict (default_theta, default_max_position: the architecture's, where
    it gives none); unsupported or out-of-range settings are a ConfigError."""
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
    theta = read_field(d, "rope_theta", "number", where, default=default_theta, above=0)
    if rope_type == "default":
        return RopeConfig(head_dim=head_dim, theta=theta)
    max_pos = read_field(raw, "max_position_embeddings", "int", source, default=default_max_position, minimum=1)
    # transformers: a top-level original_max_position_embeddings wins, else rope's, else max_position_embeddings
    original = read_field(raw, "original_max_position_embeddings", "int", source, minimum=1) or read_field(
        d, "original_max_position_embeddings", "int", where, default=max_pos, minimum=1)
    if rope_type == "yarn":
        return _yarn(d, where, head_dim, theta, max_pos, original)
    factor = read_field(d, "factor", "number", where, required=True, above=0)
    if rope_type in ("linear", "dynamic"):
        # dynamic: transformers rescales only past max_position_embeddings, which kvfit never runs past
        # (planning.resolve_max_model_len), so its frequencies are the default ones
        return RopeConfig(head_dim=head_dim, theta=theta, rope_type=rope_type, factor=factor)
    low, high = (read_field(d, key, "number", where, required=True, above=0)
                 for key in ("low_freq_factor", "high_freq_factor"))
    if not high > low:   # the llama3 smoothing divides by high - low
        raise ConfigError(f"{where}: high_freq_factor must be greater than low_freq_factor, got {high} <= {low}")
    return RopeConfig(head_dim=head_dim, theta=theta, rope_type="llama3", factor=factor, low_freq_factor=low,
                      high_freq_factor=high, original_max_position_embeddings=original)


def _yarn(d: dict, where: str, head_dim: int, theta: float, max_pos: int, original: int) -> RopeConfig:
    """YaRN's settings with transformers' defaults (_compute_yarn_parameters)."""
    factor = read_field(d, "factor", "number", where, default=max_pos / original, above=0)
    attention_factor = read_field(d, "attention_factor", "number", where, above=0)
    if attention_factor is None:
        mscale = read_field(d, "mscale", "number", where)
        mscale_all_dim = read_field(d, "mscale_all_dim", "number", where)
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) \
            if mscale and mscale_all_dim else _yarn_mscale(factor)
    # transformers reads a beta of 0 or null as its default
    beta_fast = read_field(d, "beta_fast", "number", where) or 32.0
    beta_slow = read_field(d, "beta_slow", "number", where) or 1.0
    if not beta_fast > 0 < beta_slow:
        raise ConfigError(f"{where}: beta_fast and beta_slow must be positive, got {beta_fast} and {beta_slow}")
    return RopeConfig(head_dim=head_dim, theta=theta, rope_type="yarn", factor=factor,
                      original_max_position_embeddings=original, beta_fast=beta_fast, beta_slow=beta_slow,
                      truncate=read_field(d, "truncate", "bool", where, default=True),
                      attention_factor=attention_factor)


PHI3_LONGROPE_NAMES = ("longrope", "su", "yarn")     # transformers' Phi3Config reads "su" and "yarn" as longrope


def check_phi3_rope(raw: dict, source: str = "config.json") -> None:
    """Phi-3's RoPE as transformers' Phi3Config reads it, refused where kvfit would run another model: a
    rope_scaling (else rope_parameters) type other than default (Phi3Config takes only longrope besides, which
    kvfit does not implement), and a partial_rotary_factor (rope's, else config.json's top-level one, where
    Phi-4-mini writes 0.75) other than 1.0."""
    d = _rope_dict(raw, source)
    where = f"{source} (rope_scaling / rope_parameters)"
    rope_type = read_field(d, "rope_type", "str", where) or read_field(d, "type", "str", where) or "default"
    if rope_type in PHI3_LONGROPE_NAMES:
        raise ConfigError(f"{source}: rope_scaling type {rope_type!r} (Phi-3's longrope, the 128k-context models) is "
                          "not supported; kvfit runs Phi-3 models without rope_scaling (the 4k-context ones)")
    if rope_type != "default":
        raise ConfigError(f"{source}: rope_scaling type {rope_type!r} is not one Phi3ForCausalLM takes (transformers: "
                          "default or longrope); remove rope_scaling")
    factor = read_field(d, "partial_rotary_factor", "number", where)
    if factor is None:
        factor = read_field(raw, "partial_rotary_factor", "number", source, default=1.0)
    if factor != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor {factor} is not supported (kvfit rotates every dimension "
                          "of a head: only 1.0); use a model with full RoPE")
