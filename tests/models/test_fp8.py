"""FP8 checkpoints (compressed-tensors and block-wise fp8) and --quantization fp8 through kvfit's real loader,
against transformers running the dequantized weights with kvfit's activation quantization (fake-quant hooks);
unsupported quantization configs are one-line errors, never a silent 16-bit load."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    # triton.language must first be imported in interpreter mode, or kernel tests collected after this
    # module in the same run (tests/kernels/test_fp8_gemm.py, test_fused_moe.py) cannot interpret their kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp8_checkpoints import (fake_quant_experts, fake_quant_hooks, quantization_config,  # noqa: E402
                             write_fp8_copy)
from paged_batch import PagedCache, hf_logits, random_tokens  # noqa: E402

from kvfit.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvfit.errors import ConfigError  # noqa: E402
from kvfit.kernels.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight_per_channel  # noqa: E402
from kvfit.model_facts import facts_from_config, load_model_facts  # noqa: E402
from kvfit.models.loader import load_model  # noqa: E402
from kvfit.models.linear import SplitColumnLinear  # noqa: E402
from kvfit.models.quant.linear import Fp8Linear  # noqa: E402
from kvfit.quant_scheme import parse_quantization_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_phi3 import make_tiny_phi3  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

BACKEND = TorchReferenceBackend()
FLIP_ATOL = 3e-2


def _logits(folder: str, quantization: str | None = None, load_format: str = "auto"):
    facts = load_model_facts(folder, quantization)
    model = load_model(folder, facts, torch.float32, "cpu", BACKEND, load_format=load_format)
    tokens = random_tokens(facts.vocab_size, 11, seed=0)
    input_ids, positions, meta = PagedCache(facts).step([("s", 0, tokens)])
    with torch.inference_mode():
        return model, model.compute_logits(model(input_ids, positions, None, meta)), tokens


def _reference(folder: str, tokens, fmt: str, block=(128, 128), experts: bool = False):
    return _reference_skipping(folder, tokens, fmt, block, experts)


def _reference_skipping(folder: str, tokens, fmt: str, block=(128, 128), experts: bool = False, skip=()):
    """transformers on the dequantized weights, quantizing the inputs of the linears not in `skip`."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fake_quant_hooks(hf, fmt, block, skip)
    if experts:
        assert fake_quant_experts(hf, fmt, block) > 0
    return hf_logits(hf, tokens)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return root, {arch: make_tiny_model(root, arch=arch) for arch in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.mark.parametrize("arch,fmt", [("llama", "ct-channel"), ("llama", "ct-tensor"), ("llama", "ct-static"),
                                      ("llama", "block"), ("qwen2", "ct-tensor"), ("qwen3", "block"),
                                      ("qwen3", "ct-channel"), ("mistral", "ct-channel")])
def test_dense_fp8_checkpoint_matches_the_dequantized_reference(models, arch, fmt):
    root, src = models
    fp8, deq = write_fp8_copy(src[arch], root / f"{arch}-{fmt}", fmt)
    model, got, tokens = _logits(fp8)
    qkv = model.model.layers[0].self_attn.qkv_proj
    # one fused FP8 GEMM, or one per part where block scales straddle two parts (128-row blocks, 64 q rows)
    linears = list(qkv.parts) if isinstance(qkv, SplitColumnLinear) else [qkv]
    assert isinstance(qkv, SplitColumnLinear) == (fmt == "block")
    assert all(isinstance(m, Fp8Linear) and m.weight.dtype == FP8_DTYPE for m in linears)
    assert model.lm_head.weight.dtype == torch.float32            # ignored by the checkpoint: model dtype
    want = _reference(deq, tokens, fmt)
    # the same fp8 values and scales; fp32 summation order differs, and a 1e-7 difference can move one
    # activation across an fp8 rounding boundary (one e4m3 step): FLIP_ATOL. Skipping the activation
    # quantization alone is 0.2 off here; a wrong scale is off by the logits' size.
    assert torch.allclose(got, want, atol=FLIP_ATOL), (got - want).abs().max()
    assert got[-1].argmax() == want[-1].argmax()


def test_per_tensor_scales_stored_as_0_dim_tensors_load(models):
    """Some Hub checkpoints store a per-tensor weight_scale / input_scale as a 0-dim tensor, not [1]."""
    import os

    from safetensors.torch import load_file, save_file
    root, src = models
    fp8, _ = write_fp8_copy(src["llama"], root / "llama-0dim", "ct-static")
    _, want, _ = _logits(fp8)
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    scalars = {n: t.reshape(()) if n.endswith(("weight_scale", "input_scale")) else t for n, t in tensors.items()}
    assert any(t.dim() == 0 for t in scalars.values())
    save_file(scalars, path, metadata={"format": "pt"})
    _, got, _ = _logits(fp8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor", "ct-static", "block"])
def test_phi3_fused_fp8_tensors_split_into_their_parts(tmp_path, fmt):
    """Phi-3 stores qkv_proj and gate_up_proj fused; its FP8 checkpoints quantize each as one module (one per-tensor
    scale, per-channel scales over the fused rows, block scales over its row blocks): kvfit's parts take their rows
    of each and give the dequantized model's logits."""
    folder = make_tiny_phi3(tmp_path)
    block = (32, 32)                    # whole blocks of every part (q 64, k and v 32, gate and up 96 rows)
    fp8, deq = write_fp8_copy(folder, tmp_path, fmt, block=block)
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" + ("_inv" if fmt == "block" else "") in \
        load_file(os.path.join(fp8, "model.safetensors"))
    model, got, tokens = _logits(fp8)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    want = _reference(deq, tokens, fmt, block)
    assert torch.allclose(got, want, atol=FLIP_ATOL), (got - want).abs().max()
    assert got[-1].argmax() == want[-1].argmax()


def test_each_rank_holds_its_rows_of_phi3s_fused_per_channel_scales(tmp_path):
    """Two ranks (in-process, loading only): each holds its rows of q, k and v (gate and up) of the fused FP8 weight
    and of its per-channel scales, the rows one rank holds. (Per-token activation scales differ between ranks in
    the row-parallel layers, so logits are compared over ranks with static scales, in the test above.)"""
    fp8, _ = write_fp8_copy(make_tiny_phi3(tmp_path), tmp_path, "ct-channel")
    facts = load_model_facts(fp8)
    one = load_model(fp8, facts, torch.float32, "cpu", BACKEND).model.layers[1]
    d, inter = facts.head_dim, facts.intermediate_size
    q_rows, kv_rows = facts.num_attention_heads * d, facts.num_kv_heads * d
    for rank in range(2):
        layer = load_model(fp8, facts, torch.float32, "cpu", BACKEND, tp_rank=rank, tp_size=2).model.layers[1]
        for name in ("weight", "weight_scale"):
            qkv = getattr(one.self_attn.qkv_proj, name)
            q, k, v = qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:]
            half = [t.chunk(2)[rank] for t in (q, k, v)]
            assert torch.equal(getattr(layer.self_attn.qkv_proj, name).float(), torch.cat(half).float())
            gate, up = getattr(one.mlp.gate_up_proj, name).split(inter)
            assert torch.equal(getattr(layer.mlp.gate_up_proj, name).float(),
                               torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]).float())


