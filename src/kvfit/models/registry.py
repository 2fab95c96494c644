"""Architecture name (config.json "architectures") -> the model class that runs it.

The class is named by the architecture's entry in model_facts/architectures.py ("module:Class", its
model_class); a new architecture is one module under models/ plus that one entry (as vLLM's model
registry, SGLang's EntryClass). What kvfit can run is exactly the entries with a model_class; the others
can be planned. Classes are imported when a model is built, so this module needs no torch and
model_facts (a lower layer) never imports models/.

A model class is built as `cls(facts, dtype, device, attention_backend, tp_rank=, tp_size=)` and
has load_weights(named tensors), forward(input_ids, positions, kv_caches, meta) and
compute_logits(hidden); its structure comes from ModelFacts (biases, q/k norm), not from the family
name. Projections that read the same input are fused when the model is built (models/linear.py).
"""

from __future__ import annotations

import importlib

from kvfit.errors import ConfigError
from kvfit.model_facts import all_architectures, find_architecture


def runnable_architectures() -> tuple[str, ...]:
    """The architectures kvfit can run (every other supported one can only be planned)."""
    return tuple(entry.name for entry in all_architectures() if entry.model_class is not None)


def is_runnable(architecture: str) -> bool:
    """Whether a model of `architecture` can be built and run."""
    entry = find_architecture(architecture)
    return entry is not None and entry.model_class is not None


def model_class(architecture: str) -> type:
    """The class that runs `architecture`; a plannable-only one is a ConfigError listing the runnable."""
    if not is_runnable(architecture):
        raise ConfigError(f"{architecture} can be planned but not run yet; runnable: "
                          f"{', '.join(runnable_architectures())}")
    module, _, cls = find_architecture(architecture).model_class.partition(":")
    return getattr(importlib.import_module(module), cls)
