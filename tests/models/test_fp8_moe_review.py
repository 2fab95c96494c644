"""Review: FP8 checkpoints of MoE models (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral) in the Hub's layouts,
through kvfit's real loader on the CPU, against transformers on the dequantized weights (with kvfit's activation
quantization, fp8_checkpoints' hooks). What vLLM 0.26 holds in 16 bits (Qwen2-MoE's and Mixtral's routers, the
shared expert's gate) and malformed scales must be one-line ConfigErrors, never a silent wrong load; a router held in
16 bits beside its scale is scaled, as vLLM's FP8 router reads it; the plan counts experts an ignore list keeps 16-bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_checkpoints import fake_quant_experts, fake_quant_hooks, write_fp8_copy
from paged_batch import PagedCache, hf_logits, random_tokens
from safetensors.torch import load_file, save_file

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.errors import ConfigError
from kvfit.kernels.fp8 import FP8_DTYPE, quantize_weight_per_tensor
from kvfit.model_facts import load_model_facts
from kvfit.models.kv_scales import KVScales
from kvfit.models.loader import load_model
from kvfit.models.quant.experts import Fp8Experts
from kvfit.platforms.estimate import estimate_weights_bytes
from tiny_models import make_tiny_model

FLIP_ATOL = 3e-2        # one e4m3 step of an activation moved by fp32 summation order (test_fp8.py)
BLOCK = (32, 32)        # whole blocks of the tiny experts' 32 channels
TOKENS = 48             # enough tokens that (nearly) every expert of both layers is routed to


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8moe")
    return root, {
        "qwen2_moe": make_tiny_model(root, arch="qwen2_moe", moe={"shared_expert_intermediate_size": 64}),
        # a 48-wide shared expert: its gate/up part boundary falls inside a 32-row scale block
        "qwen2_moe48": make_tiny_model(root, arch="qwen2_moe", moe={"shared_expert_intermediate_size": 48},
                                       name="q2moe48"),
        "qwen3_moe": make_tiny_model(root, arch="qwen3_moe"),
        "mixtral": make_tiny_model(root, arch="mixtral"),
        # Hub block size [128, 128]: experts 128 wide, hidden 64 (a partial column block)
        "qwen3_moe128": make_tiny_model(root, arch="qwen3_moe", moe={"moe_intermediate_size": 128}, name="q3moe128"),
    }


def _load(folder: str, n: int = TOKENS):
    facts = load_model_facts(folder)
    model = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend())
    tokens = random_tokens(facts.vocab_size, n, seed=1)
    input_ids, positions, meta = PagedCache(facts).step([("s", 0, tokens)])
    with torch.inference_mode():
        return model, model.compute_logits(model(input_ids, positions, None, meta)), tokens


def _reference(folder: str, tokens, fmt: str, block=BLOCK, skip=(), experts_16_bit=()) -> torch.Tensor:
    """transformers on the dequantized weights; the experts of layers in experts_16_bit run unquantized."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    fake_quant_hooks(hf, fmt, block, skip)
    assert fake_quant_experts(hf, fmt, block) > 0
    for layer in experts_16_bit:
        experts = hf.model.layers[layer].mlp.experts
        del experts.__dict__["forward"]                       # transformers' own (unquantized) forward again
    return hf_logits(hf, tokens)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, atol=FLIP_ATOL), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _edit(folder: str, tensors=None, quant=None) -> None:
    if tensors is not None:
        path = os.path.join(folder, "model.safetensors")
        values = load_file(path)
        tensors(values)
        save_file(values, path, metadata={"format": "pt"})
    if quant is not None:
        path = os.path.join(folder, "config.json")
        config = json.load(open(path))
        quant(config["quantization_config"])
        json.dump(config, open(path, "w"), indent=1)


def _set_ignore(names):
    return lambda q: q.__setitem__("ignore" if "config_groups" in q else "ignored_layers", names)


# --- loads that must match the dequantized reference -------------------------------------------------------------
@pytest.mark.parametrize("arch,fmt,block", [
    ("qwen2_moe", "block", BLOCK), ("qwen2_moe48", "block", BLOCK), ("qwen2_moe", "ct-static", BLOCK),
    ("qwen2_moe", "ct-channel", BLOCK), ("mixtral", "ct-tensor", BLOCK), ("mixtral", "block", BLOCK),
    ("qwen3_moe", "ct-tensor", BLOCK), ("qwen3_moe128", "block", (128, 128))])
