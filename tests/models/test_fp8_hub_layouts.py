"""FP8 checkpoints as the Hub ships them, through kvfit's real loader: quantization_config blocks field for field
as RedHatAI / neuralmagic (compressed-tensors), Qwen3-*-FP8 and DeepSeek-V3 (fp8 blocks), AutoFP8 (fp8 per tensor)
and MiniMax-M2 write them; scales in bf16 or fp16, per-channel ones [N, 1] or [N], per-tensor ones [1] or 0-dim.
Each loads like transformers on the dequantized weights (with kvfit's activation quantization); what kvfit cannot
run (online transforms, quantization declared outside config.json) is a one-line ConfigError, never a silent or
half-right load, and never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from fp8_checkpoints import LINEAR, fake_quant_experts, fake_quant_hooks, write_fp8_copy
from paged_batch import PagedCache, hf_logits, random_tokens
from safetensors.torch import load_file, save_file

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.kernels.fp8 import dequantize_weight
from kvfit.model_facts import load_model_facts
from kvfit.models.loader import load_model
from kvfit.quant_scheme import parse_quantization_config
from tiny_models import make_tiny_model

FLIP_ATOL = 3e-2       # one e4m3 rounding step of an activation moved by fp32 summation order (test_fp8.py)


def _ct_args(strategy: str, dynamic: bool, **extra) -> dict:
    """One compressed-tensors QuantizationArgs as llm-compressor serializes it (every field, nulls included)."""
    args = {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}, "strategy": strategy,
            "symmetric": True, "type": "float"}
    return dict(args, **extra)


def _ct(weights: dict, acts: dict, **extra) -> dict:
    group = {"input_activations": acts, "output_activations": None, "targets": ["Linear"], "weights": weights,
             "format": "float-quantized"}
    config = {"config_groups": {"group_0": group},
              "format": "float-quantized", "global_compression_ratio": 1.24, "ignore": ["lm_head"],
              "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
              "sparsity_config": {}, "transform_config": None}
    return dict(config, **extra)


# the Hub's quantization_config blocks -> (kvfit's reference layout in fp8_checkpoints, its activation hooks)
HUB = {
    # RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic: per channel, dynamic per token
    "ct-fp8-dynamic": (_ct(_ct_args("channel", False), _ct_args("token", True)), "ct-channel"),
    # neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8: per tensor, static per tensor
    "ct-fp8-static": (_ct(_ct_args("tensor", False), _ct_args("tensor", False)), "ct-static"),
    # llm-compressor's FP8_BLOCK preset
    "ct-fp8-block": (_ct(_ct_args("block", False, block_structure=[128, 128]),
                         _ct_args("group", True, group_size=128)), "block"),
    # Qwen/Qwen3-*-FP8, deepseek-ai/DeepSeek-V3
    "fp8-block": ({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}, "block"),
    # MiniMaxAI/MiniMax-M2 (fmt spelled as the torch dtype)
    "fp8-block-minimax": ({"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                           "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "lm_head"]}, "block"),
    # AutoFP8 (neuralmagic/Meta-Llama-3-8B-Instruct-FP8): per tensor, 0-dim scales
    "autofp8-static": ({"activation_scheme": "static", "ignored_layers": ["lm_head"], "quant_method": "fp8"},
                       "ct-static"),
    "autofp8-dynamic": ({"activation_scheme": "dynamic", "ignored_layers": ["lm_head"], "quant_method": "fp8"},
                        "ct-tensor"),
    # transformers' FineGrainedFP8Config(weight_block_size=None) (mistralai's FP8 releases): per tensor, 0-dim
    # weight_scale_inv, and activation_scale when static
    "hf-fp8-tensor-static": ({"activation_scheme": "static", "quant_method": "fp8", "weight_block_size": None,
                              "modules_to_not_convert": ["lm_head"]}, "ct-static"),
    "hf-fp8-tensor-dynamic": ({"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": None,
                               "modules_to_not_convert": ["lm_head"]}, "ct-tensor"),
    # nvidia/*-FP8 (ModelOpt): per tensor, static per tensor, 0-dim scales; wildcard exclude patterns
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "*.mlp.gate"],
                      "kv_cache_scheme": None, "producer": {"name": "modelopt", "version": "0.35.0"}}, "ct-static"),
    # ModelOpt's per-channel weights ([N] scales), dynamic per-token activations
    "modelopt-pcpt": ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": ["lm_head"]},
                      "ct-channel"),
}
SCALE_NAMES = ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale")


def _hub_copy(src: str, dst, layout: str, scale_dtype=torch.bfloat16, flat: bool = False) -> tuple[str, str]:
    """(FP8 folder in `layout`'s Hub form, fp32 folder dequantized from exactly the tensors written there)."""
    quant, fmt = HUB[layout]
    fp8, _ = write_fp8_copy(src, dst, fmt)
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(SCALE_NAMES)]:
        scale = tensors.pop(name).to(scale_dtype)
        if layout.startswith(("autofp8", "modelopt-fp8", "hf-fp8-tensor")):
            scale = scale.reshape(())                          # AutoFP8, ModelOpt save per-tensor scales 0-dim
        if layout.startswith("hf-fp8-tensor"):                 # transformers' names for the same two scales
            name = name.replace(".weight_scale", ".weight_scale_inv").replace(".input_scale", ".activation_scale")
        elif flat and scale.shape[-1:] == (1,):
            scale = scale.reshape(-1)                          # per-channel [N] (some compressed-tensors versions)
        if layout.startswith("ct-") and name.endswith("_inv"):
            name = name.removesuffix("_inv")                   # compressed-tensors blocks: weight_scale
        tensors[name] = scale.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(fp8, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = quant
    json.dump(config, open(config_path, "w"), indent=1)
    return fp8, _dequantized(fp8, str(dst / "deq"), tensors, (128, 128) if fmt == "block" else None)


def _dequantized(fp8: str, folder: str, tensors: dict, block) -> str:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(fp8, folder)
    out = {}
    for name, value in tensors.items():
        if name.endswith(SCALE_NAMES):
            continue
        prefix = name.removesuffix(".weight")
        scale = tensors.get(f"{prefix}.weight_scale", tensors.get(f"{prefix}.weight_scale_inv"))
        out[name] = value if scale is None else dequantize_weight(value, scale.float(), block)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(folder, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return folder


def _logits(folder: str, quantization: str | None = None):
    facts = load_model_facts(folder, quantization)
    model = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    tokens = random_tokens(facts.vocab_size, 11, seed=0)
    input_ids, positions, meta = PagedCache(facts).step([("s", 0, tokens)])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, None, meta)), tokens


