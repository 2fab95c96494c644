"""The catalog's mixture-of-experts shapes: the parameter count `kvfit plan` uses equals the one
transformers builds (meta tensors), and kvfit's model class builds the same number of parameters."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.catalog import model_config
from kvfit.model_facts import facts_from_config
from kvfit.models.registry import model_class


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"])
def test_parameter_count_equals_transformers(name):
    transformers = pytest.importorskip("transformers")
    cfg = model_config(name)
    arch = cfg["architectures"][0]
    config = getattr(transformers, arch.removesuffix("ForCausalLM") + "Config")(**cfg)
    with torch.device("meta"):
        hf = getattr(transformers, arch)(config)
    expected = sum(p.numel() for p in hf.parameters())
    facts = facts_from_config(cfg)
    assert facts.num_params == expected
    ours = model_class(arch)(facts, torch.bfloat16, "meta", TorchReferenceBackend())
    assert sum(p.numel() for p in ours.parameters()) == expected
