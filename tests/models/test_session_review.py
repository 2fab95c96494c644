"""Review of static FP8 experts (5cb7592) and config.json's compression_config (771de55): a user-facing error names
the key and the tensor as the user's files spell them."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # as test_fp8.py: kernel tests collected after this one

from fp8_checkpoints import STATIC_INPUT_SCALE, write_fp8_copy  # noqa: E402

from kvfit.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvfit.errors import ConfigError  # noqa: E402
from kvfit.model_facts import facts_from_config, load_model_facts  # noqa: E402
from kvfit.models.loader import load_model  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


def test_a_mixtral_expert_tensor_kvfit_refuses_is_named_as_the_checkpoint_spells_it(tmp_path):
    """Mixtral's experts live under block_sparse_moe; the loader reads them under mlp. An expert input_scale
    beside dynamic activations was refused naming model.layers.0.mlp.experts.0.w1.input_scale, a tensor the
    checkpoint does not hold."""
    from safetensors.torch import load_file, save_file
    src = make_tiny_model(tmp_path, arch="mixtral")
    fp8, _ = write_fp8_copy(src, tmp_path, "ct-tensor")               # dynamic activations
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.block_sparse_moe.experts.0.w1.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
    save_file(tensors, path, metadata={"format": "pt"})
    facts = load_model_facts(fp8)
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.input_scale "
                                          r"is a static activation scale") as info:
        load_model(fp8, facts, torch.float32, "cpu", TorchReferenceBackend())
    assert "\n" not in str(info.value)


def test_a_compression_config_kvfit_cannot_run_names_compression_config():
    """Read where quantization_config is absent, so its errors name compression_config: the user's config.json
    has no quantization_config to fix."""
    raw = dict(load_model_facts("llama-3.1-8b").raw)
    raw.pop("quantization_config", None)
    raw["compression_config"] = {"quant_method": "awq"}
    with pytest.raises(ConfigError, match=r"config\.json compression_config: quant_method 'awq'"):
        facts_from_config(raw)
    raw["compression_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with pytest.raises(ConfigError, match=r"compression_config: compressed-tensors format 'pack-quantized'"):
        facts_from_config(raw)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}   # it wins
    assert facts_from_config(raw).quantization.block_size == (128, 128)