def test_moe_fp8_layouts_match_the_dequantized_reference(tiny, arch, fmt, block):
    root, src = tiny
    fp8, deq = write_fp8_copy(src[arch], root / f"{arch}-{fmt}", fmt, block=block)
    model, got, tokens = _load(fp8)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == FP8_DTYPE
    _assert_matches(got, _reference(deq, tokens, fmt, block))


@pytest.mark.parametrize("arch,ignore", [
    ("qwen2_moe", ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]),
    ("mixtral", ["lm_head", "re:.*block_sparse_moe.gate"]),
    # AutoFP8's Mixtral: every router named in ignored_layers (fp8 method, exact names)
    ("mixtral", ["lm_head"] + [f"model.layers.{i}.block_sparse_moe.gate" for i in range(2)])])
def test_router_ignore_lists_as_the_hub_writes_them(tiny, arch, ignore):
    root, src = tiny
    fmt = "ct-static" if arch == "mixtral" and ignore[-1].startswith("model.") else "ct-channel"
    fp8, deq = write_fp8_copy(src[arch], root / f"ignore-{arch}-{len(ignore)}", fmt, block=BLOCK)
    if fmt == "ct-static" and ignore[-1].startswith("model."):       # rewrite as AutoFP8's quant_method fp8
        def autofp8(tensors):
            for name in [n for n in tensors if n.endswith(("weight_scale", "input_scale"))]:
                tensors[name] = tensors[name].reshape(())            # AutoFP8 saves per-tensor scales 0-dim
        _edit(fp8, tensors=autofp8, quant=lambda q: (q.clear(), q.update(
            quant_method="fp8", activation_scheme="static", ignored_layers=ignore)))
    else:
        _edit(fp8, quant=_set_ignore(ignore))
    _, got, tokens = _load(fp8)
    _assert_matches(got, _reference(deq, tokens, fmt))


@pytest.mark.parametrize("arch,fmt,layer,ignore", [
    ("qwen3_moe", "ct-channel", 0, "model.layers.0.mlp.experts"),                      # a plain module name
    ("qwen3_moe", "block", 1, "re:model[.]layers[.]1[.]mlp[.]experts[.].*"),
    ("mixtral", "ct-static", 0, "re:.*layers[.]0[.]block_sparse_moe[.]experts[.].*")])
def test_a_whole_layers_experts_ignored_stay_16_bit(tiny, arch, fmt, layer, ignore):
    root, src = tiny
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    skip = (f"layers.{layer}.{block}.experts.",)
    fp8, deq = write_fp8_copy(src[arch], root / f"skip-{arch}-{fmt}-{layer}", fmt, block=BLOCK, skip=skip)
    _edit(fp8, quant=_set_ignore(["lm_head", ignore]))
    model, got, tokens = _load(fp8)
    kinds = [isinstance(lyr.mlp.experts, Fp8Experts) for lyr in model.model.layers]
    assert kinds == [i != layer for i in range(2)]
    _assert_matches(got, _reference(deq, tokens, fmt, skip=skip, experts_16_bit=(layer,)))


def test_qwen2_moe_shared_expert_ignored_stays_16_bit(tiny):
    root, src = tiny
    fp8, deq = write_fp8_copy(src["qwen2_moe"], root / "shared16", "ct-channel", skip=("shared_expert.",))
    _edit(fp8, quant=_set_ignore(["lm_head", "re:.*shared_expert[.].*"]))
    model, got, tokens = _load(fp8)
    assert model.model.layers[0].mlp.shared_expert.gate_up_proj.weight.dtype == torch.float32
    _assert_matches(got, _reference(deq, tokens, "ct-channel", skip=("shared_expert",)))


def test_kv_cache_scales_of_an_fp8_moe_checkpoint_are_read(tiny):
    root, src = tiny
    fp8, _ = write_fp8_copy(src["mixtral"], root / "kv", "ct-static")

    def scales(tensors):
        for layer in range(2):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.25 + layer)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.5 + layer)
    _edit(fp8, tensors=scales, quant=lambda q: q.__setitem__("kv_cache_scheme", {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}))
    assert load_model_facts(fp8).kv_cache_scales
    model, _, _ = _load(fp8, 4)
    read = [(m.k_scale.tolist(), m.v_scale.tolist()) for m in model.modules() if isinstance(m, KVScales)]
    assert read == [([0.25, 0.25], [0.5, 0.5]), ([1.25, 1.25], [1.5, 1.5])]


