"""The model registry: what is runnable, which class runs it, and that class builds transformers' tensors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.model_facts import ARCHITECTURES, facts_from_config
from kvfit.models.llama import CausalLM
from kvfit.models.registry import is_runnable, model_class, runnable_architectures

RUNNABLE = [name for name, entry in ARCHITECTURES.items() if entry.model_class is not None]
PLANNABLE_ONLY = sorted(set(ARCHITECTURES) - set(RUNNABLE))


def test_runnable_architectures_are_the_registry_and_all_supported():
    assert runnable_architectures() == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                        "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                        "MixtralForCausalLM", "Phi3ForCausalLM")
    assert set(runnable_architectures()) <= set(ARCHITECTURES)
    assert all(is_runnable(arch) for arch in runnable_architectures())
    assert PLANNABLE_ONLY and not any(is_runnable(arch) for arch in PLANNABLE_ONLY)


@pytest.mark.parametrize("arch", RUNNABLE)
def test_every_entry_names_an_importable_module_class(arch):
    cls = model_class(arch)
    assert issubclass(cls, CausalLM) and issubclass(cls, torch.nn.Module)


@pytest.mark.parametrize("arch", PLANNABLE_ONLY)
def test_a_plannable_only_architecture_names_the_runnable_ones(arch):
    with pytest.raises(ConfigError) as err:
        model_class(arch)
    assert str(err.value) == (f"{arch} can be planned but not run yet; runnable: LlamaForCausalLM, "
                              "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM, "
                              "Qwen3MoeForCausalLM, MixtralForCausalLM, Phi3ForCausalLM")


def test_the_registry_imports_no_torch():
    code = "import sys, kvfit.models.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


_BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=16)


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias-flags"])
@pytest.mark.parametrize("arch", RUNNABLE)
def test_the_class_builds_the_tensors_transformers_builds(arch, bias):
    """Biases and q/k norms come from the facts' family rules; transformers decides what is right
    (Mistral and Qwen2 ignore attention_bias and mlp_bias, Qwen3 ignores mlp_bias)."""
    transformers = pytest.importorskip("transformers")
    prefix = arch.removesuffix("ForCausalLM")
    # pad_token_id None: Phi3Config's default (32000) is past the tiny vocabulary
    config = getattr(transformers, f"{prefix}Config")(**_BASE, attention_bias=bias, mlp_bias=bias, pad_token_id=None)
    with torch.device("meta"):
        hf = getattr(transformers, arch)(config)
    facts = facts_from_config({**config.to_dict(), "architectures": [arch]})
    ours = model_class(arch)(facts, torch.float32, "meta", TorchReferenceBackend())
    assert _checkpoint_shapes(ours) == {n: tuple(t.shape) for n, t in hf.state_dict().items()}


def _checkpoint_shapes(model) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors model reads, with their shapes: a fused parameter's parts (q/k/v, gate/up) each, or
    where the checkpoint stores them fused (the model's packed_modules, Phi-3), the fused tensor."""
    shapes = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = getattr(param, "parts", None)
        shapes.update({part.name: part.full_shape for part in parts} if parts else {name: tuple(param.shape)})
    for packed, part_names in getattr(model, "packed_modules", {}).items():
        for name in [n for n in shapes if n.rpartition(".")[0].endswith(f".{part_names[0]}")]:
            prefix, _, leaf = name.rpartition(".")
            prefix = prefix.rpartition(".")[0]
            stacked = [shapes.pop(f"{prefix}.{part}.{leaf}") for part in part_names]
            shapes[f"{prefix}.{packed}.{leaf}"] = (sum(shape[0] for shape in stacked), *stacked[0][1:])
    return shapes


def test_a_window_kvfit_does_not_apply_is_a_warning(caplog):
    from kvfit.models.llama import decoder_config
    cfg = {**_BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32}
    with caplog.at_level("WARNING", logger="kvfit"):
        decoder_config(facts_from_config(cfg))
        decoder_config(facts_from_config({**cfg, "sliding_window": 64}))      # the whole context: no warning
    assert [r.getMessage() for r in caplog.records] == [
        "MistralForCausalLM has sliding_window 32; kvfit attends to the whole context, so outputs past 32 tokens "
        "would differ from the reference: --max-model-len is at most 32"]
