"""Model facts read from a Hugging Face config.json: what capacity planning and the models need. No torch,
so `kvfit plan` runs anywhere.

- architectures.py: the registry, one Architecture entry per config.json architecture (its model class,
  model_type, family rules, parameter counting, experts); experts.py: the MLP families those entries name
- facts.py: ModelFacts, dtype names and sizes
- loading.py: facts_from_config / load_model_facts (the entry applied to config.json), count_parameters
- fields.py: the typed JSON field reader (read_field) and JSON file reading
- rope.py: RoPE settings (RopeConfig)
- windows.py: which layers of each family attend over a sliding window
"""

from kvfit.model_facts.architectures import (ARCHITECTURES, Architecture, FamilyRules, all_architectures,
                                             architecture_of_config, find_architecture, get_architecture,
                                             moe_config)
from kvfit.model_facts.experts import MoEConfig, moe_sparse_layers
from kvfit.model_facts.facts import DTYPE_ALIASES, DTYPE_BYTES, ModelFacts, ceil_div
from kvfit.model_facts.fields import read_config_json, read_field, read_json_object, read_positive_int
from kvfit.model_facts.loading import count_parameters, facts_from_config, load_model_facts, with_quantization
from kvfit.model_facts.rope import DEFAULT_ROPE_THETA, ROPE_TYPES, RopeConfig, rope_config_from_raw

__all__ = ["ModelFacts", "facts_from_config", "load_model_facts", "count_parameters", "ARCHITECTURES",
           "Architecture", "FamilyRules", "all_architectures", "architecture_of_config", "find_architecture",
           "get_architecture", "MoEConfig", "moe_config", "moe_sparse_layers", "DTYPE_ALIASES", "DTYPE_BYTES",
           "read_config_json", "read_json_object", "read_field", "read_positive_int", "ceil_div", "RopeConfig",
           "rope_config_from_raw", "ROPE_TYPES", "DEFAULT_ROPE_THETA", "with_quantization"]
