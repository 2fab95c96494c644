"""Phi-3 (Phi3ForCausalLM): the Llama decoder (RMSNorm, SiLU-gated MLP, RoPE, no biases) whose checkpoint stores
q/k/v fused as self_attn.qkv_proj ([q; k; v] rows) and gate/up as mlp.gate_up_proj ([gate; up] rows).

kvfit builds those projections fused already, from parts named after Llama's tensors (q_proj, k_proj, v_proj;
gate_proj, up_proj). The loader splits each fused checkpoint tensor into those parts by rows (q: heads x head_dim,
k and v: kv heads x head_dim; gate and up: intermediate_size each), so each part loads as a Llama tensor would:
shape-checked, and with tensor parallelism only this rank's slice of each part read (lazily from safetensors).

An FP8 checkpoint (llm-compressor and the fp8 method quantize the fused linear as one module) splits the same way:
per-channel scales by the parts' rows, block scales by their row blocks (a part that starts inside a block and
leaves it cannot be given its own scales: a ConfigError), and a per-tensor weight scale or static input scale,
one for the fused tensor, goes to every part. The ignore list names checkpoint modules: a part is in FP8 as its
fused module is (PackedScheme).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from kvfit.errors import ConfigError
from kvfit.models.llama import CausalLM
from kvfit.models.parallel import check_source_shape, source_shape
from kvfit.quant_scheme import PACKED_MODULES, Fp8Scheme

# a fused tensor's leaves: split by rows (weights, per-channel and block scales) or one value for every part
ROW_LEAVES = ("weight", "weight_scale", "weight_scale_inv")
SHARED_LEAVES = ("input_scale",)


class RowBlock:
    """Rows [start, start + rows) of a lazy safetensors slice, itself indexable as one: reading a slice of it
    reads only those rows of the file."""

    def __init__(self, source, start: int, rows: int):
        self.source, self.start, self.rows = source, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *self.source.get_shape()[1:]]

    def get_dtype(self) -> str:
        return self.source.get_dtype()

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if not isinstance(index[0], slice) or index[0].step not in (None, 1):
            raise TypeError(f"RowBlock takes contiguous row slices, got {index[0]!r}")
        begin, end, _ = index[0].indices(self.rows)
        return self.source[(slice(self.start + begin, self.start + end), *index[1:])]


def row_block(source, start: int, rows: int):
    """Rows [start, start + rows) of a checkpoint tensor: a view of a torch.Tensor, a RowBlock of a lazy slice."""
    if isinstance(source, torch.Tensor):
        return source[start:start + rows]
    return RowBlock(source, start, rows)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedScheme(Fp8Scheme):
    """A scheme whose ignore list names the checkpoint's fused modules: a part kvfit builds (q_proj) is in FP8 as
    its fused module (qkv_proj) is, whatever patterns its own name would match."""

    packed: dict = dataclasses.field(default_factory=dict)    # fused leaf -> its parts' leaves

    def quantizes(self, module: str) -> bool:
        prefix, _, leaf = module.rpartition(".")
        for fused, parts in self.packed.items():
            if leaf in parts:
                return super().quantizes(f"{prefix}.{fused}")
        return super().quantizes(module)


class Phi3CausalLM(CausalLM):
    """The Llama decoder, loading Phi-3's fused qkv_proj and gate_up_proj tensors into its parts."""

    # a fused checkpoint tensor's leaf -> the parts it stacks by rows, in order (vLLM's packed_modules_mapping)
    packed_modules = PACKED_MODULES

    def __init__(self, facts, dtype, device, attention_backend, tp_rank: int = 0, tp_size: int = 1):
        scheme = facts.quantization
        if scheme is not None and (scheme.ignore or scheme.targets):     # both name the fused modules
            fields = {f.name: getattr(scheme, f.name) for f in dataclasses.fields(Fp8Scheme)}
            facts = dataclasses.replace(facts, quantization=PackedScheme(**fields, packed=self.packed_modules))
        super().__init__(facts, dtype, device, attention_backend, tp_rank, tp_size)

    def part_rows(self, leaf: str) -> tuple[int, ...]:
        """The rows of each part a fused checkpoint tensor stacks (its packed_modules order)."""
        cfg = self.config
        if leaf == "qkv_proj":
            kv_rows = cfg.num_kv_heads * cfg.head_dim
            return cfg.num_heads * cfg.head_dim, kv_rows, kv_rows
        return cfg.intermediate_size, cfg.intermediate_size

    def split_packed(self, named_tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """Each fused checkpoint tensor as its parts' tensors (model.layers.0.self_attn.qkv_proj.weight ->
        ...q_proj.weight, ...k_proj.weight, ...v_proj.weight; FP8 scales as the module docstring says), every
        other tensor as it is."""
        for name, source in named_tensors:
            module, _, leaf = name.rpartition(".")
            prefix, _, packed = module.rpartition(".")
            if packed not in self.packed_modules or leaf not in ROW_LEAVES + SHARED_LEAVES:
                yield name, source
                continue
            parts = [f"{prefix}.{part}.{leaf}" for part in self.packed_modules[packed]]
            shape = source_shape(source)
            if leaf in SHARED_LEAVES or (leaf != "weight" and len(shape) < 2 and
                                        self.scheme is not None and self.scheme.weight_strategy == "tensor"):
                yield from ((part, source) for part in parts)        # one scale for the fused tensor
                continue
            for part, (start, size) in zip(parts, self.split_rows(name, source, packed, leaf)):
                yield part, row_block(source, start, size)

    def split_rows(self, name: str, source, packed: str, leaf: str) -> list[tuple[int, int]]:
        """(first row, rows) of each part in fused tensor `name`: its weight rows, or for a block scale its row
        blocks (a ConfigError where a part starts inside a block and leaves it)."""
        rows = self.part_rows(packed)
        bn = self.scheme.block_size[0] if leaf != "weight" and self.scheme and self.scheme.block_size else 1
        check_source_shape(name, source, (-(-sum(rows) // bn), *source_shape(source)[1:]))
        spans, start = [], 0
        for size in rows:
            first, last = start // bn, (start + size - 1) // bn
            if start % bn and first != last:
                raise ConfigError(f"checkpoint tensor {name}: a part of {packed} starts at row {start}, inside a "
                                  f"{bn}-row scale block, and leaves it; kvfit cannot give that part its own block "
                                  "scales (use the 16-bit checkpoint with --quantization fp8)")
            spans.append((first, last - first + 1))
            start += size
        return spans

    def missing_name(self, param_name: str) -> str:
        """A part's name as the checkpoint stores it: ...self_attn.q_proj.weight -> ...self_attn.qkv_proj.weight."""
        module, _, leaf = param_name.rpartition(".")
        prefix, _, part = module.rpartition(".")
        for packed, parts in self.packed_modules.items():
            if part in parts and leaf in ROW_LEAVES + SHARED_LEAVES:
                return f"{prefix}.{packed}.{leaf}"
        return param_name

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """CausalLM.load_weights over the checkpoint with its fused tensors split into their parts; an error about a
        part names the fused tensor the checkpoint holds (q_proj.weight_scale -> qkv_proj.weight_scale)."""
        try:
            super().load_weights(self.split_packed(named_tensors))
        except ConfigError as exc:
            raise ConfigError(self.checkpoint_names_in(str(exc))) from None

    @classmethod
    def checkpoint_names_in(cls, message: str) -> str:
        """message with each part's module name (….q_proj.…, ….gate_proj.…) as the checkpoint's fused one."""
        for packed, parts in cls.packed_modules.items():
            message = re.sub(rf"\.(?:{'|'.join(parts)})(?=[.\s;:,]|$)", f".{packed}", message)
        return message
