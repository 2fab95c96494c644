"""Test helper: the body of one tensor-parallel rank (CPU, gloo), run by torch.multiprocessing.spawn."""

from __future__ import annotations

import torch
import torch.distributed as dist
from paged_batch import PagedCache

from kvfit.attention.torch_ref import TorchReferenceBackend
from kvfit.model_facts import load_model_facts
from kvfit.models.loader import load_model


@torch.inference_mode()
def _prefill_then_decode(model, facts, tokens: list[int], num_prefill: int) -> torch.Tensor:
    cache = PagedCache(facts, block_size=4, num_blocks=32, seed=1)
    ids, pos, meta = cache.step([("s", 0, tokens[:num_prefill])])
    rows = [model.compute_logits(model(ids, pos, cache.caches, meta))]
    for p in range(num_prefill, len(tokens)):
        ids, pos, meta = cache.step([("s", p, tokens[p:p + 1])])
        rows.append(model.compute_logits(model(ids, pos, cache.caches, meta)))
    return torch.cat(rows)                                               # [len(tokens), vocab]


def rank_main(rank: int, world: int, init_file: str, folders: list[str], tokens: list[int], num_prefill: int,
              out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for folder in folders:
            facts = load_model_facts(folder)
            model = load_model(folder, facts, torch.float32, "cpu", TorchReferenceBackend(),
                               tp_rank=rank, tp_size=world)
            results[folder] = _prefill_then_decode(model, facts, tokens, num_prefill)
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()
