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

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LONGROPE_NAMES = ("longrope", "su")     # transformers reads "su" (Phi-3's first configs) as longrope
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
    # LongRoPE (Phi-3's 128k models): each frequency divided by its short factor, q and k scaled by
    # attention_factor; kvfit runs within original_max_position_embeddings, where transformers uses these (past it,
    # the long factors: transformers and vLLM differ there, so kvfit caps the context: ModelFacts.context_len)
    short_factor: tuple[float, ...] = ()


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
    rope_type = "longrope" if rope_type in LONGROPE_NAMES else rope_type
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
    if rope_type == "longrope":
        return _longrope(d, where, head_dim, theta, max_pos, original)
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


def _longrope(d: dict, where: str, head_dim: int, theta: float, max_pos: int, original: int) -> RopeConfig:
    """LongRoPE's settings with transformers' defaults (_compute_longrope_parameters): factor from the two context
    lengths when not given, attention_factor sqrt(1 + ln(factor) / ln(original)) when not given."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = read_field(d, key, "list", where, required=True)
        if len(values) != head_dim // 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                                   for v in values):
            raise ConfigError(f"{where}: {key} must be {head_dim // 2} positive numbers (head_dim / 2), got "
                              f"{len(values)} values")
        factors[key] = tuple(float(v) for v in values)
    factor = read_field(d, "factor", "number", where, above=0) or max_pos / original
    attention_factor = read_field(d, "attention_factor", "number", where, above=0)
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(head_dim=head_dim, theta=theta, rope_type="longrope", factor=factor,
                      original_max_position_embeddings=original, attention_factor=attention_factor,
                      short_factor=factors["short_factor"])


def check_phi3_rope(raw: dict, source: str = "config.json") -> None:
    """Phi-3's RoPE as transformers' Phi3Config reads it, refused where kvfit would run another model: a
    rope_scaling (else rope_parameters) type other than default or longrope ("su"; Phi3Config reads "yarn" as
    longrope too, which kvfit asks to be written so), and a partial_rotary_factor (rope's, else config.json's top-level one, where
    Phi-4-mini writes 0.75) other than 1.0."""
    d = _rope_dict(raw, source)
    where = f"{source} (rope_scaling / rope_parameters)"
    rope_type = read_field(d, "rope_type", "str", where) or read_field(d, "type", "str", where) or "default"
    if rope_type == "yarn":
        raise ConfigError(f"{source}: rope_scaling type 'yarn' on Phi-3 (transformers reads it as longrope) is not "
                          "supported; write rope_type 'longrope'")
    if rope_type not in ("default", *LONGROPE_NAMES):
        raise ConfigError(f"{source}: rope_scaling type {rope_type!r} is not one Phi3ForCausalLM takes (transformers: "
                          "default or longrope); remove rope_scaling")
    factor = read_field(d, "partial_rotary_factor", "number", where)
    if factor is None:
        factor = read_field(raw, "partial_rotary_factor", "number", source, default=1.0)
    if factor != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor {factor} is not supported (kvfit rotates every dimension "
                          "of a head: only 1.0); use a model with full RoPE")