@pytest.mark.parametrize("skip,ignore", [
    ("layers.1.mlp.gate_up_proj", "model.layers.1.mlp.gate_up_proj"),
    ("layers.1.self_attn.qkv_proj", r"re:.*layers\.1\.self_attn\.qkv.*"),      # a pattern not spelling the name
    ("mlp.gate_up_proj", "re:.*up_proj$"),                                     # matches up_proj, not gate_proj
], ids=["name", "regex-prefix", "regex-suffix"])
def test_phi3_ignore_lists_name_the_fused_modules(tmp_path, skip, ignore):
    """The ignore list names the checkpoint's modules: every part of an ignored fused module stays 16-bit (and
    no other), whatever its own name would match."""
    folder = make_tiny_phi3(tmp_path)
    fp8, deq = write_fp8_copy(folder, tmp_path / "ignored", "ct-channel", skip=(skip,))
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    config["quantization_config"]["ignore"] += [ignore]
    json.dump(config, open(path, "w"))
    model, got, tokens = _logits(fp8)
    for i, layer in enumerate(model.model.layers):
        for name, fused in (("self_attn.qkv_proj", layer.self_attn.qkv_proj), ("mlp.gate_up_proj", layer.mlp.gate_up_proj)):
            ignored = skip in f"layers.{i}.{name}"
            assert isinstance(fused, Fp8Linear) != ignored, (i, name)
    hf = _reference_skipping(deq, tokens, "ct-channel", skip=(skip,))
    assert torch.allclose(got, hf, atol=FLIP_ATOL), (got - hf).abs().max()


