"""Mixture-of-experts decoders on the Llama-family decoder: Qwen3-MoE, Qwen2-MoE and Mixtral.

Attention, norms, embedding and lm_head are llama.py's; only the MLP of a sparse layer differs: a
router (`gate`, replicated) picks top_k experts per token (softmax in fp32, top-k, renormalised
when the config says so), and the experts' SwiGLU outputs are summed with the routing weights.
Experts are stored stacked, one tensor per projection ([E, 2 I, H] gate rows then up rows, and
[E, H, I] down), filled at load from Hugging Face's per-expert tensors (Qwen3-MoE
`mlp.experts.{e}.gate_proj/up_proj/down_proj`, Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`) or
from transformers 5's stacked `mlp.experts.gate_up_proj/down_proj`. With tensor parallelism each
rank holds a slice of every expert's intermediate channels (never whole experts), so every rank
runs every token and one all-reduce sums the ranks' parts, as for a dense MLP. Qwen2-MoE adds a shared
expert (a SwiGLU, sharded as a dense MLP) scaled per token by sigmoid(shared_expert_gate(x)).
The experts run in fused_moe.moe_experts: grouped-GEMM Triton kernels on CUDA, torch elsewhere.
Routing and expert layout (MoEConfig) are read by the architecture's registry entry
(model_facts/architectures.py, its `moe`), so nothing here asks which family a model is.
"""

from __future__ import annotations

import re

import torch

from kvfit.errors import ConfigError
from kvfit.kernels import fused_moe
from kvfit.kernels.fp8 import PreQuantized, dequantize_weight, split_prequantized
from kvfit.kernels.fused_moe import moe_experts, select_experts
from kvfit.kernels.gemv import linear
from kvfit.model_facts import ModelFacts, MoEConfig, moe_config
from kvfit.models.layers import SwiGLU
from kvfit.models.llama import CausalLM
from kvfit.models.parallel import all_reduce, make_param, source_shape, split_evenly
from kvfit.models.quant.experts import Fp8Experts
from kvfit.models.quant.linear import is_fp8_source, scale_values