def test_llm_greedy_tokens_and_logprobs_of_an_fp8_qwen2_moe(tiny):
    from transformers import AutoModelForCausalLM

    from kvfit import LLM, SamplingParams
    root, src = tiny
    fp8, deq = write_fp8_copy(src["qwen2_moe"], root / "llm", "block", block=BLOCK)
    prompt = [1, 40, 41, 42, 43, 44]
    llm = LLM(fp8, dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    fake_quant_hooks(hf, "block", BLOCK)
    fake_quant_experts(hf, "block", BLOCK)
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = gen.sequences[0, len(prompt):].tolist()
    assert list(out.token_ids) == want
    for step, scores, token in zip(out.logprobs, gen.scores, want):
        assert step[token].logprob == pytest.approx(torch.log_softmax(scores[0], -1)[token].item(), abs=1e-3)


# --- what must be a one-line error -------------------------------------------------------------------------------
E1 = "model.layers.0.mlp.experts.1."


def _scale(name, fn):
    def edit(tensors):
        tensors[name] = fn(tensors[name])
    return edit


@pytest.mark.parametrize("arch,fmt,edit,message", [
    ("qwen3_moe", "ct-channel", _scale(E1 + "gate_proj.weight_scale", lambda s: s.reshape(1, -1)),
     r"gate_proj\.weight_scale has shape \[1, 32\], not a channel scale"),
    ("qwen3_moe", "ct-channel", _scale(E1 + "down_proj.weight_scale", lambda s: s[:32]),
     r"down_proj\.weight_scale has shape \[32, 1\], not a channel scale"),
    ("qwen3_moe", "ct-tensor", _scale(E1 + "up_proj.weight_scale", lambda s: s.repeat(32).reshape(32, 1)),
     r"up_proj\.weight_scale has shape \[32, 1\], not a tensor scale"),
    ("qwen3_moe", "block", _scale(E1 + "down_proj.weight_scale_inv", lambda s: s.t().contiguous()),
     r"down_proj\.weight_scale_inv has shape \[1, 2\], not a block scale"),
    ("mixtral", "ct-static", _scale("model.layers.0.block_sparse_moe.experts.1.w1.input_scale",
                                    lambda s: s.repeat(2)),
     r"block_sparse_moe\.experts\.1\.w1\.input_scale has shape \[2\]"),
    ("qwen2_moe", "ct-channel", _scale("model.layers.0.mlp.shared_expert.up_proj.weight_scale", lambda s: s[:1]),
     r"shared_expert\.up_proj\.weight_scale has shape \[1, 1\]")])
def test_scales_of_the_wrong_shape_are_named(tiny, arch, fmt, edit, message):
    root, src = tiny
    fp8, _ = write_fp8_copy(src[arch], root / f"shape-{arch}-{fmt}-{message[:12]}", fmt, block=BLOCK)
    _edit(fp8, tensors=edit)
    with pytest.raises(ConfigError, match=message):
        _load(fp8, 4)


def _quantize(pattern: str):
    def edit(tensors):
        for name in [n for n in tensors if n.endswith(pattern)]:
            tensors[name], tensors[name[:-len("weight")] + "weight_scale"] = quantize_weight_per_tensor(tensors[name])
    return edit


@pytest.mark.parametrize("arch,edit,ignore,message", [
    # vLLM 0.26 builds Qwen2-MoE's router and shared_expert_gate and Mixtral's router with quant_config=None
    ("qwen2_moe", _quantize("mlp.gate.weight"), None, r"mlp\.gate\.weight is quantized"),
    ("qwen2_moe", _quantize("shared_expert_gate.weight"), None, r"shared_expert_gate\.weight is quantized"),
    ("mixtral", _quantize("block_sparse_moe.gate.weight"), None, r"block_sparse_moe\.gate\.weight is quantized"),
    # Qwen3-MoE's router in FP8 while the ignore list keeps it 16-bit (vLLM casts it and drops the scale)
    ("qwen3_moe", _quantize("mlp.gate.weight"), ["lm_head", "re:.*mlp.gate$"], r"mlp\.gate\.weight is quantized"),
    # one expert left 16-bit by the ignore list: the layer's experts are one FP8 tensor
    ("qwen3_moe", lambda t: t.update({E1 + "up_proj.weight": t[E1 + "up_proj.weight"].float()}),
     ["lm_head", "re:.*experts[.]1[.]up_proj"], r"experts\.1\.up_proj\.weight is float32")])
def test_quantized_tensors_where_kvfit_holds_16_bits_are_named(tiny, arch, edit, ignore, message):
    root, src = tiny
    fp8, _ = write_fp8_copy(src[arch], root / f"q16-{arch}-{message[:10]}", "ct-tensor")
    _edit(fp8, tensors=edit, quant=None if ignore is None else _set_ignore(ignore))
    with pytest.raises(ConfigError, match=message):
        _load(fp8, 4)


# --- defects found -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ct-tensor", "block"])
def test_a_qwen3_moe_router_held_16_bit_beside_its_scale_is_refused_or_scaled(tiny, fmt):
    root, src = tiny
    fp8, deq = write_fp8_copy(src["qwen3_moe"], root / f"router16-{fmt}", fmt, block=BLOCK, router=True)

    def upcast(tensors):                       # the FP8 values, losslessly upcast; the scale kept beside them
        for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
            tensors[name] = tensors[name].float()
    _edit(fp8, tensors=upcast)
    try:
        _, got, tokens = _load(fp8)
    except ConfigError:
        return                                 # refusing it is a correct fix
    _assert_matches(got, _reference(deq, tokens, fmt))   # so is applying the scale, as vLLM does


def test_an_expert_scale_under_the_schemes_other_name_is_refused_or_ignored(tiny):
    root, src = tiny
    fp8, _ = write_fp8_copy(src["qwen3_moe"], root / "twonames", "ct-channel", block=BLOCK)
    true = load_file(os.path.join(fp8, "model.safetensors"))[E1 + "gate_proj.weight_scale"]
    _edit(fp8, tensors=lambda t: t.update({E1 + "gate_proj.weight_scale_inv": 1.0 / t[E1 + "gate_proj.weight_scale"]}))
    try:
        model, _, _ = _load(fp8, 4)
    except ConfigError:
        return
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj_scale[1, :32].flatten(), true.flatten())


