"""Architecture name (config.json "architectures") -> the model class that runs it.

A new architecture is one module under models/ plus one line in MODELS (as vLLM's model registry,
SGLang's EntryClass). What kvfit can run is exactly MODELS' keys; model_facts.py can plan more.
Classes are named by "module:Class" and imported when a model is built, so this module needs no
torch and model_facts.py (a lower layer) never imports models/.

A model class is built as `cls(facts, dtype, device, attention_backend, tp_rank=, tp_size=)` and
has load_weights(named tensors), fuse_projections(), forward(input_ids, positions, kv_caches, meta)
and compute_logits(hidden); its structure comes from ModelFacts (biases, q/k norm), not from the
family name.
"""

from __future__ import annotations

import importlib

from kvfit.errors import ConfigError

_LLAMA = "kvfit.models.llama:CausalLM"
_MOE = "kvfit.models.moe:MoECausalLM"

MODELS = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Qwen2MoeForCausalLM": _MOE,
    "Qwen3MoeForCausalLM": _MOE,
    "MixtralForCausalLM": _MOE,
}


def runnable_architectures() -> tuple[str, ...]:
    """The architectures kvfit can run (every other supported one can only be planned)."""
    return tuple(MODELS)


def is_runnable(architecture: str) -> bool:
    """Whether a model of `architecture` can be built and run."""
    return architecture in MODELS


def model_class(architecture: str) -> type:
    """The class that runs `architecture`; a plannable-only one is a ConfigError listing the runnable."""
    if architecture not in MODELS:
        raise ConfigError(f"{architecture} can be planned but not run yet; runnable: "
                          f"{', '.join(runnable_architectures())}")
    module, _, cls = MODELS[architecture].partition(":")
    return getattr(importlib.import_module(module), cls)