def test_phi3_errors_name_the_fused_tensor_the_checkpoint_holds(tmp_path):
    """A bad scale of a fused module is reported by the name in the checkpoint (qkv_proj.weight_scale), not by the
    part kvfit loads it into (q_proj.weight_scale)."""
    from safetensors.torch import save_file
    fp8, _ = write_fp8_copy(make_tiny_phi3(tmp_path), tmp_path, "ct-channel")
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.qkv_proj.weight_scale"] = torch.ones(3, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight_scale") as err:
        _logits(fp8)
    assert "q_proj" not in str(err.value).replace("qkv_proj", "")


def test_phi3_block_scales_straddling_a_part_are_an_error(tmp_path):
    """Block scales where a part starts inside a row block and leaves it (up_proj at row 96 of 128-row blocks)
    cannot be split: a one-line error."""
    folder = make_tiny_phi3(tmp_path)
    fp8, _ = write_fp8_copy(folder, tmp_path / "straddle", "block")
    with pytest.raises(ConfigError, match=r"gate_up_proj.weight_scale_inv: a part of gate_up_proj starts at row 96, "
                                          r"inside a 128-row scale block"):
        _logits(fp8)


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "block"), ("mixtral", "ct-channel"), ("qwen2_moe", "ct-tensor"),
                                      ("mixtral", "ct-static"), ("qwen3_moe", "ct-static")])
def test_moe_fp8_checkpoint_matches_the_dequantized_reference(tmp_path, arch, fmt):
    moe = {"shared_expert_intermediate_size": 64} if arch == "qwen2_moe" else None
    src = make_tiny_model(tmp_path, arch=arch, moe=moe)
    block = (32, 32)                   # whole blocks of the tiny experts' 32 channels
    fp8, deq = write_fp8_copy(src, tmp_path, fmt, block=block)
    model, got, tokens = _logits(fp8)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.down_proj.dtype == FP8_DTYPE
    want = _reference(deq, tokens, fmt, block, experts=True)
    assert torch.allclose(got, want, atol=FLIP_ATOL), (got - want).abs().max()
    assert got[-1].argmax() == want[-1].argmax()


@pytest.mark.parametrize("fmt", ["block", "ct-channel", "ct-static"])
def test_a_qwen3_moe_router_in_fp8_is_read_dequantized(tmp_path, fmt):
    """An FP8 checkpoint whose router (mlp.gate) is quantized too (llm-compressor without a gate ignore): vLLM's
    Qwen3-MoE quantizes its router with the scheme and loads it, so kvfit reads it dequantized into its 16-bit
    router (it was refused); Mixtral's router vLLM never quantizes, and kvfit still refuses one in FP8. A router
    weight without its scale is named."""
    src = make_tiny_model(tmp_path, arch="qwen3_moe")
    fp8, deq = write_fp8_copy(src, tmp_path, fmt, block=(32, 32), router=True)
    assert "model.layers.0.mlp.gate.weight_scale" + ("_inv" if fmt == "block" else "") in load_file(
        os.path.join(fp8, "model.safetensors"))
    model, got, tokens = _logits(fp8)
    assert model.model.layers[0].mlp.gate.weight.dtype != FP8_DTYPE
    want = _reference(deq, tokens, fmt, (32, 32), experts=True)
    assert torch.allclose(got, want, atol=FLIP_ATOL), (got - want).abs().max()
    if fmt != "ct-channel":
        return
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.gate.weight_scale"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing tensor model\.layers\.1\.mlp\.gate\.weight_scale"):
        _logits(fp8)
    mixtral = make_tiny_model(tmp_path, arch="mixtral")
    fp8, _ = write_fp8_copy(mixtral, tmp_path / "mixtral", fmt, router=True)
    with pytest.raises(ConfigError, match=r"block_sparse_moe\.gate\.weight is quantized but kvfit holds"):
        _logits(fp8)