class SparseMoE(torch.nn.Module):
    """Router + stacked experts of one layer; this rank holds channels [start, start + size) of each expert."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype, device, tp_rank: int, tp_size: int,
                 scheme=None, prefix: str = "mlp"):
        super().__init__()
        self.moe, self.tp_size = moe, tp_size
        self.start, self.size = split_evenly(moe.intermediate_size, tp_rank, tp_size,
                                             "expert MLP channels (moe_intermediate_size)")
        e, h = moe.num_experts, hidden_size
        self.gate = torch.nn.Module()
        self.gate.weight = make_param((e, h), None, dtype, device)
        if scheme is not None and scheme.method == "fbgemm_fp8":
            raise ConfigError("quant_method fbgemm_fp8 quantizes linear layers only (vLLM's FBGEMMFp8Config leaves "
                              "a MoE model's experts to the checkpoint's 16-bit weights), and kvfit does not run it "
                              "on a MoE model; use a compressed-tensors or fp8 checkpoint of it")
        if scheme is not None and scheme.quantizes(f"{prefix}.experts.0.{moe.expert_names[0]}"):
            self.experts = Fp8Experts(e, h, moe.intermediate_size, self.start, self.size, scheme, device,
                                      f"{prefix}.experts")
        else:
            # transformers 5's in-memory names and layout; full_shape is the whole (unsharded) tensor
            self.experts = torch.nn.Module()
            self.experts.gate_up_proj = make_param((e, 2 * self.size, h), None, dtype, device)
            self.experts.gate_up_proj.full_shape = (e, 2 * moe.intermediate_size, h)
            self.experts.down_proj = make_param((e, h, self.size), None, dtype, device)
            self.experts.down_proj.full_shape = (e, h, moe.intermediate_size)
        if moe.shared_intermediate_size:
            self.shared_expert = SwiGLU(h, moe.shared_intermediate_size, False, dtype, device, tp_rank, tp_size,
                                        scheme, f"{prefix}.shared_expert")
            self.shared_expert_gate = torch.nn.Module()
            self.shared_expert_gate.weight = make_param((1, h), None, dtype, device)

    @property
    def input_projection(self) -> torch.nn.Module | None:
        """What reads the block's input that a norm could quantize it for (RMSNorm.add_forward's reader): FP8
        experts; None for 16-bit ones."""
        return self.experts if isinstance(self.experts, Fp8Experts) else None

    def forward(self, x: torch.Tensor | PreQuantized) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; a PreQuantized x (for FP8 experts): the router and the rest read its x
        x, pre = split_prequantized(x)
        router_logits = linear(x, self.gate.weight)                                  # [T, E]
        weights, ids = select_experts(router_logits, self.moe.top_k, self.moe.renormalize,
                                      weights_dtype=x.dtype if self.moe.round_weights else torch.float32)
        if isinstance(self.experts, Fp8Experts):
            routed = self.experts(pre or x, weights, ids)
        else:
            routed = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        out = all_reduce(routed, self.tp_size)
        if self.moe.shared_intermediate_size:   # Qwen2-MoE: + sigmoid(gate(x)) * shared_expert(x)
            out = out + torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return out

    # loading ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_expert(self, expert: int, part: str, source, kind: str = "weight", name: str = "") -> None:
        """One expert's gate/up ([I, H]) or down ([H, I]) checkpoint tensor: this rank's channels (kind
        "scale": an FP8 expert's weight scale; "input_scale": its static activation scale)."""
        if isinstance(self.experts, Fp8Experts):
            self.experts.load(expert, part, kind, source, name)
            return
        if kind != "weight" or is_fp8_source(source):
            raise ConfigError(f"checkpoint tensor {name} is quantized but config.json's quantization_config leaves "
                              "this layer's experts in 16 bits; the checkpoint does not match config.json")
        s, n = self.start, self.size
        h, inter = self.experts.down_proj.shape[1], self.moe.intermediate_size
        want = (h, inter) if part == "down" else (inter, h)
        if source_shape(source) != want:
            raise ConfigError(f"an expert {part} projection has shape {list(source_shape(source))} but config.json "
                              f"needs {list(want)}; the weights do not match this config.json")
        if part == "down":
            self.experts.down_proj[expert].copy_(source[:, s:s + n])
        else:
            rows = slice(0, n) if part == "gate" else slice(n, 2 * n)
            self.experts.gate_up_proj[expert, rows].copy_(source[s:s + n])

    @torch.no_grad()
    def load_stacked(self, part: str, source) -> None:
        """transformers 5's stacked gate_up_proj [E, 2 I, H] (gate rows, then up) or down_proj [E, H, I]."""
        s, n, inter = self.start, self.size, self.moe.intermediate_size
        if isinstance(self.experts, Fp8Experts):
            raise ConfigError("stacked expert tensors (transformers 5's gate_up_proj/down_proj) with FP8 weights are "
                              "not supported; kvfit reads FP8 experts from the Hub's per-expert tensors")
        param = self.experts.down_proj if part == "down" else self.experts.gate_up_proj
        if source_shape(source) != param.full_shape:
            raise ConfigError(f"stacked expert tensor {part}_proj has shape {list(source_shape(source))} but "
                              f"config.json needs {list(param.full_shape)}; the weights do not match this config.json")
        if part == "down":
            param.copy_(source[:, :, s:s + n])
        else:
            param[:, :n].copy_(source[:, s:s + n])
            param[:, n:].copy_(source[:, inter + s:inter + s + n])


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\."
                     r"(weight|weight_scale|weight_scale_inv|input_scale)")
_KIND_SUFFIX = {"weight": "", "scale": "_scale", "input_scale": "_input_scale"}  # stacked parameter of each kind
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# expert layouts no Hugging Face export writes that kvfit knows: vLLM's fused w13/w2 parameters, stacked tensors with
# a .weight suffix (transformers 5 names them without)
_FOREIGN_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(w13_|w2_|(gate_up_proj|down_proj)\.)\w*")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.(weight|weight_scale|weight_scale_inv|input_scale)")


