"""generation_config.json, read the way vLLM reads it: the EOS ids a request stops on, and the default
sampling params (--generation-config auto, a folder, or vllm for none), with --override-generation-config's
fields merged over them.
"""

from __future__ import annotations

import os

from kvfit.errors import ConfigError
from kvfit.model_facts import ModelFacts, read_field, read_json_object


def load_generation_eos(model_path: str | None, facts: ModelFacts) -> list[int]:
    """EOS token ids: generation_config.json's eos_token_id (int or list), else config.json's, else []."""
    if model_path is not None:
        path = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(path):
            eos = read_json_object(path).get("eos_token_id")
            if eos is not None:
                return _id_list(eos, path)
    eos = facts.raw.get("eos_token_id")
    return [] if eos is None else _id_list(eos, "config.json")


# vLLM's get_diff_sampling_param: the generation_config.json fields that become default sampling params
# (max_new_tokens is vLLM's max_tokens), with the bounds read_field checks
GENERATION_DEFAULT_FIELDS = {"repetition_penalty": ("number", {"above": 0}), "temperature": ("number", {"minimum": 0}),
                             "top_k": ("int", {"minimum": -1}), "top_p": ("number", {"above": 0}),
                             "min_p": ("number", {"minimum": 0}), "max_new_tokens": ("int", {"minimum": 1})}
# transformers' GenerationConfig defaults: vLLM reads the file through to_diff_dict(), so a field equal
# to its default there is no default of its own (top_k 50 in the file does not turn top-k on)
HF_GENERATION_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def generation_config_path(model_path: str | None, generation_config: str = "auto") -> str | None:
    """The generation_config.json that --generation-config names (auto: the model folder's; vllm: none);
    None when there is none to read. A folder given by path must hold one (a ConfigError if not)."""
    if generation_config == "vllm":
        return None
    folder = model_path if generation_config == "auto" else generation_config
    path = None if folder is None else os.path.join(folder, "generation_config.json")
    if path is not None and os.path.isfile(path):
        return path
    if generation_config != "auto":
        raise ConfigError(f"--generation-config {generation_config}: that folder has no generation_config.json; "
                          "give a folder that holds one, or auto (the model's) or vllm (vLLM's defaults)")
    return None


def load_generation_defaults(path: str | None) -> dict:
    """Default sampling params from a generation_config.json (vLLM's names: max_new_tokens becomes
    max_tokens); a field absent, null or equal to transformers' default is left out; a bad type or
    range is a one-line ConfigError naming the file and field."""
    if path is None:
        return {}
    cfg = read_json_object(path)
    defaults = {}
    for name, (kind, bounds) in GENERATION_DEFAULT_FIELDS.items():
        value = read_field(cfg, name, kind, source=path, **bounds)
        if value is not None and value != HF_GENERATION_DEFAULTS.get(name):
            defaults["max_tokens" if name == "max_new_tokens" else name] = value
    return defaults


OVERRIDE_FLAG = "--override-generation-config"


def generation_overrides(fields: dict) -> dict:
    """--override-generation-config's fields checked (vLLM's names, GENERATION_DEFAULT_FIELDS' bounds); null
    stays null (it removes that default, as in vLLM). An unknown key or a bad value is a one-line ConfigError."""
    if not isinstance(fields, dict):
        raise ConfigError(f"{OVERRIDE_FLAG} must be a JSON object like '{{\"temperature\": 0.5}}', got {fields!r:.80}")
    unknown = [k for k in fields if k not in GENERATION_DEFAULT_FIELDS]
    if unknown:
        hint = " (generation_config.json's name for max_tokens is max_new_tokens)" if "max_tokens" in unknown else ""
        raise ConfigError(f"{OVERRIDE_FLAG} has no field {str(unknown[0])[:40]!r}{hint}; its fields are "
                          f"{', '.join(GENERATION_DEFAULT_FIELDS)}")
    checked = {}
    for name, value in fields.items():
        kind, bounds = GENERATION_DEFAULT_FIELDS[name]
        checked[name] = None if value is None else read_field(fields, name, kind, source=OVERRIDE_FLAG, **bounds)
    return checked


def apply_generation_overrides(defaults: dict, overrides: dict | None) -> dict:
    """vLLM's get_diff_sampling_param with override_generation_config: the overrides (generation_overrides'
    output) merged over the generation config's defaults (load_generation_defaults' output, vLLM's names); a
    null override removes that default. With --generation-config vllm the defaults are empty, so the overrides
    alone are the defaults."""
    merged = dict(defaults)
    for name, value in (overrides or {}).items():
        key = "max_tokens" if name == "max_new_tokens" else name
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def _id_list(value, source: str) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: 'eos_token_id' must be a token id (an integer >= 0) or a list of them, "
                          f"got {str(value)[:60]}")
    return list(ids)
