"""Fused projections built at construction (q/k/v, gate/up): the loader maps each checkpoint tensor to its
rows of the fused parameter, dummy weights are drawn per checkpoint tensor as before fusion, and parts that
cannot share one GEMM load correctly (a SplitColumnLinear chosen at construction; FP8 static input scales that
differ: the largest, as vLLM), never loaded wrong."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # as test_fp8.py: the FP8 GEMMs' kernels interpreted

from fp8_checkpoints import LINEAR, fake_quant_hooks, write_fp8_copy  # noqa: E402
from paged_batch import PagedCache, hf_logits, random_tokens  # noqa: E402

from kvfit.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvfit.kernels.fp8 import FP8_DTYPE  # noqa: E402
from kvfit.model_facts import load_model_facts  # noqa: E402
from kvfit.models.linear import SplitColumnLinear  # noqa: E402
from kvfit.models.loader import DUMMY_SEED, DUMMY_STD, _stable_hash, load_model  # noqa: E402
from kvfit.models.parallel import MergedColumnLinear  # noqa: E402
from kvfit.models.quant.linear import Fp8Linear  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

BACKEND = TorchReferenceBackend()
FLIP_ATOL = 3e-2


def _logits(folder: str, load_format: str = "auto"):
    facts = load_model_facts(folder)
    model = load_model(folder, facts, torch.float32, "cpu", BACKEND, load_format=load_format)
    tokens = random_tokens(facts.vocab_size, 11, seed=0)
    input_ids, positions, meta = PagedCache(facts).step([("s", 0, tokens)])
    with torch.inference_mode():
        return model, model.compute_logits(model(input_ids, positions, None, meta)), tokens


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fused"), arch="llama")


def test_checkpoint_tensors_map_to_their_part_of_the_fused_parameter(llama):
    model, _, _ = _logits(llama)
    targets = model.checkpoint_targets()
    name, param, index = targets["model.layers.0.self_attn.k_proj.weight"]
    assert name == "model.layers.0.self_attn.qkv_proj.weight" and index == 1
    assert targets["model.layers.1.mlp.up_proj.weight"][::2] == ("model.layers.1.mlp.gate_up_proj.weight", 1)
    assert targets["model.layers.0.self_attn.o_proj.weight"][::2] == ("model.layers.0.self_attn.o_proj.weight", 0)
    from safetensors.torch import load_file
    full = load_file(os.path.join(llama, "model.safetensors"))
    qkv = torch.cat([full[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(param, qkv)


def test_dummy_weights_are_drawn_per_checkpoint_tensor(llama):
    """The same numbers as when q, k and v were three parameters: each part from its own name's generator."""
    model, _, _ = _logits(llama, load_format="dummy")
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    for index, name in enumerate(("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")):
        gen = torch.Generator().manual_seed(DUMMY_SEED + _stable_hash(name))
        rows = gate_up.parts[index].rows
        assert torch.equal(gate_up[rows], torch.empty(gate_up[rows].shape).normal_(0.0, DUMMY_STD, generator=gen))


def test_q_k_v_split_by_the_ignore_list_run_one_gemm_each(llama, tmp_path):
    """quantization_config leaves v_proj in 16 bits: q and k in FP8, v not; chosen at construction."""
    fp8, deq = write_fp8_copy(llama, tmp_path, "ct-channel", skip=(".self_attn.v_proj",))
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*self_attn[.]v_proj$"]
    json.dump(config, open(path, "w"))
    model, got, tokens = _logits(fp8)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, SplitColumnLinear)
    assert [type(m) for m in qkv.parts] == [Fp8Linear, Fp8Linear, MergedColumnLinear]
    assert qkv.parts[0].weight.dtype == FP8_DTYPE and qkv.parts[2].weight.dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Fp8Linear)          # fused: both in FP8
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    linears = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and LINEAR.fullmatch(n + ".weight")]
    for handle, name in zip(fake_quant_hooks(hf, "ct-channel"), linears):
        if name.endswith("v_proj"):
            handle.remove()
    assert torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)


def test_static_input_scales_that_differ_within_a_fused_layer_take_the_largest(llama, tmp_path, caplog):
    """k_proj's static input scale doubled in layer 1: the fused q/k/v GEMM quantizes its input with the largest
    of the three (vLLM's choice: no part saturates), says so in the log, and computes what transformers computes
    with that scale on all three inputs."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from fp8_checkpoints import STATIC_INPUT_SCALE
    from kvfit.kernels.fp8 import Fp8Weight, dequantize_activations, quantize_activations
    fp8, deq = write_fp8_copy(llama, tmp_path, "ct-static")
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.k_proj.input_scale"] = tensors["model.layers.1.self_attn.k_proj.input_scale"] * 2
    save_file(tensors, path, metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="kvfit"):
        model, got, tokens = _logits(fp8)
    assert "model.layers.1.self_attn.qkv_proj: the checkpoint's static input_scale differs" in caplog.text
    assert model.model.layers[1].self_attn.qkv_proj.qweight.input_scale.item() == 2 * STATIC_INPUT_SCALE
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    linears = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and LINEAR.fullmatch(n + ".weight")]
    doubled = Fp8Weight(torch.empty(0), torch.empty(0), None, torch.tensor([2 * STATIC_INPUT_SCALE]))

    def requantize(_module, args):
        flat = args[0].reshape(-1, args[0].shape[-1])
        xq, scale = quantize_activations(flat, doubled)
        return (dequantize_activations(xq, scale, doubled).to(args[0].dtype).reshape(args[0].shape),)
    for handle, name in zip(fake_quant_hooks(hf, "ct-static"), linears):
        if name.startswith("model.layers.1.self_attn.") and name.endswith(("q_proj", "k_proj", "v_proj")):
            handle.remove()
            hf.get_submodule(name).register_forward_pre_hook(requantize)
    assert torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)
