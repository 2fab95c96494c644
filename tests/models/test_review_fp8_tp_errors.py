"""Review: a block-FP8 column-parallel layer (a fused gate/up, q/k/v) that --tensor-parallel-size cuts off its
scale blocks is a one-line error naming the size the user passed, not 1."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import write_fp8_copy

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import load_model_facts
from kvfit.models.registry import model_class
from tiny_models import make_tiny_model


def test_a_column_split_off_its_scale_blocks_names_the_tensor_parallel_size(tmp_path):
    # Qwen2-MoE's shared expert: 48 channels, 24 a rank at tp 2, not whole 16-row scale blocks
    src = make_tiny_model(tmp_path, arch="qwen2_moe", moe={"shared_expert_intermediate_size": 48})
    fp8, _ = write_fp8_copy(src, tmp_path / "fp8", "block", block=(16, 16))
    facts = load_model_facts(fp8)
    with pytest.raises(ConfigError, match=r"shared_expert\.gate_proj: --tensor-parallel-size 2 splits it") as info:
        model_class(facts.architecture)(facts, torch.float32, "cpu", TorchReferenceBackend(), tp_rank=0, tp_size=2)
    assert "\n" not in str(info.value)