def test_static_fp8_experts_take_the_largest_scale_and_a_missing_one_is_named(tmp_path):
    """AutoFP8 / compressed-tensors static experts: one input scale per expert and projection; the layer's GEMMs
    quantize with the largest (vLLM's rule), and an expert whose input_scale is absent is a one-line error."""
    from safetensors.torch import load_file, save_file
    src = make_tiny_model(tmp_path, arch="mixtral")
    fp8, _ = write_fp8_copy(src, tmp_path, "ct-static")
    path = os.path.join(fp8, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.block_sparse_moe.experts.1.w3.input_scale"] = torch.tensor([0.25])
    save_file(tensors, path, metadata={"format": "pt"})
    experts = _logits(fp8)[0].model.layers[0].mlp.experts
    gate_up, down = experts.input_scales()
    assert gate_up.tolist() == [0.25] and down.tolist() == [pytest.approx(1 / 32)]
    del tensors["model.layers.1.block_sparse_moe.experts.2.w2.input_scale"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"experts\.2\.w2\.input_scale"):
        _logits(fp8)


def test_ignored_layers_stay_in_the_model_dtype(models):
    root, src = models
    fp8, deq = write_fp8_copy(src["llama"], root / "ignore", "ct-channel", skip=(".mlp.down_proj",))
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp[.]down_proj$"]
    json.dump(config, open(path, "w"))
    model, got, tokens = _logits(fp8)
    mlp = model.model.layers[1].mlp
    assert mlp.down_proj.weight.dtype == torch.float32 and mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    for handle, (name, _) in zip(fake_quant_hooks(hf, "ct-channel"), _quantized_linears(hf)):
        if name.endswith("down_proj"):
            handle.remove()
    assert torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)


@pytest.mark.parametrize("fmt,key", [("ct-channel", "ignore"), ("block", "modules_to_not_convert")])
def test_an_ignore_list_naming_the_fused_module_keeps_its_parts_16_bit(models, fmt, key):
    """An ignore list may name the module vLLM fuses the checkpoint's projections into (self_attn.qkv_proj,
    mlp.gate_up_proj; vLLM's is_layer_skipped and should_ignore_layer honour it): q/k/v and gate/up stay 16-bit
    (they were refused as a mismatch with the checkpoint), the logits those of the partly dequantized reference."""
    root, src = models
    fp8, deq = write_fp8_copy(src["llama"], root / f"fused-ignore-{fmt}", fmt,
                              skip=("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.1.self_attn.q_proj",
                                    "layers.1.self_attn.k_proj", "layers.1.self_attn.v_proj"))
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    config["quantization_config"][key] = ["lm_head", "model.layers.0.mlp.gate_up_proj", "layers.1.self_attn.qkv_proj"]
    json.dump(config, open(path, "w"))
    model, got, tokens = _logits(fp8)
    layers = model.model.layers

    def weight_dtypes(module):       # a fused layer's, or its parts' (block scales the parts do not fill split it)
        return {p.dtype for n, p in module.named_parameters() if n.rsplit(".", 1)[-1] == "weight"}
    assert weight_dtypes(layers[0].mlp.gate_up_proj) == {torch.float32} == weight_dtypes(layers[1].self_attn.qkv_proj)
    assert weight_dtypes(layers[1].mlp.gate_up_proj) == {FP8_DTYPE} == weight_dtypes(layers[0].self_attn.qkv_proj)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    fake_quant_hooks(hf, fmt, skip=("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.1.self_attn.q_proj",
                                    "layers.1.self_attn.k_proj", "layers.1.self_attn.v_proj"))
    assert torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)


