"""A new architecture is one model file plus one registry entry: here a toy (the Llama decoder with an
up/ReLU/down MLP and q/k norms) is written as a file and registered; the loader builds it, its parameter
count is the model's, and it runs a step. Nothing else in kvfit changes."""

from __future__ import annotations

from types import MappingProxyType

import torch
from paged_batch import PagedCache, step_logits

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.model_facts import ARCHITECTURES, Architecture, FamilyRules, facts_from_config
from kvfit.model_facts import architectures as registry
from kvfit.models.loader import load_model

# the one file: models/<name>.py in kvfit (here a module beside the test)
TOY_MODEL_FILE = '''
"""Toy: the Llama decoder whose MLP is down(relu(up(x)))."""
import torch

from kvfit.models.llama import CausalLM
from kvfit.models.parallel import ColumnLinear, RowLinear


class UpDown(torch.nn.Module):
    def __init__(self, hidden_size, intermediate_size, dtype, device):
        super().__init__()
        self.up_proj = ColumnLinear(hidden_size, intermediate_size, False, dtype, device)
        self.down_proj = RowLinear(intermediate_size, hidden_size, False, dtype, device)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


class ToyCausalLM(CausalLM):
    def make_mlp(self, layer, dtype, device):
        return UpDown(self.config.hidden_size, self.config.intermediate_size, dtype, device)
'''


def toy_mlp_params(f, cfg: dict, source: str) -> int:
    return f.num_layers * 2 * f.hidden_size * f.intermediate_size       # up and down


# the one entry
TOY = Architecture("ToyForCausalLM", "toy", "kvfit_toy_model:ToyCausalLM", FamilyRules(qk_norm=True),
                   mlp_params=toy_mlp_params)
CONFIG = {"architectures": ["ToyForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "torch_dtype": "float32"}


def test_a_new_architecture_is_one_model_file_plus_one_entry(tmp_path, monkeypatch):
    (tmp_path / "kvfit_toy_model.py").write_text(TOY_MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "ARCHITECTURES", MappingProxyType({**ARCHITECTURES, TOY.name: TOY}))
    facts = facts_from_config(CONFIG)
    assert facts.qk_norm and facts.family == "toy"
    model = load_model(str(tmp_path), facts, torch.float32, "cpu", TorchReferenceBackend(), load_format="dummy")
    assert type(model).__name__ == "ToyCausalLM"
    assert sum(p.numel() for p in model.parameters()) == facts.num_params        # what `kvfit plan` counts
    cache = PagedCache(facts, block_size=4, num_blocks=8)
    with torch.inference_mode():
        (logits,) = step_logits(model, cache, [("s", 0, [1, 2, 3, 4, 5])])
    assert logits.shape == (5, facts.vocab_size) and torch.isfinite(logits).all()