def test_a_router_scale_under_the_schemes_other_name_is_refused(tiny):
    """A Qwen3-MoE FP8 router (block scales, weight_scale_inv) with a stray weight_scale beside them: refused, as
    for the experts and dense layers (read as the scale, whichever paired first would win)."""
    root, src = tiny
    fp8, _ = write_fp8_copy(src["qwen3_moe"], root / "routername", "block", block=BLOCK, router=True)
    gate = "model.layers.0.mlp.gate."
    _edit(fp8, tensors=lambda t: t.update({gate + "weight_scale": t[gate + "weight_scale_inv"] * 1000}))
    with pytest.raises(ConfigError, match="under another name"):
        _load(fp8, 4)


def _allocated(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_plan_weight_bytes_of_an_fp8_moe_match_the_loaded_weights(tiny):
    root, src = tiny
    fp8, _ = write_fp8_copy(src["qwen3_moe128"], root / "plan-all", "block", block=(128, 128))
    model, _, _ = _load(fp8, 2)
    assert estimate_weights_bytes(load_model_facts(fp8), None, 1) == pytest.approx(_allocated(model), rel=0.02)


@pytest.mark.parametrize("ignore,targets", [(["lm_head", "re:.*mlp[.]experts[.].*"], None),
                                            (["lm_head"], ["re:.*self_attn[.].*"])])
def test_plan_weight_bytes_count_experts_kept_16_bit(tiny, ignore, targets):
    root, src = tiny
    fp8, _ = write_fp8_copy(src["qwen3_moe128"], root / f"plan16-{len(ignore)}", "ct-channel", skip=("mlp.experts.",))

    def quant(q):
        q["ignore"] = ignore
        if targets:
            q["config_groups"]["group_0"]["targets"] = targets
    _edit(fp8, quant=quant)
    model, _, _ = _load(fp8, 2)
    assert not isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    assert estimate_weights_bytes(load_model_facts(fp8), None, 1) == pytest.approx(_allocated(model), rel=0.05)