class MoECausalLM(CausalLM):
    """A Llama-family decoder whose sparse layers are SparseMoE blocks (Qwen3-MoE, Mixtral)."""

    def __init__(self, facts: ModelFacts, dtype: torch.dtype, device, attention_backend, tp_rank: int = 0,
                 tp_size: int = 1):
        self.moe = moe_config(facts)        # read by make_mlp, which CausalLM.__init__ calls
        super().__init__(facts, dtype, device, attention_backend, tp_rank=tp_rank, tp_size=tp_size)
        parts = dict(zip(self.moe.expert_names, ("gate", "up", "down")))
        self._expert_parts = parts
        # stacked parameter name -> the (expert, part) pieces still to load (FP8 experts: their scales too)
        self._pending: dict[str, set[tuple[int, str]]] = {}
        self._fp8_router: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}    # layer -> its FP8 router's parts read
        for layer in sorted(self.moe.sparse_layers):
            suffixes = ("",)
            experts = self.model.layers[layer].mlp.experts
            if isinstance(experts, Fp8Experts) and not self.scheme.online:
                suffixes = ("", "_scale", "_input_scale") if experts.static else ("", "_scale")
            for suffix in suffixes:
                for tensor, wanted in ((f"model.layers.{layer}.mlp.experts.gate_up_proj{suffix}", ("gate", "up")),
                                       (f"model.layers.{layer}.mlp.experts.down_proj{suffix}", ("down",))):
                    self._pending[tensor] = {(e, p) for e in range(self.moe.num_experts) for p in wanted}

    def make_mlp(self, layer: int, dtype, device) -> torch.nn.Module:
        if layer in self.moe.sparse_layers:
            return SparseMoE(self.config.hidden_size, self.moe, dtype, device, self.tp_rank, self.tp_size,
                             self.scheme, f"model.layers.{layer}.{self.moe.block_name}")
        return super().make_mlp(layer, dtype, device)

    def init_dummy_special(self, name: str, param: torch.nn.Parameter, gen: torch.Generator, std: float) -> bool:
        """Random FP8 experts: drawn in fp32 and quantized (loader.init_dummy_weights' hook)."""
        match = _STACKED.fullmatch(name)
        if match is None or param.dtype not in (torch.float8_e4m3fn,):
            return False
        drawn = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, std, generator=gen)
        experts = self.model.layers[int(match.group(1))].mlp.experts
        experts.init_dummy("down" if match.group(2) == "down_proj" else "gate_up", drawn)
        return True

    def warm_up(self, max_num_tokens: int) -> int:
        """Compile the fused-MoE configs of every batch size up to max_num_tokens now (start-up), not
        in the first steps that need them; every sparse layer has the same shape, so one layer does."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                experts = layer.mlp.experts
                if isinstance(experts, Fp8Experts):
                    return experts.warm_up(self.moe.top_k, max_num_tokens, layer.mlp.gate.weight.dtype)
                return fused_moe.warm_up(experts.gate_up_proj, experts.down_proj, self.moe.top_k, max_num_tokens)
        return 0

    def checkpoint_name(self, name: str) -> str:
        if self.moe.block_name != "mlp":
            return name.replace(f".{self.moe.block_name}.", ".mlp.", 1)
        return name

    def hub_name(self, name: str) -> str:
        """The checkpoint's own spelling of a name checkpoint_name rewrote (Mixtral's block_sparse_moe): what an
        error names."""
        if self.moe.block_name != "mlp":
            return name.replace(".mlp.", f".{self.moe.block_name}.", 1)
        return name

    def load_special(self, name: str, source) -> list[str] | None:
        match = _ROUTER.fullmatch(name)
        if match is not None and self.moe.fp8_router and self.scheme is not None and not self.scheme.online \
                and int(match.group(1)) in self.moe.sparse_layers \
                and self.scheme.quantizes(f"model.layers.{match.group(1)}.mlp.gate"):
            return self._load_fp8_router(int(match.group(1)), match.group(2), name, source)
        if _FOREIGN_EXPERTS.fullmatch(name):
            raise ConfigError(f"checkpoint tensor {self.hub_name(name)} holds experts in a layout kvfit does not read "
                              "(vLLM's fused w13/w2 parameters, or stacked tensors with a .weight suffix); kvfit reads "
                              "each expert's gate/up/down tensors (the Hub's layout) or transformers' stacked "
                              "experts.gate_up_proj / experts.down_proj")
        match = _EXPERT.fullmatch(name)
        if match is not None and match.group(3) in self._expert_parts:
            layer, expert, part = int(match.group(1)), int(match.group(2)), self._expert_parts[match.group(3)]
            name = self.hub_name(name)
            block = self._sparse_block(layer, name)
            if expert >= self.moe.num_experts:
                raise ConfigError(f"checkpoint tensor {name} names expert {expert} but config.json has "
                                  f"{self.moe.num_experts}; the weights do not match this config.json")
            kind = {"weight": "weight", "input_scale": "input_scale"}.get(match.group(4), "scale")
            if kind == "scale":
                self._check_scale_name(name, match.group(4))
            block.load_expert(expert, part, source, kind, name)
            return self._done(layer, {(expert, part)}, _KIND_SUFFIX[kind])
        match = _STACKED.fullmatch(name)
        if match is not None:
            layer, part = int(match.group(1)), match.group(2)
            self._sparse_block(layer, name).load_stacked("down" if part == "down_proj" else "gate_up", source)
            wanted = ("down",) if part == "down_proj" else ("gate", "up")
            return self._done(layer, {(e, p) for e in range(self.moe.num_experts) for p in wanted})
        return None

    def _check_scale_name(self, name: str, suffix: str) -> None:
        """A weight scale under the other scheme's name (weight_scale beside weight_scale_inv) is refused, as dense
        layers refuse it: read as the scale, whichever came last would win. Without a scheme, load_expert refuses
        any scale."""
        if self.scheme is not None and suffix != self.scheme.scale_name:
            raise ConfigError(f"checkpoint tensor {name} is a weight scale under another name than "
                              f"quantization_config ({self.scheme.method}) gives its weights' scales "
                              f"({self.scheme.scale_name}); the checkpoint does not match its config.json")

    def _load_fp8_router(self, layer: int, kind: str, name: str, source) -> list[str]:
        """An FP8 router's weight or scale (the scheme quantizes it, as vLLM's Qwen3-MoE does): once both are read,
        the weight dequantized into the 16-bit router. Its static input scale has nothing to scale here. A weight
        held in 16 bits loads as it is, and a scale beside it multiplies it, as vLLM's FP8 router reads it (its
        values cast into the FP8 parameter, then scaled)."""
        if kind == "input_scale":
            return []
        if kind != "weight":
            self._check_scale_name(name, kind)
        parts = self._fp8_router.setdefault(layer, {})
        if kind == "weight":
            parts["weight"] = (name, source if isinstance(source, torch.Tensor) else source[:])
        else:
            parts["scale"] = (name, scale_values(source, name, self.scheme))
        target = self.model.layers[layer].mlp.gate.weight
        loaded = f"model.layers.{layer}.mlp.gate.weight"
        weight = parts.get("weight", (None, None))[1]
        sixteen_bit = weight is not None and weight.element_size() > 1
        if "scale" not in parts:
            if not sixteen_bit:
                return []
            if tuple(weight.shape) != tuple(target.shape):
                raise ConfigError(f"checkpoint tensor {name} has shape {list(weight.shape)} but the router is "
                                  f"{list(target.shape)}; the checkpoint does not match config.json")
            target.copy_(weight)                    # a router held in 16 bits: loaded; a scale read later scales it
            parts["weight"] = (name, target)        # (the checkpoint's tensor is not kept)
            return [loaded]
        if weight is None:
            return []
        (weight_name, weight), (scale_name, scale) = parts.pop("weight"), parts.pop("scale")
        rows, cols = target.shape
        block = self.scheme.block_size
        want = {"tensor": ((), (1,)), "channel": ((rows, 1), (rows,)),
                "block": ((-(-rows // block[0]), -(-cols // block[1])),) if block else ()}[self.scheme.weight_strategy]
        if tuple(weight.shape) != (rows, cols) or tuple(scale.shape) not in want:
            raise ConfigError(f"checkpoint tensors {weight_name} {list(weight.shape)} and {scale_name} "
                              f"{list(scale.shape)} are not an FP8 router of {rows} experts x {cols} with "
                              f"{self.scheme.weight_strategy} scales; the checkpoint does not match config.json")
        target.copy_(dequantize_weight(weight, scale, block).to(target.dtype))
        return [loaded] if kind == "weight" or not sixteen_bit else []    # a 16-bit weight said so when read

    def _sparse_block(self, layer: int, name: str) -> SparseMoE:
        if layer not in self.moe.sparse_layers:
            raise ConfigError(f"checkpoint tensor {name} is an expert of layer {layer}, which config.json makes "
                              "a dense layer (decoder_sparse_step / mlp_only_layers); the weights do not match it")
        return self.model.layers[layer].mlp

    def _done(self, layer: int, pieces: set[tuple[int, str]], suffix: str = "") -> list[str]:
        """Mark (expert, part) pieces of one layer loaded; the stacked parameters now complete (suffix
        "_scale": an FP8 expert's scales)."""
        done = []
        for tensor in (f"model.layers.{layer}.mlp.experts.gate_up_proj{suffix}",
                       f"model.layers.{layer}.mlp.experts.down_proj{suffix}"):
            pending = self._pending.get(tensor)
            if pending is None:
                raise ConfigError(f"checkpoint tensor {tensor} is an FP8 scale but this layer's experts are not "
                                  "in FP8 (quantization_config); the checkpoint does not match config.json")
            if pending & pieces:
                pending -= pieces
                if not pending:
                    done.append(tensor)
        return done

    def missing_name(self, param_name: str) -> str:
        router = _ROUTER.fullmatch(param_name)
        if router is not None and self._fp8_router.get(int(router.group(1))):
            read = self._fp8_router[int(router.group(1))]
            return param_name if "scale" in read else param_name.replace(".weight", f".{self.scheme.scale_name}")
        pending = self._pending.get(param_name)
        if not pending:
            return param_name
        expert, part = min(pending)
        proj = {v: k for k, v in self._expert_parts.items()}[part]
        layer = param_name.split(".")[2]
        tensor = ("input_scale" if param_name.endswith("_input_scale") else
                  self.scheme.scale_name if param_name.endswith("_scale") else "weight")
        return f"model.layers.{layer}.{self.moe.block_name}.experts.{expert}.{proj}.{tensor}"
