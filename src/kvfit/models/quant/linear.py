"""FP8 linear layers: column- and row-parallel like parallel.py's, holding the weight in FP8 and its scales.

A column-parallel Fp8Linear holds one or more checkpoint linears (OutputParts) fused by output rows at
construction (q/k/v, gate/up), as parallel.MergedColumnLinear does for 16-bit ones; models/linear.py builds
one only where the parts' scales join (every part in FP8; block scales whose row blocks end at every part's
last row). Its parameters (`weight`, `weight_scale` or `weight_scale_inv`, `input_scale`) carry one ParamPart
per checkpoint tensor and a `weight_loader(param, part, name, source)` that checks the tensor's dtype and shape
(a 16-bit tensor where the checkpoint should hold FP8 is an error, never a silent cast) and reads this rank's
part. With --quantization fp8 (online) the `weight` loader reads the 16-bit tensor and quantizes it per output
channel; its scale is derived (not in the checkpoint). After loading, `finalize()` builds the Fp8Weight the
GEMM reads (per-tensor scales, one per part, widened to one per row; static input scales, one per part, must be
equal: one GEMM quantizes its input once).
"""

from __future__ import annotations

import logging

from typing import Sequence

import torch

from kvfit.errors import ConfigError
from kvfit.kernels.fp8 import (FP8_DTYPE, Fp8Weight, PreQuantized, quantize_weight_blocks,
                               quantize_weight_per_channel, quantize_weight_per_tensor)
from kvfit.kernels.fp8_gemm import fp8_linear, prequantize_group
from kvfit.models.parallel import (OutputPart, ParamPart, Shard, all_reduce, check_source_shape, column_parts,
                                   make_fused_param, read_slice, source_shape)
from kvfit.quant_scheme import Fp8Scheme

SAFETENSORS_FP8 = ("F8_E4M3",)

logger = logging.getLogger("kvfit")


def is_fp8_source(source) -> bool:
    """Whether a checkpoint tensor (torch.Tensor or lazy safetensors slice) is float8_e4m3fn."""
    if isinstance(source, torch.Tensor):
        return source.dtype == FP8_DTYPE
    return source.get_dtype() in SAFETENSORS_FP8


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
                      "F8_E5M2": "float8_e5m2"}


def source_dtype_name(source) -> str:
    """A checkpoint tensor's dtype as torch names it (float32, bfloat16, float8_e4m3fn, ...)."""
    if isinstance(source, torch.Tensor):
        return str(source.dtype).removeprefix("torch.")
    return SAFETENSORS_DTYPES.get(source.get_dtype(), source.get_dtype())


FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e8m0fnu)


def scale_values(source, name: str, scheme: Fp8Scheme | None) -> torch.Tensor:
    """A checkpoint's scale (a tensor, or a lazy safetensors slice read whole: [...] reads a 0-dim one, [:] does
    not) as fp32: a float dtype as it is; uint8 exponent bytes (2^(b - 127), float8_e8m0fnu's encoding) only where
    quantization_config says scale_fmt "ue8m0". Any other dtype is a ConfigError: its raw numbers taken as
    scales would run a wrong model without a word. So is a NaN, an infinity or a negative scale (0 is allowed:
    an all-zero row's)."""
    value = source if isinstance(source, torch.Tensor) else source[...]
    if value.dtype in FLOAT_SCALE_DTYPES:
        return _finite_scales(value.float(), name)
    if value.dtype == torch.uint8 and scheme is not None and scheme.ue8m0_scales:
        return _finite_scales(value.view(torch.float8_e8m0fnu).float(), name)
    hint = (" (uint8 weight scales are read as e8m0 exponents only with quant_method \"fp8\" and scale_fmt "
            "\"ue8m0\")") if value.dtype == torch.uint8 else ""
    raise ConfigError(f"checkpoint tensor {name} is {str(value.dtype).removeprefix('torch.')}, but a scale must be "
                      f"a float (float32, bfloat16, float16, float64 or float8_e8m0fnu){hint}; the checkpoint does "
                      "not match config.json")