def _reference(folder: str, tokens, layout: str, experts: bool = False, skip=()) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fmt = HUB[layout][1]
    fake_quant_hooks(hf, fmt, skip=skip)
    if experts:
        assert fake_quant_experts(hf, fmt) > 0
    return hf_logits(hf, tokens)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, atol=FLIP_ATOL), (got - want).abs().max()
    assert got[-1].argmax() == want[-1].argmax()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, {"llama": make_tiny_model(root, arch="llama"), "qwen3": make_tiny_model(root, arch="qwen3"),
                  "tied": make_tiny_model(root, arch="llama", tie_word_embeddings=True, name="tied")}


@pytest.mark.parametrize("layout,arch,scale_dtype,flat", [
    ("ct-fp8-dynamic", "llama", torch.bfloat16, False), ("ct-fp8-dynamic", "qwen3", torch.bfloat16, True),
    ("ct-fp8-static", "llama", torch.bfloat16, False), ("ct-fp8-block", "qwen3", torch.bfloat16, False),
    ("fp8-block", "qwen3", torch.float16, False), ("fp8-block", "tied", torch.bfloat16, False),
    ("fp8-block-minimax", "llama", torch.float32, False), ("autofp8-static", "llama", torch.float32, False),
    ("autofp8-dynamic", "tied", torch.float32, False), ("modelopt-fp8", "llama", torch.float32, False),
    ("hf-fp8-tensor-static", "llama", torch.bfloat16, False), ("hf-fp8-tensor-dynamic", "qwen3", torch.float32, False),
    ("modelopt-pcpt", "qwen3", torch.float32, True)])
