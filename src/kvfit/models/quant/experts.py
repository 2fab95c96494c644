"""FP8 mixture-of-experts experts: stacked like moe.py's 16-bit ones, one byte a weight, with their scales.

gate_up_proj [E, 2 n, H] (gate rows, then up) and down_proj [E, H, n] in float8_e4m3fn, n this rank's
channels of each expert; scales per output row ([E, 2 n, 1], [E, H, 1]; per-tensor checkpoints widened)
or per block ([E, 2 n / bn, ceil(H / bk)], [E, ceil(H / bn), n / bk]: the gate and up halves each start a
row block, so n must be a multiple of bn). Filled from the Hub's per-expert tensors (`...experts.{e}.
gate_proj.weight` + `weight_scale` / `weight_scale_inv`), or quantized per row from 16-bit ones (online).

Compute: on CUDA with Triton, kernels/fp8_fused_experts.py's grouped GEMMs (FP8 tensor cores, no host sync: CUDA graphs
capture them); elsewhere tokens grouped by expert (moe_reference's loop), each expert's two GEMMs through
fp8_gemm.fp8_linear, with activations quantized per token (per group for blocks) at the same two points.
Static activation scales (AutoFP8's Mixtral, compressed-tensors' static FP8): each expert's gate, up and down
`input_scale` is read; as vLLM, every expert's gate/up input is quantized with the largest of the gate and up
scales of the layer and every down input with the largest down scale (one GEMM launch reads one scale; where
the experts' scales differ the log says so once per layer).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfit.errors import ConfigError
from kvfit.kernels import fp8_fused_experts
from kvfit.kernels.fp8 import (FP8_DTYPE, Fp8Weight, PreQuantized, activation_group, quantize_weight_blocks,
                               quantize_weight_per_channel, split_prequantized)
from kvfit.kernels.fp8_fused_experts import fused_experts_applies, fused_fp8_experts
from kvfit.kernels.fp8_gemm import fp8_linear
from kvfit.kernels.fused_moe import experts_by_group
from kvfit.models.parallel import make_param, source_shape
from kvfit.models.quant.linear import is_fp8_source, scale_values, source_dtype_name
from kvfit.platforms.gate import on_gpu
from kvfit.quant_scheme import DUMMY_INPUT_SCALE, Fp8Scheme

logger = logging.getLogger("kvfit")


class Fp8Experts(torch.nn.Module):
    """One layer's experts in FP8; this rank holds channels [start, start + size) of each expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, start: int, size: int,
                 scheme: Fp8Scheme, device, name: str):
        super().__init__()
        if scheme.mxfp4_experts:
            raise ConfigError(f"{name}: quantization_config's store_dtype \"mxfp4\" stores the routed experts in MXFP4 "
                              "(4-bit), which kvfit does not run; use an FP8 or 16-bit checkpoint of this model")
        self.scheme, self.start, self.size, self.inter, self.name = scheme, start, size, intermediate_size, name
        e, h, n = num_experts, hidden_size, size
        self.gate_up_proj = make_param((e, 2 * n, h), None, FP8_DTYPE, device)
        self.gate_up_proj.full_shape = (e, 2 * intermediate_size, h)
        self.down_proj = make_param((e, h, n), None, FP8_DTYPE, device)
        self.down_proj.full_shape = (e, h, intermediate_size)
        if scheme.block_size is not None:
            bn, bk = scheme.block_size
            if intermediate_size % bn or intermediate_size % bk:
                # vLLM 0.26 needs whole row blocks (its check at tp 1), kvfit whole blocks both ways
                also = " (vLLM refuses them too)" if intermediate_size % bn else ""
                raise ConfigError(f"{name}: block-quantized experts need moe_intermediate_size ({intermediate_size}) "
                                  f"to be whole {list(scheme.block_size)} blocks, which kvfit's FP8 MoE kernel "
                                  f"reads; this checkpoint's experts cannot run in kvfit{also}")
            if n % bn or start % bn or n % bk:
                raise ConfigError(f"{name}: block-quantized experts need each rank's {n} channels (of "
                                  f"moe_intermediate_size {intermediate_size}) to be whole {scheme.block_size} "
                                  "blocks; use a smaller --tensor-parallel-size")
            gate_up_scale, down_scale = (e, 2 * n // bn, -(-h // bk)), (e, -(-h // bn), n // bk)
        else:
            gate_up_scale, down_scale = (e, 2 * n, 1), (e, h, 1)
        self.gate_up_proj_scale = make_param(gate_up_scale, None, torch.float32, device)
        self.down_proj_scale = make_param(down_scale, None, torch.float32, device)
        scales = [self.gate_up_proj_scale, self.down_proj_scale]
        self.static = scheme.activation == "static"
        if self.static:     # per expert: gate and up (one column each), down
            self.gate_up_proj_input_scale = make_param((e, 2), None, torch.float32, device)
            self.down_proj_input_scale = make_param((e, 1), None, torch.float32, device)
            scales += [self.gate_up_proj_input_scale, self.down_proj_input_scale]
        for scale in scales:
            scale.quant_scale = True
            scale.derived = scheme.online
        self._input_scales = None      # static: the layer's two input scales (finalize, once the scales are in)

    # loading ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, expert: int, part: str, kind: str, source, name: str) -> None:
        """One expert's gate/up/down checkpoint tensor: kind "weight" (FP8, or 16-bit online) or "scale"."""
        if kind == "weight":
            self._load_weight(expert, part, source, name)
        elif kind == "input_scale":
            self._load_input_scale(expert, part, source, name)
        else:
            self._load_scale(expert, part, source, name)

    def _load_input_scale(self, expert: int, part: str, source, name: str) -> None:
        if not self.static:
            raise ConfigError(f"checkpoint tensor {name} is a static activation scale but config.json's "
                              "quantization_config makes activations dynamic; the checkpoint does not match it")
        if source_shape(source) not in ((), (1,)):
            raise ConfigError(f"checkpoint tensor {name} has shape {list(source_shape(source))}; a static input "
                              "scale is one number (per tensor)")
        value = scale_values(source, name, self.scheme).reshape(())
        # 0 is what calibration writes for an expert no token reached; the layer takes the largest (finalize)
        if not bool(torch.isfinite(value)) or float(value) < 0:
            raise ConfigError(f"checkpoint tensor {name} is not a finite number >= 0; the checkpoint is damaged")
        if part == "down":
            self.down_proj_input_scale[expert, 0] = value
        else:
            self.gate_up_proj_input_scale[expert, 0 if part == "gate" else 1] = value

    def _rows(self, part: str) -> slice:
        n = self.size
        return slice(0, n) if part == "gate" else slice(n, 2 * n)

    def _load_weight(self, expert: int, part: str, source, name: str) -> None:
        s, n = self.start, self.size
        h = self.down_proj.shape[1]
        want = (h, self.inter) if part == "down" else (self.inter, h)
        if source_shape(source) != want:
            raise ConfigError(f"checkpoint tensor {name} has shape {list(source_shape(source))} but config.json "
                              f"needs {list(want)}; the weights do not match this config.json")
        fp8 = is_fp8_source(source)
        if fp8 == self.scheme.online:
            raise ConfigError(f"checkpoint tensor {name} is {source_dtype_name(source)} but config.json's "
                              f"quantization says {'16-bit' if self.scheme.online else 'float8_e4m3fn'}; the "
                              "weights do not match config.json")
        part_weight = source[:, s:s + n] if part == "down" else source[s:s + n]          # this rank's part
        target = self.down_proj[expert] if part == "down" else self.gate_up_proj[expert, self._rows(part)]
        if fp8:
            target.copy_(part_weight)
            return
        wq, scale = quantize_weight_per_channel(part_weight.to(target.device))            # online: per row
        target.copy_(wq)
        self._scale_rows(expert, part).copy_(scale)

    def _scale_rows(self, expert: int, part: str) -> torch.Tensor:
        """The part of the stacked scale that expert's part owns (rows; all of down's)."""
        if part == "down":
            return self.down_proj_scale[expert]
        rows = self.gate_up_proj_scale.shape[1] // 2
        return self.gate_up_proj_scale[expert, :rows] if part == "gate" else self.gate_up_proj_scale[expert, rows:]

    def _load_scale(self, expert: int, part: str, source, name: str) -> None:
        shape, scheme = source_shape(source), self.scheme
        value = scale_values(source, name, scheme)              # whole: each rank takes its part below
        target = self._scale_rows(expert, part)
        s, n, h = self.start, self.size, self.down_proj.shape[1]
        if scheme.weight_strategy == "tensor" and shape in ((), (1,)):
            target.fill_(value.reshape(()))
            return
        if scheme.weight_strategy == "channel" and shape in (((h, 1), (h,)) if part == "down" else
                                                             ((self.inter, 1), (self.inter,))):
            rows = value.reshape(-1, 1)
            target.copy_(rows if part == "down" else rows[s:s + n])
            return
        if scheme.block_size is not None:
            bn, bk = scheme.block_size
            full = (-(-h // bn), -(-self.inter // bk)) if part == "down" else (-(-self.inter // bn), -(-h // bk))
            if shape == full:
                target.copy_(value[:, s // bk:(s + n) // bk] if part == "down" else value[s // bn:(s + n) // bn])
                return
        raise ConfigError(f"checkpoint tensor {name} has shape {list(shape)}, not a {scheme.weight_strategy} scale "
                          f"of this expert; the scales do not match config.json's quantization_config")

    @torch.no_grad()
    def init_dummy(self, part: str, drawn: torch.Tensor) -> None:
        """Random weights (drawn [E, rows, cols] fp32) quantized as the scheme says, scales with them."""
        weight = self.down_proj if part == "down" else self.gate_up_proj
        scale = self.down_proj_scale if part == "down" else self.gate_up_proj_scale
        for e in range(weight.shape[0]):
            if self.scheme.block_size is not None:
                if part == "down":
                    wq, s = quantize_weight_blocks(drawn[e], self.scheme.block_size)
                else:    # gate and up halves each from their own row blocks
                    n = self.size
                    (gq, gs), (uq, us) = (quantize_weight_blocks(drawn[e, rows], self.scheme.block_size)
                                          for rows in (slice(0, n), slice(n, 2 * n)))
                    wq, s = torch.cat([gq, uq]), torch.cat([gs, us])
            else:
                wq, s = quantize_weight_per_channel(drawn[e])
            weight[e].copy_(wq)
            scale[e].copy_(s)
        if self.static:
            (self.down_proj_input_scale if part == "down" else self.gate_up_proj_input_scale).fill_(DUMMY_INPUT_SCALE)

    # compute ------------------------------------------------------------------------------------
    def warm_up(self, top_k: int, max_tokens: int, dtype: torch.dtype) -> int:
        """Compile the fused kernels' configs for up to max_tokens tokens of activations in dtype now
        (start-up); how many ran."""
        return fp8_fused_experts.warm_up(self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                         self.down_proj_scale, self.scheme.block_size, top_k, max_tokens, dtype,
                                         self.input_scales())

    @torch.no_grad()
    def finalize(self) -> None:
        """Call after the scales are in (checkpoint or dummy; models/loader.finalize_quantized): static
        activations take the largest of the experts' input scales (vLLM's choice: no expert's input saturates)."""
        if not self.static:
            return
        gate_up, down = self.gate_up_proj_input_scale, self.down_proj_input_scale
        if not (bool((gate_up == gate_up.flatten()[0]).all()) and bool((down == down.flatten()[0]).all())):
            logger.info("%s: the experts' static input scales differ; each GEMM quantizes its input with the "
                        "largest (gate/up %.4g, down %.4g)", self.name, float(gate_up.max()), float(down.max()))
        for values, what in ((gate_up, "gate/up"), (down, "down")):
            if float(values.max()) <= 0:
                raise ConfigError(f"{self.name}: every expert's static {what} input_scale is 0; the checkpoint is "
                                  "damaged (re-download it, or recalibrate)")
        self._input_scales = (gate_up.max().reshape(1), down.max().reshape(1))

    def input_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Static activations: (gate/up input scale, down input scale) of the layer, fp32 [1] each (finalize);
        None for dynamic activations."""
        assert not self.static or self._input_scales is not None, "finalize() the experts after loading them"
        return self._input_scales

    def expert_weights(self, expert: int) -> tuple[Fp8Weight, Fp8Weight]:
        block = self.scheme.block_size
        gate_up_in, down_in = self.input_scales() or (None, None)
        return (Fp8Weight(self.gate_up_proj[expert], self.gate_up_proj_scale[expert], block, gate_up_in),
                Fp8Weight(self.down_proj[expert], self.down_proj_scale[expert], block, down_in))

    def prequantize_group(self, x: torch.Tensor) -> int | None:
        """Columns per scale in which a kernel before the experts may quantize their input x [T, H] for the fused
        gate/up GEMM (a PreQuantized input); None where nothing quantizes x ahead (static scales, no kernel)."""
        if x.dim() != 2 or not fused_experts_applies(x):
            return None
        gate_up, _ = self.expert_weights(0)          # fused_fp8_experts quantizes x as for any expert's gate/up
        return activation_group(gate_up, x.shape[1])

    def forward(self, x: torch.Tensor | PreQuantized, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H] -> [T, H]: sum_j w[t, j] * down_e(silu(gate_e x) * up_e x), e = topk_ids[t, j]."""
        x, pre = split_prequantized(x)
        if fused_experts_applies(x):
            return fused_fp8_experts(x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                     self.down_proj_scale, self.scheme.block_size, topk_weights, topk_ids,
                                     input_scales=self.input_scales(), pre=pre)
        if on_gpu(x) and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FP8 experts cannot be captured in a CUDA graph yet (the fused MoE kernels take "
                               "16-bit experts); run with --enforce-eager")

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up, down = self.expert_weights(expert)
            gate, up = fp8_linear(rows, gate_up).chunk(2, dim=-1)                # [n, I] each
            return fp8_linear(F.silu(gate) * up, down)
        return experts_by_group(x, topk_weights, topk_ids, self.gate_up_proj.shape[0], expert_mlp)