def _finite_scales(value: torch.Tensor, name: str) -> torch.Tensor:
    bad = value[~(torch.isfinite(value) & (value >= 0))]
    if bad.numel():
        raise ConfigError(f"checkpoint tensor {name} holds {bad.numel()} scale(s) that are not finite numbers >= 0 "
                          f"(e.g. {bad[0].item()}); they would turn its outputs to NaN or flip their signs: the "
                          "checkpoint is damaged (re-download it, or recalibrate)")
    return value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b with W [rows, in] in FP8. Column-parallel: the parts' output rows on this rank, fused;
    row-parallel (row=True, one part): input columns [in_start, in_start + in_size), the partial sums
    all-reduced, the bias added once after. name: the layer's module name, for errors."""

    dense_weight = None                # no 16-bit matrix for a fused one-token kernel to read

    def __init__(self, in_features: int, parts: Sequence[OutputPart], bias: bool, dtype, device, scheme: Fp8Scheme,
                 name: str, in_start: int = 0, in_size: int | None = None, row: bool = False, tp_size: int = 1):
        super().__init__()
        assert not row or len(parts) == 1, parts
        self.scheme, self.name, self.row, self.tp_size, self.parts = scheme, name, row, tp_size, tuple(parts)
        in_size = in_features if in_size is None else in_size
        self.in_shard = None if in_size == in_features else Shard(1, in_start, in_size)
        rows = sum(part.size for part in parts)
        if row:
            (part,) = parts
            weight_parts = [ParamPart(f"{part.name}.weight", (part.rows, in_features), self.in_shard, slice(0, rows))]
        else:
            weight_parts = column_parts(parts, "weight", (in_features,))
        self.weight = make_fused_param(weight_parts, (rows, in_size), FP8_DTYPE, device)     # [rows, in here]
        self.weight.weight_loader = self._load_weight
        scale = self._make_scale(in_features, rows, device)
        setattr(self, self.scale_name, scale)
        scale.weight_loader = self._load_scale
        scale.derived = scheme.online                  # online: made from the weight, not in the checkpoint
        scale.quant_scale = True
        self.input_scale = None
        if scheme.activation == "static":               # one per part: [parts]
            self.input_scale = self._per_part("input_scale", device)
            self.input_scale.weight_loader = self._load_scale
            self.input_scale.quant_scale = True
        # row-parallel: the bias is added once, after the sum over ranks
        self.bias = None
        if bias:
            bias_parts = column_parts([OutputPart(p.name, p.rows, 0, p.rows) for p in parts] if row else parts,
                                      "bias")
            self.bias = make_fused_param(bias_parts, (rows,), dtype, device)
        self.qweight: Fp8Weight | None = None          # set by finalize() after loading

    @property
    def scale_name(self) -> str:
        return "weight_scale" if self.scheme.online else self.scheme.scale_name

    @property
    def weight_scale_param(self) -> torch.nn.Parameter:
        return getattr(self, self.scale_name)

    def _per_part(self, leaf: str, device) -> torch.nn.Parameter:
        parts = [ParamPart(f"{p.name}.{leaf}", (1,), None, slice(i, i + 1)) for i, p in enumerate(self.parts)]
        return make_fused_param(parts, (len(parts),), torch.float32, device)

    def _make_scale(self, in_features: int, rows: int, device) -> torch.nn.Parameter:
        scheme = self.scheme
        if scheme.weight_strategy == "tensor":
            return self._per_part(self.scale_name, device)                     # [parts]
        if scheme.weight_strategy == "channel":
            parts = column_parts(self.parts, self.scale_name, (1,))
            return make_fused_param(parts, (rows, 1), torch.float32, device)    # [rows, 1]
        bn, bk = scheme.block_size
        if self.row:
            (part,) = self.parts
            shard = self._block_shard(self.in_shard, bk)
            cols = _cdiv(in_features, bk) if shard is None else shard.size
            full = (_cdiv(part.rows, bn), _cdiv(in_features, bk))
            parts = [ParamPart(f"{part.name}.{self.scale_name}", full, shard, slice(0, full[0]))]
            return make_fused_param(parts, (full[0], cols), torch.float32, device)
        parts, offset = [], 0
        for part in self.parts:                 # each part's row blocks; a fused part before another is whole blocks
            shard = self._block_shard(None if part.size == part.rows else Shard(0, part.start, part.size), bn)
            blocks = _cdiv(part.size, bn)
            parts.append(ParamPart(f"{part.name}.{self.scale_name}", (_cdiv(part.rows, bn), _cdiv(in_features, bk)),
                                   shard, slice(offset, offset + blocks)))
            offset += blocks
        return make_fused_param(parts, (offset, _cdiv(in_features, bk)), torch.float32, device)

    def _block_shard(self, shard: Shard | None, unit: int) -> Shard | None:
        """The scale blocks of a weight shard; a shard not on block boundaries is a ConfigError."""
        if shard is None:
            return None
        if shard.start % unit or shard.size % unit:
            raise ConfigError(f"{self.name}: --tensor-parallel-size {self.tp_size} splits it at "
                              f"{'column' if self.row else 'row'} {shard.start} (+{shard.size}), not on its "
                              f"{self.scheme.block_size} scale blocks; use a smaller --tensor-parallel-size")
        return Shard(shard.dim, shard.start // unit, shard.size // unit)

    # loading ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load_weight(self, param: torch.nn.Parameter, index: int, name: str, source) -> None:
        part = param.parts[index]
        check_source_shape(name, source, part.full_shape)
        if self.scheme.online:
            if is_fp8_source(source):
                raise ConfigError(f"checkpoint tensor {name} is already float8 but config.json has no "
                                  "quantization_config; the checkpoint is incomplete (re-download it)")
            self.set_part(index, read_slice(part.shard, source).to(param.device))
            return
        if not is_fp8_source(source):
            raise ConfigError(f"checkpoint tensor {name} is {source_dtype_name(source)} but quantization_config "
                              f"({self.scheme.method}) says float8_e4m3fn; the weights do not match config.json")
        param[part.rows].copy_(read_slice(part.shard, source))

    @torch.no_grad()
    def _load_scale(self, param: torch.nn.Parameter, index: int, name: str, source) -> None:
        part = param.parts[index]
        shape, full = source_shape(source), part.full_shape
        # per-tensor scales come as [] or [1], per-channel ones as [N, 1] or [N] (compressed-tensors versions)
        fits = (shape == full or (len(full) == 1 and full[0] == 1 and shape in ((), (1,)))
                or (len(full) == 2 and full[1] == 1 and shape == (full[0],) and param is not self.input_scale))
        if not fits:
            raise ConfigError(f"checkpoint tensor {name} has shape {list(shape)} but a {self.scheme.weight_strategy} "
                              f"scale of this layer is {list(full)}; the scales do not match config.json's "
                              "quantization_config")
        target = param[part.rows]
        value = scale_values(source if shape == () else read_slice(part.shard, source), name, self.scheme)
        if param is self.input_scale and not (bool(torch.isfinite(value).all()) and bool((value > 0).all())):
            raise ConfigError(f"checkpoint tensor {name} is {value.flatten().tolist()[:4]}, not a positive number: a "
                              "static activation scale of 0 or less quantizes every input to garbage; the checkpoint "
                              "is damaged (re-download it, or recalibrate)")
        target.copy_(value.reshape(target.shape))

    @torch.no_grad()
    def set_part(self, index: int, weight: torch.Tensor) -> None:
        """Quantize part `index`'s 16-bit (or fp32) weight [its rows here, in here] into this layer's FP8 weight
        and scale, as the scheme says (online and dummy weights)."""
        scheme = self.scheme
        if scheme.weight_strategy == "block":
            wq, scale = quantize_weight_blocks(weight, scheme.block_size)
        elif scheme.weight_strategy == "channel":
            wq, scale = quantize_weight_per_channel(weight)
        else:
            wq, scale = quantize_weight_per_tensor(weight)
        self.weight[self.weight.parts[index].rows].copy_(wq)
        target = self.weight_scale_param[self.weight_scale_param.parts[index].rows]
        target.copy_(scale.reshape(target.shape))

    def finalize(self) -> None:
        """The Fp8Weight the GEMM reads: per-tensor scales widened to one per row (same values); one static input
        scale, the largest of the parts' (one GEMM reads one quantized input)."""
        scale = self.weight_scale_param
        if self.scheme.weight_strategy == "tensor" and scale.dim() == 1:
            sizes = torch.tensor([part.size for part in self.parts], device=scale.device)
            scale.data = scale.data.repeat_interleave(sizes).reshape(-1, 1).contiguous()     # [rows, 1]
        input_scale = None
        if self.input_scale is not None:
            values = self.input_scale.data                                                 # [parts]
            # one GEMM reads one quantized input: the largest of the parts' static scales (vLLM's choice), so no
            # part's input saturates; where they differ the others lose a little precision, and the log says so
            input_scale = values.max().reshape(1)
            if not bool((values == values[0]).all()):
                names = ", ".join(part.name.rsplit(".", 1)[-1] for part in self.parts)
                logger.info("%s: the checkpoint's static input_scale differs among %s (%s); the fused GEMM quantizes "
                            "its input with the largest", self.name, names, values.tolist())
        self.qweight = Fp8Weight(self.weight.data, scale.data, self.scheme.block_size, input_scale,
                                 self.scheme.activation_ub)

    def prequantize_group(self, x: torch.Tensor) -> int | None:
        """Columns per scale in which a kernel before this layer may quantize its input x [T, in here] for it
        (a PreQuantized input), or None (fp8_gemm.prequantize_group)."""
        return prequantize_group(x, self.qweight)

    def forward(self, x: torch.Tensor | PreQuantized) -> torch.Tensor:
        # x: [T, in here] -> [T, rows] (row-parallel: summed over ranks)
        if not self.row:
            return fp8_linear(x, self.qweight, self.bias)
        y = all_reduce(fp8_linear(x, self.qweight), self.tp_size)
        return y if self.bias is None else y + self.bias


QUANT_TENSOR_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".activation_scale")