def test_hub_layouts_load_like_the_dequantized_reference(tiny, layout, arch, scale_dtype, flat):
    root, src = tiny
    fp8, deq = _hub_copy(src[arch], root / f"{layout}-{arch}-{flat}", layout, scale_dtype, flat)
    got, tokens = _logits(fp8)
    _assert_matches(got, _reference(deq, tokens, layout))


@pytest.mark.parametrize("arch, layout, scale", [
    # AutoFP8's Mixtral (activation_scheme dynamic) saves every expert's weight_scale 0-dim: the experts read it as
    # the linears do (it crashed with an IndexError from a slice of a 0-dim tensor)
    ("mixtral", "autofp8-dynamic", "block_sparse_moe.experts.0.w1.weight_scale"),
    # nvidia's ModelOpt FP8 MoE exports: every expert's gate/up/down with 0-dim weight_scale and input_scale, the
    # router left out by a wildcard; the experts read their scales as the static FP8 experts do
    ("qwen3_moe", "modelopt-fp8", "mlp.experts.0.gate_proj.input_scale")])
def test_per_tensor_expert_scales_stored_as_0_dim_tensors_load(tmp_path, arch, layout, scale):
    src = make_tiny_model(tmp_path, arch=arch)
    fp8, deq = _hub_copy(src, tmp_path / arch, layout)
    assert load_file(os.path.join(fp8, "model.safetensors"))[f"model.layers.0.{scale}"].dim() == 0
    got, tokens = _logits(fp8)
    _assert_matches(got, _reference(deq, tokens, layout, experts=True))


def _rewrite(folder: str, edit_tensors=None, edit_quant=None) -> None:
    path = os.path.join(folder, "model.safetensors")
    if edit_tensors is not None:
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    if edit_quant is not None:
        _edit_config(folder, lambda config: edit_quant(config["quantization_config"]))


def test_ue8m0_scales_stored_as_exponent_bytes_load_as_powers_of_two(tiny):
    # scale_fmt "ue8m0" (DeepSeek-V3.1's exports): every block scale a power of two; stored as uint8 they are
    # float8_e8m0fnu's exponent bytes, 2^(b - 127). Read as raw numbers (120.0 for 2^-7) they ran a wrong model.
    root, src = tiny
    fp8, _ = _hub_copy(src["qwen3"], root / "ue8m0", "fp8-block", torch.float32)
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    exponents = {name: torch.ceil(torch.log2(t)).clamp(-127, 127) for name, t in tensors.items()
                 if name.endswith("weight_scale_inv")}
    as_floats = dict(tensors, **{name: torch.exp2(e) for name, e in exponents.items()})
    deq = _dequantized(fp8, str(root / "ue8m0-deq"), as_floats, (128, 128))
    _rewrite(fp8, lambda t: t.update({name: (e + 127).to(torch.uint8) for name, e in exponents.items()}),
             lambda quant: quant.update(scale_fmt="ue8m0"))
    got, tokens = _logits(fp8)
    _assert_matches(got, _reference(deq, tokens, "fp8-block"))
    _rewrite(fp8, edit_quant=lambda quant: quant.pop("scale_fmt"))          # the same bytes, no scale_fmt
    with pytest.raises(ConfigError, match=r"weight_scale_inv is uint8, but a scale must be a float.*ue8m0"):
        _logits(fp8)
    _rewrite(fp8, edit_quant=lambda quant: quant.update(scale_fmt="e5m2"))
    with pytest.raises(ConfigError, match=r"scale_fmt 'e5m2' is not supported"):
        _logits(fp8)


