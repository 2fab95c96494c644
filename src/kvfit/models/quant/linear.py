"""FP8 linear layers: column- and row-parallel like parallel.py's, holding the weight in FP8 and its scales.

Parameter names are the checkpoint's (`weight`, `weight_scale` or `weight_scale_inv`, `input_scale`), so the
loader maps them 1:1; each carries a `weight_loader(name, source)` that checks the tensor's dtype and shape
(a 16-bit tensor where the checkpoint should hold FP8 is an error, never a silent cast) and reads this rank's
part. With --quantization fp8 (online) the `weight` loader reads the 16-bit tensor and quantizes it per
output channel; its scale is derived (not in the checkpoint). After loading, `finalize()` builds the
Fp8Weight the GEMM reads (a per-tensor scale widened to one per row). `fuse_fp8_rows` fuses q/k/v and
gate/up as fusion.fuse_rows does for 16-bit weights, where their scales allow.
"""

from __future__ import annotations

import torch

from kvfit.errors import ConfigError
from kvfit.kernels.fp8 import (FP8_DTYPE, Fp8Weight, quantize_weight_blocks, quantize_weight_per_channel,
                               quantize_weight_per_tensor)
from kvfit.kernels.fp8_gemm import fp8_linear
from kvfit.models.fusion import fuse_rows
from kvfit.models.parallel import ColumnLinear, RowLinear, Shard, all_reduce, make_param, read_shard, source_shape
from kvfit.quant_scheme import Fp8Scheme

SAFETENSORS_FP8 = ("F8_E4M3",)


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