def check_unloaded_tensor(name: str, source, scheme: Fp8Scheme | None, into: torch.nn.Parameter | None = None
                          ) -> None:
    """A ConfigError where an FP8 tensor (or a weight's scale) would be dropped or cast into a 16-bit parameter
    (`into`): loading it as 16-bit numbers would run a wrong model. Other tensors pass."""
    if into is not None and into.dtype == FP8_DTYPE:
        return
    if not (is_fp8_source(source) or (into is None and name.endswith(QUANT_TENSOR_SUFFIXES))):
        return
    if scheme is None:
        raise ConfigError(f"checkpoint tensor {name} is {source_dtype_name(source)} (an FP8 checkpoint's) but "
                          "config.json has no quantization_config; kvfit will not load FP8 weights as 16-bit ones: "
                          "restore the checkpoint's config.json")
    if into is None and name.endswith((".input_scale", ".activation_scale")) and scheme.activation != "static":
        raise ConfigError(f"checkpoint tensor {name} is a static activation scale but config.json's "
                          f"quantization_config ({scheme.method}) makes activations dynamic; the checkpoint does not "
                          "match it (set the activations static, or remove the input scales)")
    where = f"holds {name} in {into.dtype}" if into is not None else f"has no place for {name}"
    raise ConfigError(f"checkpoint tensor {name} is quantized but kvfit {where}: the layer is left in 16 bits by "
                      f"quantization_config ({scheme.method}'s ignore list) or is one kvfit does not run in FP8 "
                      "(embedding, lm_head, router); the checkpoint does not match config.json")