def test_integer_scales_are_refused_and_zero_static_scales_named(tiny):
    root, src = tiny
    fp8, _ = _hub_copy(src["llama"], root / "int-scales", "autofp8-static", torch.float32)
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    _rewrite(fp8, lambda t: t.update({name: torch.tensor(3, dtype=torch.int32)}))
    with pytest.raises(ConfigError, match=rf"{name} is int32, but a scale must be a float \(float32, bfloat16, float16"):
        _logits(fp8)
    fp8, _ = _hub_copy(src["llama"], root / "zero-input", "autofp8-static", torch.float32)
    name = "model.layers.1.mlp.down_proj.input_scale"
    _rewrite(fp8, lambda t: t.update({name: torch.tensor(0.0)}))
    with pytest.raises(ConfigError, match=rf"{name} is \[0.0\], not a positive number.*recalibrate"):
        _logits(fp8)


@pytest.mark.parametrize("arch, layout, name", [
    ("llama", "ct-fp8-dynamic", "model.layers.0.self_attn.q_proj.weight_scale"),
    ("qwen3", "fp8-block", "model.layers.1.mlp.down_proj.weight_scale_inv"),
    ("qwen3_moe", "modelopt-fp8", "model.layers.0.mlp.experts.1.gate_proj.weight_scale")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_nan_infinite_or_negative_weight_scales_are_refused(tmp_path, arch, layout, name, bad):
    """A weight scale of NaN or inf turned the logits to NaN, -1 flipped the layer's sign, without a word (an
    input or KV scale was already refused); one expert's scale broke only the tokens routed to it."""
    src = make_tiny_model(tmp_path, arch=arch)
    fp8, _ = _hub_copy(src, tmp_path / "bad", layout)

    def damage(tensors):
        value = tensors[name].clone()
        value.view(-1)[0] = bad
        tensors[name] = value

    _rewrite(fp8, damage)
    with pytest.raises(ConfigError, match=rf"{name} holds 1 scale\(s\) that are not finite numbers >= 0.*damaged"):
        _logits(fp8)


def test_transformers_per_tensor_scales_are_named_as_stored(tiny):
    """transformers' per-tensor layout stores weight_scale_inv / activation_scale (read as weight_scale /
    input_scale): a missing one is named as the checkpoint stores it."""
    root, src = tiny
    fp8, _ = _hub_copy(src["llama"], root / "hf-missing", "hf-fp8-tensor-static", torch.float32)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    _rewrite(fp8, lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=rf"missing tensor {re.escape(name)};"):
        _logits(fp8)


@pytest.mark.parametrize("layout", ["autofp8-dynamic", "ct-fp8-dynamic"])
def test_input_scales_beside_dynamic_activations_are_named(tiny, layout):
    root, src = tiny
    fp8, _ = _hub_copy(src["llama"], root / f"dyn-input-{layout}", layout, torch.float32)
    name = "model.layers.0.mlp.up_proj.input_scale"
    _rewrite(fp8, lambda t: t.update({name: torch.tensor(0.05)}))
    with pytest.raises(ConfigError, match=rf"{name} is a static activation scale but .* makes activations dynamic"):
        _logits(fp8)


def test_block_experts_whose_width_is_not_whole_blocks_say_so_at_one_rank(tmp_path):
    src = make_tiny_model(tmp_path, arch="qwen3_moe", moe={"moe_intermediate_size": 96})
    fp8, _ = _hub_copy(src, tmp_path / "moe96", "fp8-block")
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(96\) to be whole \[128, 128\] blocks") as err:
        _logits(fp8)
    assert "tensor-parallel-size" not in str(err.value)


def test_fp8_fmt_is_read_in_both_spellings():
    for fmt in ("e4m3", "float8_e4m3fn"):
        scheme = parse_quantization_config(dict(HUB["fp8-block"][0], fmt=fmt))
        assert (scheme.weight_strategy, scheme.block_size) == ("block", (128, 128))
    for fmt in ("e5m2", "float8_e5m2"):
        with pytest.raises(ConfigError, match=f"fp8 fmt '{fmt}' is not supported"):
            parse_quantization_config(dict(HUB["fp8-block"][0], fmt=fmt))


def test_fp8_method_reads_ignored_layers_before_modules_to_not_convert():
    """vLLM's Fp8Config reads ignored_layers, and modules_to_not_convert only where that is empty (kvfit read them
    the other way round and refused a checkpoint whose lists differ)."""
    quant = dict(HUB["fp8-block"][0], ignored_layers=["lm_head", "down_proj"], modules_to_not_convert=["lm_head"])
    scheme = parse_quantization_config(quant)
    assert scheme.ignore == ("lm_head", "down_proj") and not scheme.quantizes("model.layers.3.mlp.down_proj")
    scheme = parse_quantization_config(dict(quant, ignored_layers=[]))
    assert scheme.ignore == ("lm_head",) and scheme.quantizes("model.layers.3.mlp.down_proj")


def test_dynamic_activations_are_quantized_as_the_weights_gemm_reads_them():
    """compressed-tensors' dynamic activations of any strategy run as vLLM's CompressedTensorsW8A8Fp8 runs them: per
    token and block column under block weights, per token under channel or tensor weights (both were refused)."""
    base = HUB["ct-fp8-dynamic"][0]
    group = base["config_groups"]["group_0"]

    def with_(weights, acts):
        return dict(base, config_groups={"group_0": dict(group, weights=dict(group["weights"], **weights),
                                                          input_activations=dict(group["input_activations"], **acts))})
    block = {"strategy": "block", "block_structure": [128, 128]}
    for acts, want in (({"strategy": "token"}, "group"), ({"strategy": "tensor"}, "group"),
                       ({"strategy": "group", "group_size": 128}, "group")):
        assert parse_quantization_config(with_(block, acts)).activation == want
    for weights in ({"strategy": "channel"}, {"strategy": "tensor"}):
        scheme = parse_quantization_config(with_(weights, {"strategy": "group", "group_size": 128}))
        assert scheme.activation == "token"
    with pytest.raises(ConfigError, match=r"input_activations strategy 'tensor' \(dynamic False\) with block"):
        parse_quantization_config(with_(block, {"strategy": "tensor", "dynamic": False}))


def _transform(*locations: str) -> dict:
    """A compressed-tensors transform_config (QuIP / SpinQuant) applying one Hadamard at each location."""
    apply = [{"targets": ["Linear"], "location": loc, "inverse": i % 2 == 1, "ignore": ["lm_head"]}
             for i, loc in enumerate(locations)]
    return {"config_groups": {"u": {"type": "hadamard", "apply": apply, "randomize": False, "requires_grad": False,
                                    "head_dim": None}}}


def test_online_transforms_are_refused_fused_ones_load():
    """A transform applied to activations at run time (QuIP's "input") was dropped silently: the rotated weights
    then ran on unrotated inputs. Transforms fused into the weights offline need nothing at run time."""
    quant = HUB["ct-fp8-dynamic"][0]
    for online in (_transform("input", "weight_input"), _transform("weight_output", "output"), _transform("q_attn")):
        with pytest.raises(ConfigError, match=r"transform_config group 'u' applies a rotation at location "
                                              r"'[a-z_]+' at run time, which is not supported") as info:
            parse_quantization_config(dict(quant, transform_config=online))
        assert "\n" not in str(info.value)
    fused = parse_quantization_config(dict(quant, transform_config=_transform("weight_output", "weight_input")))
    assert fused == parse_quantization_config(quant)
    with pytest.raises(ConfigError, match=r"transform_config must be"):
        parse_quantization_config(dict(quant, transform_config=["input"]))


@pytest.mark.parametrize("quant", [dict(HUB["ct-fp8-dynamic"][0], ignore=["lm_head", "re:*.gate"]),
                                   dict(HUB["fp8-block"][0], modules_to_not_convert=["re:(gate"])])
def test_an_ignore_pattern_that_is_no_regex_is_a_config_error(quant):
    """It raised re.error from deep inside the model's construction."""
    with pytest.raises(ConfigError, match=r"is not a valid regular expression") as info:
        parse_quantization_config(quant)
    assert "\n" not in str(info.value)


def _int4_tensors(folder: str, awq: bool) -> None:
    """Replace every decoder linear's weight with AutoGPTQ's (or AutoAWQ's) packed int4 tensors."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if LINEAR.fullmatch(n)]:
        rows, cols = tensors.pop(name).shape
        prefix = name.removesuffix(".weight")
        packed = (cols, rows // 8) if awq else (cols // 8, rows)
        tensors[f"{prefix}.qweight"] = torch.zeros(packed, dtype=torch.int32)
        tensors[f"{prefix}.qzeros"] = torch.zeros((1, rows // 8), dtype=torch.int32)
        tensors[f"{prefix}.scales"] = torch.ones((1, rows), dtype=torch.float16)
    save_file(tensors, path, metadata={"format": "pt"})


def _declared_elsewhere(tiny, name: str) -> str:
    """A checkpoint whose quantization is declared outside config.json's quantization_config, as the Hub has them."""
    root, src = tiny
    folder = str(root / name)
    shutil.copytree(src["llama"], folder)
    _int4_tensors(folder, awq=name == "quant_config.json")
    _write_json(folder, name, {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq"}
                if name == "quantize_config.json" else {"zero_point": True, "q_group_size": 128, "w_bit": 4,
                                                         "version": "GEMM"})
    return folder


def _write_json(folder: str, name: str, content: dict) -> None:
    with open(os.path.join(folder, name), "w") as fh:
        json.dump(content, fh)


def _edit_config(folder: str, edit) -> None:
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    edit(config)
    _write_json(folder, "config.json", config)


@pytest.mark.parametrize("name,message", [
    ("quantize_config.json", r"quantize_config.json declares quantized weights \(quant_method 'gptq'\)"),
    ("quant_config.json", r"quant_config.json declares quantized weights \(4-bit\)"),
])
def test_quantization_declared_outside_quantization_config_is_named(tiny, name, message):
    """These failed as 'missing tensor ...q_proj.weight' or 'restore the checkpoint's config.json' (it is as
    shipped); the error now names where the quantization is declared and what it is, with or without
    --quantization fp8."""
    folder = _declared_elsewhere(tiny, name)
    for quantization in (None, "fp8"):
        with pytest.raises(ConfigError, match=message) as info:
            _logits(folder, quantization)
        assert "\n" not in str(info.value)


def test_compression_config_is_read_as_the_quantization_config(tiny):
    """Older llm-compressor releases wrote the scheme under compression_config; vLLM reads it when
    quantization_config is absent, and so does kvfit: the same logits as the quantization_config copy."""
    root, src = tiny
    fp8, _ = _hub_copy(src["llama"], root / "ct-dynamic-renamed", "ct-fp8-dynamic")
    want = _logits(fp8)[0]
    _edit_config(fp8, lambda config: config.update(compression_config=config.pop("quantization_config")))
    assert torch.equal(_logits(fp8)[0], want)


def test_a_stray_quantization_file_beside_16_bit_weights_is_not_an_error(tiny):
    root, src = tiny
    folder = str(root / "stray")
    shutil.copytree(src["llama"], folder)
    _write_json(folder, "quantize_config.json", {"bits": 4, "quant_method": "gptq"})
    got, _ = _logits(folder)
    assert torch.equal(got, _logits(src["llama"])[0])


def _modelopt_file_copy(tiny, dst, quantization: dict) -> tuple[str, str]:
    """NVIDIA's older ModelOpt export: FP8 tensors, config.json without quantization_config, hf_quant_config.json."""
    fp8, deq = _hub_copy(tiny[1]["llama"], dst, "modelopt-fp8")
    _edit_config(fp8, lambda config: config.pop("quantization_config"))
    _write_json(fp8, "hf_quant_config.json", {"producer": {"name": "modelopt", "version": "0.19.0"},
                                              "quantization": quantization})
    return fp8, deq


def test_modelopt_declared_in_hf_quant_config_json_loads(tiny, tmp_path):
    """It was refused ('declares quantized weights (modelopt FP8)'); vLLM reads the file, and so does kvfit: the
    same logits as the dequantized reference; --quantization modelopt names it, fp8 contradicts it."""
    fp8, deq = _modelopt_file_copy(tiny, tmp_path, {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                                           "exclude_modules": ["lm_head"]})
    scheme = load_model_facts(fp8).quantization
    assert (scheme.method, scheme.weight_strategy, scheme.activation) == ("modelopt", "tensor", "static")
    got, tokens = _logits(fp8)
    _assert_matches(got, _reference(deq, tokens, "modelopt-fp8"))
    assert torch.equal(_logits(fp8, "modelopt")[0], got)
    with pytest.raises(ConfigError, match="does not match the checkpoint's quant_method 'modelopt'"):
        _logits(fp8, "fp8")


@pytest.mark.parametrize("quantization,message", [
    ({"quant_algo": "NVFP4", "kv_cache_quant_algo": None}, r"ModelOpt quant_algo 'NVFP4' is not supported"),
    ({"quant_algo": "FP8_PB_WO"}, r"ModelOpt quant_algo 'FP8_PB_WO' is not supported"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, r"kv_cache_quant_algo 'NVFP4' is not supported"),
    ({"quant_algo": None, "kv_cache_quant_algo": None}, r"quantizes nothing"),
    ({"quant_algo": "FP8", "exclude_modules": "lm_head"}, r"'exclude_modules' must be a list")])
def test_modelopt_schemes_kvfit_cannot_run_are_named(tiny, tmp_path, quantization, message):
    fp8, _ = _modelopt_file_copy(tiny, tmp_path, quantization)
    with pytest.raises(ConfigError, match=message) as info:
        load_model_facts(fp8)
    assert "\n" not in str(info.value)


def test_modelopt_exclude_wildcards_keep_their_layers_16_bit(tiny):
    """ModelOpt writes exclude_modules as fnmatch wildcards ('model.layers.0.self_attn*'): those layers load
    16-bit, the others FP8, and the model equals the reference with exactly those layers dequantized."""
    from fp8_checkpoints import write_fp8_copy
    root, src = tiny
    fp8, _ = write_fp8_copy(src["llama"], root / "modelopt-wild", "ct-static", skip=("layers.0.self_attn",))
    _edit_config(fp8, lambda config: config.update(quantization_config={
        "quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "model.layers.0.self_attn*"]}))
    scheme = load_model_facts(fp8).quantization
    assert not scheme.quantizes("model.layers.0.self_attn.q_proj") and not scheme.quantizes("lm_head")
    assert scheme.quantizes("model.layers.1.self_attn.q_proj") and scheme.quantizes("model.layers.0.mlp.up_proj")
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    got, tokens = _logits(fp8)
    deq = _dequantized(fp8, str(root / "modelopt-wild-deq"), tensors, None)
    _assert_matches(got, _reference(deq, tokens, "modelopt-fp8", skip=("layers.0.self_attn",)))


def test_a_modelopt_kv_cache_only_export_loads_its_16_bit_weights(tiny):
    """hf_quant_config.json with quant_algo null and kv_cache_quant_algo FP8: the weights are 16-bit and the
    config declares k/v scales (models/kv_scales.py reads them)."""
    root, src = tiny
    folder = str(root / "modelopt-kv-only")
    shutil.copytree(src["llama"], folder)
    _write_json(folder, "hf_quant_config.json", {"producer": {"name": "modelopt"},
                                                 "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}})
    facts = load_model_facts(folder)
    assert facts.quantization is None and facts.kv_cache_scales
    assert torch.equal(_logits(folder)[0], _logits(src["llama"])[0])


def test_quantization_names_a_checkpoint_method_as_vllm_does(tiny):
    """--quantization compressed-tensors / modelopt name an FP8 checkpoint's method (vLLM's values); on a 16-bit
    checkpoint they are refused (only fp8 quantizes at load), never taken as online fp8."""
    root, src = tiny
    fp8, _ = _hub_copy(src["llama"], root / "ct-named", "ct-fp8-dynamic")
    assert load_model_facts(fp8, "compressed-tensors").quantization == load_model_facts(fp8).quantization
    with pytest.raises(ConfigError, match="does not match the checkpoint's quant_method 'compressed-tensors'"):
        load_model_facts(fp8, "modelopt")
    for method in ("compressed-tensors", "modelopt"):
        with pytest.raises(ConfigError, match=f"--quantization {method} reads a {method} checkpoint") as info:
            load_model_facts(src["llama"], method)
        assert "--quantization fp8" in str(info.value)