def test_fbgemm_fp8_checkpoint_caps_each_tokens_amax(models):
    """quant_method fbgemm_fp8 (Meta's Llama FP8 releases): per-channel weights, per-token activations whose amax is
    capped at activation_scale_ub (values past it saturate), modules_to_not_convert 16-bit. The logits are the
    dequantized reference's with that cap (set low here, so that it bites), and differ from the uncapped one's."""
    from kvfit.kernels.fp8 import Fp8Weight, dequantize_activations, quantize_activations
    root, src = models
    fp8, deq = write_fp8_copy(src["llama"], root / "fbgemm", "ct-channel", skip=(".mlp.down_proj",))
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    ub = 0.05
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub,
                                     "modules_to_not_convert": ["lm_head", "down_proj"]}
    json.dump(config, open(path, "w"))
    model, got, tokens = _logits(fp8)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.qweight.input_scale_ub == ub
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    capped = Fp8Weight(torch.empty(0), torch.empty(0), None, None, ub)

    def hook(_module, args):
        x = args[0]
        xq, scale = quantize_activations(x.reshape(-1, x.shape[-1]), capped)
        assert float(scale.max()) <= ub / 448 * (1 + 1e-6)
        return (dequantize_activations(xq, scale, capped).to(x.dtype).reshape(x.shape),)
    handles = [m.register_forward_pre_hook(hook) for n, m in _quantized_linears(hf) if not n.endswith("down_proj")]
    assert torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)
    for handle in handles:
        handle.remove()
    fake_quant_hooks(hf, "ct-channel", skip=(".mlp.down_proj",))           # no cap: another model
    assert not torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)


@pytest.mark.parametrize("ub", [None, 0, -1.0, float("inf"), "1200", True])
def test_fbgemm_fp8_needs_a_positive_activation_scale_ub(ub):
    from kvfit.quant_scheme import parse_quantization_config
    quant = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}
    if ub is not None:
        quant["activation_scale_ub"] = ub
    with pytest.raises(ConfigError, match="fbgemm_fp8 needs activation_scale_ub, a positive number") as info:
        parse_quantization_config(quant)
    assert "\n" not in str(info.value)


def test_config_groups_may_target_layers_by_pattern(models):
    """compressed-tensors' targets by "re:" pattern or name (vLLM's find_matched_target): groups of one scheme over
    the attention and the MLP load as one; a layer no group targets stays 16-bit (here the MLPs: the logits are
    the reference's with only the attention quantized); a module class other than Linear is a one-line error."""
    from kvfit.quant_scheme import parse_quantization_config
    root, src = models
    fp8, deq = write_fp8_copy(src["llama"], root / "targets", "ct-channel", skip=(".mlp.",))
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    quant = config["quantization_config"]
    group = quant["config_groups"].pop("group_0")
    quant["config_groups"] = {"attention": dict(group, targets=["re:.*self_attn[.](q|k|v)_proj$"]),
                              "output": dict(group, targets=["re:.*o_proj$"])}
    json.dump(config, open(path, "w"))
    model, got, tokens = _logits(fp8)
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8_DTYPE == layer.self_attn.o_proj.weight.dtype
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float32 == layer.mlp.down_proj.weight.dtype
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    fake_quant_hooks(hf, "ct-channel", skip=(".mlp.",))
    assert torch.allclose(got, hf_logits(hf, tokens), atol=FLIP_ATOL)
    both = dict(quant, config_groups={"a": dict(group, targets=["re:.*self_attn.*"]), "b": dict(group, targets=["Linear"])})
    assert parse_quantization_config(both).targets == ()                   # "Linear" in any group: every layer
    named = dict(quant, config_groups={"a": dict(group, targets=["lm_head", "re:.*o_proj$"])})   # a top-level name
    assert parse_quantization_config(named).targets == ("lm_head", "re:.*o_proj$")
    for bad in (["Embedding"], ["Linear", ""], "Linear", ["re:(q"]):
        with pytest.raises(ConfigError, match="targets") as info:
            parse_quantization_config(dict(quant, config_groups={"g": dict(group, targets=bad)}))
        assert "\n" not in str(info.value)


def _quantized_linears(hf):
    from fp8_checkpoints import LINEAR
    return [(n, m) for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and LINEAR.fullmatch(n + ".weight")]


