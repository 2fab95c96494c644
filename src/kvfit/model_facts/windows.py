"""Sliding-window attention of each family, torch-free: the window some layer of a config attends over, as
transformers builds the family's layers (None: every layer attends over the whole context). kvfit attends over
the whole context, which is exact while a sequence fits in the window (planning.resolve_max_model_len limits it
to that). An Architecture entry's FamilyRules names the function here that applies to it.
"""

from __future__ import annotations

from typing import Callable

from kvfit.model_facts.fields import read_field

QWEN_DEFAULT_WINDOW = 4096             # transformers' sliding_window where a Qwen config leaves the key out
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28


MISTRAL_DEFAULT_WINDOW = 4096          # transformers' MistralConfig sliding_window where config.json leaves it out


def every_layer(cfg: dict, num_layers: int, source: str) -> int | None:
    """Mixtral: sliding_window on every layer (null or left out: none)."""
    return read_field(cfg, "sliding_window", "int", source, minimum=1)


def mistral_layers(cfg: dict, num_layers: int, source: str) -> int | None:
    """Mistral: sliding_window on every layer (null: none; left out: transformers' default)."""
    if "sliding_window" not in cfg:
        return MISTRAL_DEFAULT_WINDOW
    return every_layer(cfg, num_layers, source)


def _used_window(cfg: dict, source: str) -> int | None:
    """A Qwen config's sliding_window, where use_sliding_window turns it on."""
    if not read_field(cfg, "use_sliding_window", "bool", source, default=False):
        return None
    if "sliding_window" not in cfg:
        return QWEN_DEFAULT_WINDOW
    return read_field(cfg, "sliding_window", "int", source, minimum=1)


def when_used(cfg: dict, num_layers: int, source: str) -> int | None:
    """Qwen3-MoE: every layer, when use_sliding_window."""
    return _used_window(cfg, source)


def _by_layer_types(cfg: dict, num_layers: int, source: str, slides: Callable[[int, int], bool]) -> int | None:
    window = _used_window(cfg, source)
    if window is None:
        return None
    types = read_field(cfg, "layer_types", "list", source)
    if types is None:
        first = read_field(cfg, "max_window_layers", "int", source, default=QWEN_DEFAULT_MAX_WINDOW_LAYERS,
                           minimum=0)
        types = ["sliding_attention" if slides(i, first) else "full_attention" for i in range(num_layers)]
    return window if "sliding_attention" in types else None


def qwen_layers(cfg: dict, num_layers: int, source: str) -> int | None:
    """Qwen2, Qwen3: when use_sliding_window, the layers layer_types names, else those from max_window_layers on."""
    return _by_layer_types(cfg, num_layers, source, lambda i, first: i >= first)


def qwen2_moe_layers(cfg: dict, num_layers: int, source: str) -> int | None:
    """Qwen2-MoE: when use_sliding_window, the layers layer_types names, else every other one (0, 2, ...) below
    max_window_layers."""
    return _by_layer_types(cfg, num_layers, source, lambda i, first: i % 2 == 0 and i < first)
