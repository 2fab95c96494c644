"""Review of Phi3ForCausalLM and .bin loading: a Phi-3 checkpoint in PyTorch's .bin form (torch.Tensor sources, not
safetensors slices) splits its fused qkv_proj / gate_up_proj the same way, rank by rank and under --quantization fp8;
a Phi-3 checkpoint that lacks a fused tensor names that tensor, not the parts kvfit splits it into."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_phi3 import make_tiny_phi3

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import load_model_facts
from kvfit.models import loader


def _as_bin(folder: str, dest) -> str:
    """The same weights as one pytorch_model.bin (torch.save's zip format) in a copy of folder."""
    out = str(dest)
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    torch.save(load_file(os.path.join(folder, "model.safetensors")), os.path.join(out, "pytorch_model.bin"))
    return out


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_phi3_bin_loads_the_parameters_its_safetensors_load(tmp_path, num_kv_heads, tp_size):
    folder = make_tiny_phi3(tmp_path, num_kv_heads)
    binary = _as_bin(folder, tmp_path / "bin")
    assert loader.checkpoint_files(binary) == [os.path.join(binary, "pytorch_model.bin")]
    facts = load_model_facts(binary)
    for rank in range(tp_size):
        want, got = (dict(loader.load_model(path, facts, torch.float32, "cpu", TorchReferenceBackend(),
                                            tp_rank=rank, tp_size=tp_size).named_parameters())
                     for path in (folder, binary))
        assert want.keys() == got.keys()
        for name, param in want.items():
            assert torch.equal(param, got[name]), (rank, name)


def test_online_fp8_from_a_phi3_bin_is_the_safetensors_model(tmp_path):
    folder = make_tiny_phi3(tmp_path)
    binary = _as_bin(folder, tmp_path / "bin")
    want, got = (dict(loader.load_model(path, load_model_facts(path, quantization="fp8"), torch.bfloat16, "cpu",
                                        TorchReferenceBackend()).named_parameters())
                 for path in (folder, binary))
    assert type(want["model.layers.0.self_attn.qkv_proj.weight"]) is type(got["model.layers.0.self_attn.qkv_proj.weight"])
    assert got["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    for name, param in want.items():
        assert torch.equal(param.float(), got[name].float()), name


@pytest.mark.parametrize("fused", ["self_attn.qkv_proj", "mlp.gate_up_proj"])
@pytest.mark.parametrize("as_bin", [False, True], ids=["safetensors", "bin"])
def test_a_missing_fused_tensor_is_named_as_the_checkpoint_names_it(tmp_path, fused, as_bin):
    """Phi-3 checkpoints hold qkv_proj and gate_up_proj, never q_proj / gate_proj: the error names the tensor the
    checkpoint lacks, and counts it once (not once per part kvfit splits it into)."""
    folder = make_tiny_phi3(tmp_path)
    state = load_file(os.path.join(folder, "model.safetensors"))
    del state[f"model.layers.1.{fused}.weight"]
    save_file(state, os.path.join(folder, "model.safetensors"))
    if as_bin:
        folder = _as_bin(folder, tmp_path / "bin")
    with pytest.raises(ConfigError) as err:
        loader.load_model(folder, load_model_facts(folder), torch.float32, "cpu", TorchReferenceBackend())
    message = str(err.value)
    assert message.startswith(f"checkpoint is missing tensor model.layers.1.{fused}.weight;"), message
    assert "more)" not in message and "\n" not in message