def test_online_fp8_is_per_channel_and_matches_its_reference(models, tmp_path):
    """--quantization fp8 on a 16-bit checkpoint: every linear per output channel, activations per token."""
    from safetensors.torch import load_file, save_file
    root, src = models
    model, got, tokens = _logits(src["qwen3"], quantization="fp8")
    q = model.model.layers[0].self_attn.qkv_proj
    assert q.weight.dtype == FP8_DTYPE and q.weight_scale.shape == (q.weight.shape[0], 1)
    # the reference: the checkpoint's weights quantized per channel and dequantized, in transformers
    import shutil
    deq = str(tmp_path / "deq")
    shutil.copytree(src["qwen3"], deq)
    tensors = load_file(os.path.join(deq, "model.safetensors"))
    from fp8_checkpoints import LINEAR
    for name, w in tensors.items():
        if LINEAR.fullmatch(name):
            tensors[name] = dequantize_weight(*quantize_weight_per_channel(w), None)
    save_file(tensors, os.path.join(deq, "model.safetensors"), metadata={"format": "pt"})
    assert torch.allclose(got, _reference(deq, tokens, "ct-channel"), atol=FLIP_ATOL)
    _, bf16, _ = _logits(src["qwen3"])
    # against the unquantized model: within fp8's precision (3 mantissa bits on weights and activations)
    assert (got - bf16).abs().max() < 0.1 * bf16.abs().max()


def test_online_fp8_with_dummy_weights_holds_one_byte_a_weight(models):
    root, src = models
    model, got, _ = _logits(src["llama"], quantization="fp8", load_format="dummy")
    assert torch.isfinite(got).all()
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 2 * 4 and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert all(m.weight_scale.abs().min() > 0 for m in linears)


def test_fp8_tensors_without_quantization_config_are_an_error(models):
    """The bug this fixes: an FP8 checkpoint whose config.json lacks quantization_config loaded as garbage."""
    root, src = models
    fp8, _ = write_fp8_copy(src["llama"], root / "noconfig", "ct-channel")
    path = os.path.join(fp8, "config.json")
    config = json.load(open(path))
    del config["quantization_config"]
    json.dump(config, open(path, "w"))
    with pytest.raises(ConfigError, match=r"float8_e4m3fn \(an FP8 checkpoint's\) but config.json has no "
                                          r"quantization_config"):
        _logits(fp8)


