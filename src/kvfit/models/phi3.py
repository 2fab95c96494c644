"""Phi-3 (Phi3ForCausalLM): the Llama decoder (RMSNorm, SiLU-gated MLP, RoPE, no biases) whose checkpoint stores
q/k/v fused as self_attn.qkv_proj ([q; k; v] rows) and gate/up as mlp.gate_up_proj ([gate; up] rows).

kvfit builds those projections fused already, from parts named after Llama's tensors (q_proj, k_proj, v_proj;
gate_proj, up_proj). The loader splits each fused checkpoint tensor into those parts by rows (q: heads x head_dim,
k and v: kv heads x head_dim; gate and up: intermediate_size each), so each part loads as a Llama tensor would:
shape-checked, and with tensor parallelism only this rank's slice of each part read (lazily from safetensors).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from kvfit.errors import ConfigError
from kvfit.models.llama import CausalLM
from kvfit.models.parallel import check_source_shape, source_shape


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


class Phi3CausalLM(CausalLM):
    """The Llama decoder, loading Phi-3's fused qkv_proj and gate_up_proj tensors into its parts."""

    # a fused checkpoint tensor's leaf -> the parts it stacks by rows, in order (nano-vllm's packed_modules_mapping)
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, facts, dtype, device, attention_backend, tp_rank: int = 0, tp_size: int = 1):
        if facts.quantization is not None and not facts.quantization.online:
            raise ConfigError(f"{facts.architecture} checkpoints with quantized weights ({facts.quantization.method}) "
                              "are not supported; use its 16-bit checkpoint (--quantization fp8 quantizes it at load)")
        super().__init__(facts, dtype, device, attention_backend, tp_rank, tp_size)

    def part_rows(self, leaf: str) -> tuple[int, ...]:
        """The rows of each part a fused checkpoint tensor stacks (its packed_modules order)."""
        cfg = self.config
        if leaf == "qkv_proj":
            kv_rows = cfg.num_kv_heads * cfg.head_dim
            return cfg.num_heads * cfg.head_dim, kv_rows, kv_rows
        return cfg.intermediate_size, cfg.intermediate_size

    def split_packed(self, named_tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """Each fused checkpoint weight as its parts' tensors (model.layers.0.self_attn.qkv_proj.weight ->
        ...q_proj.weight, ...k_proj.weight, ...v_proj.weight), every other tensor as it is."""
        for name, source in named_tensors:
            module, _, leaf = name.rpartition(".")
            prefix, _, packed = module.rpartition(".")
            if packed not in self.packed_modules or leaf != "weight":
                yield name, source
                continue
            rows = self.part_rows(packed)
            check_source_shape(name, source, (sum(rows), *source_shape(source)[1:]))
            start = 0
            for part, size in zip(self.packed_modules[packed], rows):
                yield f"{prefix}.{part}.{leaf}", row_block(source, start, size)
                start += size

    def missing_name(self, param_name: str) -> str:
        """A part's name as the checkpoint stores it: ...self_attn.q_proj.weight -> ...self_attn.qkv_proj.weight."""
        module, _, leaf = param_name.rpartition(".")
        prefix, _, part = module.rpartition(".")
        for packed, parts in self.packed_modules.items():
            if part in parts and leaf == "weight":
                return f"{prefix}.{packed}.{leaf}"
        return param_name

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """CausalLM.load_weights over the checkpoint with its fused tensors split into their parts."""
        super().load_weights(self.split_packed(named_tensors))
