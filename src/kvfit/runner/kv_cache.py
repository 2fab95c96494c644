"""Allocate the per-layer KV caches from the layout KVSpec owns."""

from __future__ import annotations

import torch

from kvfit.errors import CapacityError
from kvfit.kv.spec import KVSpec
from kvfit.units import gib

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8_e4m3": torch.float8_e4m3fn}

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(spec: KVSpec, num_blocks: int, device: torch.device) -> KVCaches:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]; not zero-filled.

    Unwritten slots are never read: attention masks every position past a sequence's length.
    """
    shape = spec.layer_shape(num_blocks)
    dtype = TORCH_DTYPES[spec.dtype]
    caches: KVCaches = []
    try:
        for _ in range(spec.num_layers):
            k = torch.empty(shape, dtype=dtype, device=device)
            v = k if spec.mla else torch.empty(shape, dtype=dtype, device=device)
            caches.append((k, v))
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        caches.clear()
        asked = num_blocks * spec.bytes_per_block
        raise CapacityError(
            f"allocating the KV cache ({num_blocks} blocks, {gib(asked)}) failed on {device}: "
            f"{str(exc).splitlines()[0]}; lower --gpu-memory-utilization, --kv-cache-memory or "
            "--num-gpu-blocks-override") from None
    return caches