def test_a_16_bit_tensor_where_fp8_is_declared_is_an_error(models):
    root, src = models
    folder = str(root / "declared")
    import shutil
    shutil.copytree(src["llama"], folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config["quantization_config"] = quantization_config("block")
    json.dump(config, open(path, "w"))
    with pytest.raises(ConfigError, match=r"is float32 but quantization_config \(fp8\) says float8_e4m3fn"):
        _logits(folder)


def test_quantization_flag_must_match_the_checkpoint(models):
    root, src = models
    fp8, _ = write_fp8_copy(src["llama"], root / "mismatch", "ct-channel")
    with pytest.raises(ConfigError, match=r"--quantization fp8 does not match the checkpoint's quant_method "
                                          r"'compressed-tensors'"):
        load_model_facts(fp8, "fp8")
    block, _ = write_fp8_copy(src["llama"], root / "match", "block")
    assert load_model_facts(block, "fp8").quantization.weight_strategy == "block"


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported; kvfit runs FP8"),
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fp8 fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "store_dtype": "bf16"},
     r"store_dtype 'bf16' is not supported; kvfit reads fp8 weights stored as e4m3"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     r"block-wise fp8 needs activation_scheme dynamic"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be \[rows, columns\]"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     r"compressed-tensors format 'pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     r"format 'int-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     r"weights of 4 bits, type 'int' are not supported; kvfit runs 8-bit float"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     r"weight-only FP8 \(no input_activations\) is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Embedding"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     r"targets \['Embedding'\] are not supported"),
    ({"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {}},
     r"sparsity \('sparse-24-bitmask'\) is not supported"),
])
def test_unsupported_quantization_configs_are_one_line_errors(quant, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_quantization_config(quant)
    assert "\n" not in str(info.value)


def test_hub_quantization_configs_parse():
    qwen3_fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                 "weight_block_size": [128, 128]}
    scheme = parse_quantization_config(qwen3_fp8)
    assert (scheme.weight_strategy, scheme.activation, scheme.block_size, scheme.scale_name) == \
        ("block", "group", (128, 128), "weight_scale_inv")
    dynamic = quantization_config("ct-channel")              # the "-FP8-dynamic" releases' layout
    scheme = parse_quantization_config(dynamic)
    assert (scheme.weight_strategy, scheme.activation, scheme.quantizes("lm_head")) == ("channel", "token", False)
    assert scheme.quantizes("model.layers.0.self_attn.q_proj")
    block_ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*gate$"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                    "dynamic": False, "symmetric": True}, "input_activations": {
                    "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}}}}
    scheme = parse_quantization_config(block_ct)
    assert scheme.block_size == (128, 128) and scheme.scale_name == "weight_scale"
    assert not scheme.quantizes("model.layers.3.mlp.gate") and scheme.quantizes("model.layers.3.mlp.gate_proj")
    # compressed-tensors' dynamic per-tensor activations run per token (finer: at least as accurate)
    per_tensor = quantization_config("ct-tensor")
    per_tensor["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
    assert parse_quantization_config(per_tensor).activation == "token"
    assert parse_quantization_config({**qwen3_fp8, "quant_method": "FP8"}).block_size == (128, 128)


def test_plan_counts_the_layers_an_ignore_list_or_targets_keep_16_bit(models):
    """weight_bytes (kvfit plan, dummy loads) counts a linear layer the scheme leaves in 16 bits at 2 bytes: the
    parameters the loaded model holds in each dtype, for an ignore list and for targets."""
    import dataclasses
    root, src = models
    facts = load_model_facts(src["llama"], "fp8")
    model = load_model(src["llama"], facts, torch.float32, "cpu", BACKEND)

    def fp8_params(m):
        return sum(p.numel() for p in m.parameters() if p.dtype == FP8_DTYPE)
    assert facts.quantized_params == fp8_params(model)
    for scheme in (dataclasses.replace(facts.quantization, ignore=("down_proj", "layers.0.self_attn.qkv_proj")),
                   dataclasses.replace(facts.quantization, targets=("re:.*self_attn.*",))):
        kept = dataclasses.replace(facts, quantization=scheme)
        partial = load_model(src["llama"], kept, torch.float32, "cpu", BACKEND)
        assert 0 < kept.quantized_params == fp8_params(partial) < facts.quantized_params


def test_plan_counts_fp8_weights(models):
    from kvfit.platforms.estimate import estimate_weights_bytes
    bf16 = load_model_facts("llama-3.1-8b")
    fp8 = load_model_facts("llama-3.1-8b", "fp8")
    embed = 2 * bf16.vocab_size * bf16.hidden_size * 2                # embed_tokens and lm_head stay bf16
    assert fp8.weight_bytes == estimate_weights_bytes(fp8, None, 1)
    assert abs(fp8.weight_bytes - (bf16.weight_bytes - embed) / 2 - embed) < 0.01 * fp8.weight_bytes
    assert estimate_weights_bytes(fp8, None, 2) == fp8.weight_bytes // 2
    with pytest.raises(ConfigError, match=r"--quantization 'int4' is not supported"):
        load_model_facts("llama-3.1-8b", "int4")
    raw = dict(bf16.raw, quantization_config={"quant_method": "awq"})
    with pytest.raises(ConfigError, match=r"quant_method 'awq'"):
        facts_from_config(raw)


def test_two_ranks_shard_fp8_weights_and_scales(tmp_path):
    """Tensor parallelism (2 ranks, gloo) over FP8 checkpoints: block scales sharded on block boundaries
    (16 x 16 blocks: every shard is whole blocks, so each rank's per-group activation scales are the
    single rank's), per-tensor scales and static input scales replicated; the same logits as one rank."""
    import torch.multiprocessing as mp
    from tp_ranks import rank_main
    llama = make_tiny_model(tmp_path, arch="llama")
    moe = make_tiny_model(tmp_path, arch="qwen3_moe")
    phi3 = make_tiny_phi3(tmp_path)          # fused qkv_proj / gate_up_proj: each rank's rows of every part
    folders = [write_fp8_copy(llama, tmp_path / "llama", "block", block=(16, 16))[0],
               write_fp8_copy(llama, tmp_path / "llama", "ct-static")[0],
               write_fp8_copy(moe, tmp_path / "moe", "block", block=(16, 16))[0],
               write_fp8_copy(phi3, tmp_path / "phi3", "block", block=(16, 16))[0],
               write_fp8_copy(phi3, tmp_path / "phi3", "ct-static")[0]]
    tokens = random_tokens(load_model_facts(llama).vocab_size, 12, seed=3)
    out_file = str(tmp_path / "logits.pt")
    mp.spawn(rank_main, args=(2, str(tmp_path / "init"), folders, tokens, 8, out_file), nprocs=2, join=True)
    results = torch.load(out_file)
    for folder in folders:
        facts = load_model_facts(folder)
        model = load_model(folder, facts, torch.float32, "cpu", BACKEND)
        cache = PagedCache(facts)
        ids, pos, meta = cache.step([("s", 0, tokens)])
        with torch.inference_mode():
            one_rank = model.compute_logits(model(ids, pos, cache.caches, meta))
        diff = (results[folder] - one_rank).abs().max()
        assert results[folder].shape == one_rank.shape and diff <= FLIP_ATOL, (folder, diff)


def test_llm_generates_greedy_like_the_reference(models):
    """Through the engine (start-up reads quantization_config; --quantization reaches the loader): greedy
    tokens of an FP8 checkpoint equal transformers' on the dequantized weights with kvfit's activation
    quantization, and LLM(quantization="fp8") runs a 16-bit checkpoint in FP8."""
    from transformers import AutoModelForCausalLM

    from kvfit import LLM, SamplingParams
    root, src = models
    fp8, deq = write_fp8_copy(src["llama"], root / "llm", "block")
    prompt = [1, 40, 41, 42, 43, 44]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(fp8, dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    fake_quant_hooks(hf, "block")
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got) == want
    online = LLM(src["llama"], dtype="float32", kv_cache_memory="16MiB", max_model_len=64, quantization="fp8")
    assert online.engine.facts.quantization.online
    assert len(online.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    online.shutdown()


@pytest.mark.parametrize("names", [("w13_weight", "w2_weight"), ("gate_up_proj.weight", "down_proj.weight")])
def test_expert_layouts_kvfit_does_not_read_are_named(tmp_path, names):
    """vLLM's fused w13/w2 expert parameters, or stacked experts with a .weight suffix: one error naming the
    layout (the first was blamed on ignore lists; 16-bit ones were skipped and a per-expert tensor called
    missing)."""
    src = make_tiny_model(tmp_path, arch="qwen3_moe")
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    prefix = "model.layers.0.mlp.experts"
    experts = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(prefix + ".")})
    gate_up = torch.stack([torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"),
                                      tensors.pop(f"{prefix}.{e}.up_proj.weight")]) for e in experts])
    down = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    tensors[f"{prefix}.{names[0]}"], tensors[f"{prefix}.{names[1]}"] = gate_up, down
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"holds experts in a layout kvfit does not read"):
        _logits(src)


def test_store_dtype_mxfp4_is_refused_for_experts_and_ignored_by_dense_models(tmp_path):
    """quant_method fp8 with store_dtype "mxfp4": vLLM runs the routed experts in MXFP4 (kvfit cannot: a one-line
    error naming it) and ignores it in a dense model (so does kvfit)."""
    for arch in ("qwen3_moe", "llama"):
        src = make_tiny_model(tmp_path / arch, arch=arch)
        fp8, _ = write_fp8_copy(src, tmp_path / arch, "block", block=(32, 32))
        path = os.path.join(fp8, "config.json")
        config = json.load(open(path))
        config["quantization_config"]["store_dtype"] = "mxfp4"
        json.dump(config, open(path, "w"))
        if arch == "llama":
            _logits(fp8)
            continue
        with pytest.raises(ConfigError, match=r"store_dtype \"mxfp4\" stores the routed experts in MXFP4"):
            _logits(fp8)
