"""FP8 checkpoints in the Hub's layouts, written from a tiny transformers model folder (tests/tiny_models.py).

`write_fp8_copy(src, dst, fmt)` quantizes every decoder linear weight (attention, MLP, experts, Phi-3's fused
qkv_proj and gate_up_proj as one module each, as llm-compressor does; not the
embedding, lm_head, norms or routers) and writes config.json's quantization_config as the Hub does:
- "ct-channel" / "ct-tensor" / "ct-static": compressed-tensors float-quantized, `weight_scale` [N, 1] / [1]
  (+ `input_scale` [1], static activations), ignore ["lm_head"];
- "block": quant_method fp8, weight_block_size, `weight_scale_inv` [ceil(N/bn), ceil(K/bk)].
It also writes `dst`-dequantized: the same model with the FP8 weights dequantized to fp32 (what transformers
loads as the reference). Returns (fp8 folder, dequantized folder).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from kvfit.kernels.fp8 import (dequantize_weight, quantize_weight_blocks, quantize_weight_per_channel,
                               quantize_weight_per_tensor)

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.(qkv|[qkvo])_proj|mlp\.(gate_up|gate|up|down)_proj|"
                    r"(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)|"
                    r"mlp\.shared_expert\.(gate|up|down)_proj)\.weight")
STATIC_INPUT_SCALE = 1.0 / 32


def _ct_config(strategy: str, static: bool) -> dict:
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if static else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "dynamic": False, "symmetric": True}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantization_config(fmt: str, block=(128, 128)) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    return _ct_config({"ct-channel": "channel", "ct-tensor": "tensor", "ct-static": "tensor"}[fmt], fmt == "ct-static")


ROUTER = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate\.weight")


def write_fp8_copy(src: str, dst, fmt: str, block=(128, 128), skip=(), router: bool = False) -> tuple[str, str]:
    """(fp8 folder, dequantized fp32 folder) of src's model in layout fmt; names matching `skip` stay 16-bit
    (add them to the ignore list yourself); router: MoE routers in FP8 too (llm-compressor without a gate ignore)."""
    fp8_dir, ref_dir = str(dst / f"fp8-{fmt}"), str(dst / f"deq-{fmt}")
    for folder in (fp8_dir, ref_dir):
        shutil.copytree(src, folder)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, ref = {}, {}
    for name, w in tensors.items():
        if not (LINEAR.fullmatch(name) or (router and ROUTER.fullmatch(name))) or any(s in name for s in skip):
            fp8[name], ref[name] = w, w
            continue
        prefix = name[: -len(".weight")]
        if fmt == "block":
            wq, scale = quantize_weight_blocks(w, block)
            fp8[f"{prefix}.weight_scale_inv"] = scale
            ref[name] = dequantize_weight(wq, scale, block)
        else:
            wq, scale = quantize_weight_per_channel(w) if fmt == "ct-channel" else quantize_weight_per_tensor(w)
            fp8[f"{prefix}.weight_scale"] = scale
            ref[name] = dequantize_weight(wq, scale, None)
            if fmt == "ct-static":
                fp8[f"{prefix}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
        fp8[name] = wq
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(fp8_dir, "config.json")
    config = json.load(open(path))
    config["quantization_config"] = quantization_config(fmt, block)
    config["torch_dtype"] = "bfloat16"
    json.dump(config, open(path, "w"), indent=1)
    return fp8_dir, ref_dir


def fake_quant_hooks(hf_model, fmt: str, block=(128, 128), skip=()) -> list:
    """Forward pre-hooks on hf_model's quantized nn.Linear layers that quantize their input as kvfit's FP8 GEMM
    does (per token, per token and block group, or static), so the fp32 reference computes kvfit's numbers;
    names matching `skip` are left alone (write_fp8_copy's skip)."""
    from kvfit.kernels.fp8 import Fp8Weight, dequantize_activations, quantize_activations
    handles = []
    for name, module in hf_model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not LINEAR.fullmatch(f"{name}.weight") \
                or any(s in name for s in skip):
            continue
        probe = Fp8Weight(torch.empty(0), torch.empty(0), block if fmt == "block" else None,
                          torch.tensor([STATIC_INPUT_SCALE]) if fmt == "ct-static" else None)

        def hook(_module, args, probe=probe):
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            xq, scale = quantize_activations(flat, probe)
            return (dequantize_activations(xq, scale, probe).to(x.dtype).reshape(x.shape),)
        handles.append(module.register_forward_pre_hook(hook))
    return handles


def fake_quant_experts(hf_model, fmt: str, block=(128, 128)) -> int:
    """Give every transformers experts module (stacked gate_up_proj / down_proj) a forward that quantizes the
    inputs of its two GEMMs as kvfit's FP8 experts do; returns how many modules it changed."""
    import types

    from kvfit.kernels.fp8 import Fp8Weight, dequantize_activations, quantize_activations
    probe = Fp8Weight(torch.empty(0), torch.empty(0), block if fmt == "block" else None,
                      torch.tensor([STATIC_INPUT_SCALE]) if fmt == "ct-static" else None)

    def fq(x):
        xq, scale = quantize_activations(x, probe)
        return dequantize_activations(xq, scale, probe).to(x.dtype)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.gate_up_proj.shape[0]):
            token_idx, slot = torch.where(top_k_index == expert)
            if token_idx.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(fq(hidden_states[token_idx]), self.gate_up_proj[expert]).chunk(2, -1)
            h = torch.nn.functional.linear(fq(self.act_fn(gate) * up), self.down_proj[expert])
            out.index_add_(0, token_idx, h * top_k_weights[token_idx, slot, None])
        return out
    changed = 0
    for module in hf_model.modules():
        if hasattr(module, "gate_up_proj") and isinstance(getattr(module, "gate_up_proj"), torch.nn.Parameter):
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed
