"""The architecture registry (model_facts/architectures.py): one entry per architecture holds what kvfit
knows of it, and a new architecture is one entry (plus its model file: tests/models/test_new_architecture.py).
No torch here."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import MappingProxyType

import pytest

from kvfit import catalog
from kvfit.config import SchedulerConfig
from kvfit.errors import ConfigError
from kvfit.model_facts import (ARCHITECTURES, Architecture, FamilyRules, MoEConfig, architecture_of_config,
                               count_parameters, facts_from_config, get_architecture, moe_config)
from kvfit.model_facts import architectures as registry
from kvfit.model_facts.experts import dense_mlp_params
from kvfit.models.registry import is_runnable, model_class, runnable_architectures
from kvfit.platforms.estimate import estimate_activation_bytes

SRC = Path(__file__).resolve().parents[2] / "src" / "kvfit"
TOY = {"architectures": ["ToyForCausalLM"], "model_type": "toy", "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
       "max_position_embeddings": 256, "torch_dtype": "float32", "toy_expert_width": 32, "num_experts_per_tok": 2}


def toy_mlp_params(f, cfg: dict, source: str) -> int:
    """The toy's MLP: up and down only (no gate)."""
    return f.num_layers * 2 * f.hidden_size * f.intermediate_size


def toy_experts(facts) -> MoEConfig:
    return MoEConfig(num_experts=4, top_k=2, intermediate_size=facts.raw["toy_expert_width"], renormalize=True,
                     round_weights=False, sparse_layers=frozenset({1}), block_name="mlp",
                     expert_names=("gate_proj", "up_proj", "down_proj"))


TOY_ENTRY = Architecture("ToyForCausalLM", "toy", "toy_model:ToyCausalLM",
                         FamilyRules(qk_norm=True, reads_attention_bias=True), mlp_params=toy_mlp_params,
                         moe=toy_experts, expert_width_key="toy_expert_width")


@pytest.fixture
def with_toy(monkeypatch):
    """The registry with one more entry: all a new architecture adds outside its model file."""
    monkeypatch.setattr(registry, "ARCHITECTURES", MappingProxyType({**ARCHITECTURES, TOY_ENTRY.name: TOY_ENTRY}))


def test_a_new_architecture_is_one_entry(with_toy):
    f = facts_from_config(dict(TOY, attention_bias=True))
    assert (f.architecture, f.family) == ("ToyForCausalLM", "toy")
    assert (f.qk_norm, f.qkv_bias, f.o_bias, f.mlp_bias) == (True, True, True, False)     # the entry's rules
    h, i, layers, v, d = 64, 96, 2, 128, 16
    attn = h * 4 * d + 2 * h * 2 * d + 4 * d * h + (4 * d + 2 * 2 * d) + h + 2 * d    # + biases + q/k norms
    assert f.num_params == 2 * v * h + layers * (attn + 2 * h + 2 * h * i) + h       # its own mlp_params
    assert count_parameters(f, f.raw) == f.num_params
    # model_type alone finds it; it is runnable, listed, and named in the unsupported-architecture error
    assert facts_from_config({k: v for k, v in TOY.items() if k != "architectures"}).architecture == "ToyForCausalLM"
    assert is_runnable("ToyForCausalLM") and runnable_architectures()[-1] == "ToyForCausalLM"
    with pytest.raises(ConfigError, match="ToyForCausalLM"):
        get_architecture("GPT2LMHeadModel")
    # the entry's experts: moe_config for the model, expert_width_key for the capacity estimate
    assert moe_config(f).intermediate_size == 32
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8)
    dense = facts_from_config({k: v for k, v in TOY.items() if k not in ("toy_expert_width", "num_experts_per_tok")})
    # 8 tokens x gate, up and their product x (top_k 2 experts of 32 - intermediate_size 96) x 2 bytes
    assert (estimate_activation_bytes(f, sched, 2, 1) - estimate_activation_bytes(dense, sched, 2, 1)
            == 8 * 3 * (2 * 32 - 96) * 2)


def test_without_the_entry_the_architecture_is_unsupported():
    with pytest.raises(ConfigError, match="unsupported architecture 'ToyForCausalLM'"):
        facts_from_config(TOY)
    assert not is_runnable("ToyForCausalLM")


def test_an_entry_without_a_model_class_is_planned_not_run(monkeypatch):
    planned = Architecture("ToyForCausalLM", "toy", None, mlp_params=dense_mlp_params)
    monkeypatch.setattr(registry, "ARCHITECTURES", MappingProxyType({**ARCHITECTURES, planned.name: planned}))
    assert facts_from_config(TOY).num_params > 0
    assert not is_runnable("ToyForCausalLM")
    with pytest.raises(ConfigError, match="can be planned but not run yet"):
        model_class("ToyForCausalLM")
    with pytest.raises(ConfigError, match="not a mixture-of-experts model"):
        moe_config(facts_from_config(TOY))


@pytest.mark.parametrize("entry", list(ARCHITECTURES.values()), ids=list(ARCHITECTURES))
def test_every_entry_is_found_by_name_and_by_model_type(entry):
    assert architecture_of_config({"architectures": [entry.name]}) is entry
    assert architecture_of_config({"model_type": entry.model_type}) is entry
    assert entry.model_class is None or re.fullmatch(r"kvfit\.models\.\w+:\w+", entry.model_class)


def test_every_catalog_model_has_an_entry_whose_family_it_reports():
    for name, cfg in catalog.MODELS.items():
        entry = architecture_of_config(cfg)
        assert facts_from_config(cfg).family == entry.model_type, name


def test_only_mla_entries_read_the_latent_sizes():
    assert {e.name for e in ARCHITECTURES.values() if e.mla} == {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}


def test_no_code_asks_which_family_a_model_is():
    """Family knowledge lives in the entries: nothing compares facts.family (messages may print it)."""
    asks = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(isinstance(side, ast.Attribute) and side.attr == "family"
                                                     for side in (node.left, *node.comparators)):
                asks.append(f"{path.relative_to(SRC)}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "family"):
                asks.append(f"{path.relative_to(SRC)}:{node.lineno}")          # family.startswith(...)
    assert asks == []