def _scale_param(shape: tuple[int, ...], shard: Shard | None, device) -> torch.nn.Parameter:
    return make_param(shape, shard, torch.float32, device)


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b with W [out, in] in FP8. Column-parallel: this rank holds output rows [start, start +
    size); row-parallel (row=True): input columns [start, start + size), the partial sums all-reduced,
    the bias added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, scheme: Fp8Scheme,
                 name: str, start: int = 0, size: int | None = None, row: bool = False, tp_size: int = 1):
        super().__init__()
        self.scheme, self.name, self.row, self.tp_size = scheme, name, row, tp_size
        full = in_features if row else out_features
        size = full if size is None else size
        shard = None if size == full else Shard(1 if row else 0, start, size)
        self.weight = make_param((out_features, in_features), shard, FP8_DTYPE, device)
        self.weight.weight_loader = self._load_weight
        scale = self._make_scale(in_features, out_features, shard, device)
        setattr(self, self.scale_name, scale)
        scale.weight_loader = self._load_scale
        scale.derived = scheme.online                  # online: made from the weight, not in the checkpoint
        scale.quant_scale = True
        self.input_scale = None
        if scheme.activation == "static":
            self.input_scale = _scale_param((1,), None, device)
            self.input_scale.weight_loader = self._load_scale
            self.input_scale.quant_scale = True
        # row-parallel: the bias is added once, after the sum over ranks
        bias_shard = None if row else shard
        self.bias = make_param((out_features,), bias_shard, dtype, device) if bias else None
        self.qweight: Fp8Weight | None = None          # set by finalize() after loading

    @property
    def scale_name(self) -> str:
        return "weight_scale" if self.scheme.online else self.scheme.scale_name

    @property
    def weight_scale_param(self) -> torch.nn.Parameter:
        return getattr(self, self.scale_name)

    def _make_scale(self, in_features: int, out_features: int, shard: Shard | None, device):
        scheme = self.scheme
        if scheme.weight_strategy == "block":
            bn, bk = scheme.block_size
            unit = bk if self.row else bn
            if shard is not None and (shard.start % unit or shard.size % unit):
                raise ConfigError(f"{self.name}: --tensor-parallel-size {self.tp_size} splits it at "
                                  f"{'column' if self.row else 'row'} {shard.start} (+{shard.size}), not on its "
                                  f"{scheme.block_size} scale blocks; use a smaller --tensor-parallel-size")
            block_shard = None if shard is None else Shard(shard.dim, shard.start // unit, shard.size // unit)
            return _scale_param((-(-out_features // bn), -(-in_features // bk)), block_shard, device)
        if scheme.weight_strategy == "channel":
            return _scale_param((out_features, 1), None if self.row else shard, device)
        return _scale_param((1,), None, device)

    # loading ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load_weight(self, name: str, source) -> None:
        param = self.weight
        shape = source_shape(source)
        if shape != param.full_shape:
            raise ConfigError(f"checkpoint tensor {name} has shape {list(shape)} but config.json needs "
                              f"{list(param.full_shape)}; the weights do not match this config.json")
        if self.scheme.online:
            if is_fp8_source(source):
                raise ConfigError(f"checkpoint tensor {name} is already float8 but config.json has no "
                                  "quantization_config; the checkpoint is incomplete (re-download it)")
            quantize_into(self, read_shard(param, source).to(param.device))
            return
        if not is_fp8_source(source):
            raise ConfigError(f"checkpoint tensor {name} is {source_dtype_name(source)} but quantization_config "
                              f"({self.scheme.method}) says float8_e4m3fn; the weights do not match config.json")
        param.copy_(read_shard(param, source))

    @torch.no_grad()
    def _load_scale(self, name: str, source) -> None:
        param = self.input_scale if name.endswith("input_scale") else self.weight_scale_param
        shape = source_shape(source)
        full = param.full_shape
        # per-tensor scales come as [] or [1], per-channel ones as [N, 1] or [N] (compressed-tensors versions)
        fits = (shape == full or (len(full) == 1 and full[0] == 1 and shape in ((), (1,)))
                or (len(full) == 2 and full[1] == 1 and shape == (full[0],) and param is not self.input_scale))
        if not fits:
            raise ConfigError(f"checkpoint tensor {name} has shape {list(shape)} but a {self.scheme.weight_strategy} "
                              f"scale of this layer is {list(full)}; the scales do not match config.json's "
                              "quantization_config")
        if shape == ():
            value = source if isinstance(source, torch.Tensor) else source[...]   # [:] fails on a 0-dim slice
            param.copy_(value.reshape(1).float())
            return
        param.copy_(read_shard(param, source).float().reshape(param.shape))

    def finalize(self) -> None:
        """The Fp8Weight the GEMM reads: per-tensor scales widened to one per row (same values)."""
        scale = self.weight_scale_param
        if self.scheme.weight_strategy == "tensor" and scale.dim() == 1:
            scale.data = scale.data.reshape(1, 1).expand(self.weight.shape[0], 1).contiguous()
        self.qweight = Fp8Weight(self.weight.data, scale.data, self.scheme.block_size,
                                 None if self.input_scale is None else self.input_scale.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.row:
            return fp8_linear(x, self.qweight, self.bias)
        y = all_reduce(fp8_linear(x, self.qweight), self.tp_size)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def quantize_into(layer: Fp8Linear, weight: torch.Tensor) -> None:
    """Quantize this rank's 16-bit (or fp32) weight [out, in] into layer's FP8 weight and scale, as its scheme
    says (online and dummy weights)."""
    scheme = layer.scheme
    if scheme.weight_strategy == "block":
        wq, scale = quantize_weight_blocks(weight, scheme.block_size)
    elif scheme.weight_strategy == "channel":
        wq, scale = quantize_weight_per_channel(weight)
    else:
        wq, scale = quantize_weight_per_tensor(weight)
    layer.weight.copy_(wq)
    layer.weight_scale_param.copy_(scale.reshape(layer.weight_scale_param.shape))


def fuse_fp8_rows(linears: list[Fp8Linear]) -> tuple[Fp8Weight | None, torch.Tensor | None]:
    """One Fp8Weight for linears reading the same input (q/k/v, gate/up): weights and per-row scales
    concatenated by output rows, each linear re-pointed at its rows (no second copy). (None, None) where
    the scales cannot be joined: block scales whose row blocks do not end at every part's last row, or
    different static input scales (each keeps its own GEMM)."""
    first = linears[0].qweight
    if first.block_size is not None and any(lin.weight.shape[0] % first.block_size[0] for lin in linears[:-1]):
        return None, None
    if first.input_scale is not None and any(not torch.equal(lin.qweight.input_scale, first.input_scale)
                                             for lin in linears):
        return None, None
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)                 # [sum(out), in] fp8
    scale = torch.cat([lin.weight_scale_param.data for lin in linears], dim=0)
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears], dim=0) if has_bias else None
    row = scale_row = 0
    for lin in linears:
        n, s = lin.weight.shape[0], lin.weight_scale_param.shape[0]
        lin.weight.data = weight[row:row + n]
        lin.weight_scale_param.data = scale[scale_row:scale_row + s]
        if has_bias:
            lin.bias.data = bias[row:row + n]
        lin.finalize()
        row, scale_row = row + n, scale_row + s
    return Fp8Weight(weight, scale, first.block_size, first.input_scale), bias


def make_linear(in_features: int, out_features: int, bias: bool, dtype, device, scheme: Fp8Scheme | None,
                name: str, start: int = 0, size: int | None = None, row: bool = False, tp_size: int = 1
                ) -> torch.nn.Module:
    """The linear layer `name` (its checkpoint name) is: Fp8Linear where scheme quantizes it, else parallel.py's
    ColumnLinear (row=False: output rows [start, start + size) here) or RowLinear (input columns)."""
    if scheme is not None and scheme.quantizes(name):
        return Fp8Linear(in_features, out_features, bias, dtype, device, scheme, name, start, size, row, tp_size)
    if row:
        return RowLinear(in_features, out_features, bias, dtype, device, start, size, tp_size)
    return ColumnLinear(in_features, out_features, bias, dtype, device, start, size)


def fuse_projection(linears) -> tuple[torch.Tensor | Fp8Weight | None, torch.Tensor | None]:
    """fusion.fuse_rows for 16-bit linears, fuse_fp8_rows for FP8 ones; (None, None) for a mix (some
    ignored by the checkpoint's quantization_config): each keeps its own GEMM."""
    quantized = [isinstance(lin, Fp8Linear) for lin in linears]
    if all(quantized):
        return fuse_fp8_rows(linears)
    if any(quantized):
        return None, None
    return fuse_rows(linears)


def project(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias for a fused weight: an Fp8Weight through fp8_linear, a tensor through gemv.linear."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    from kvfit.kernels.gemv import linear
    return linear(x, weight, bias)


def finalize_quantized(model: torch.nn.Module) -> None:
    """Call after the weights are in (checkpoint or dummy): every Fp8Linear builds the weight its GEMM reads."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.finalize()


QUANT_TENSOR_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


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
    where = f"holds {name} in {into.dtype}" if into is not None else f"has no place for {name}"
    raise ConfigError(f"checkpoint tensor {name} is quantized but kvfit {where}: the layer is left in 16 bits by "
                      f"quantization_config ({scheme.method}'s ignore list) or is one kvfit does not run in FP8 "
                      "(embedding, lm_head, router); the checkpoint does not match config.json")
